"""Save checkpoints of a small model back to back, forever; the SIGKILL-during-write test kills it.

python tests/scripts/save_checkpoints.py DIRECTORY
"""

import sys

import torch

from labkit.checkpoint import save_checkpoint
from labkit.models import tiny_gpt2
from labkit.train import TrainConfig, make_optimizer


def main() -> None:
    model = tiny_gpt2(vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4, seed=0)  # ~12 MB with AdamW
    cfg = TrainConfig(steps=1, keep_checkpoints=2, progress=False)
    optimizer = make_optimizer(model, cfg)
    ids = torch.arange(16)[None]
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    step = 0
    while True:
        step += 1
        save_checkpoint(sys.argv[1], model, optimizer, scaler, step, {"epoch": 0, "index": step}, cfg)


if __name__ == "__main__":
    main()
