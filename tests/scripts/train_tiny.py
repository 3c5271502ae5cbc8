"""Train a tiny GPT-2 (with dropout) from shards under labkit.train.fit; used by the kill -9 resume test.

python tests/scripts/train_tiny.py WORKDIR LOG [--steps N] [--delay SECONDS]
"""

import argparse
from pathlib import Path

import numpy as np

from labkit import shards
from labkit.models import tiny_gpt2
from labkit.train import TrainConfig, fit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("log")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args()
    work = Path(args.workdir)
    paths = sorted(work.glob("data/*.bin"))
    if not paths:
        stream = np.random.default_rng(0).integers(0, 128, size=6000)
        paths = shards.write_shards(stream, work / "data", 2000, vocab_size=128, tokenizer="synthetic")
    loader = shards.PacedLoader(shards.make_loader(paths, block_size=16, batch_size=4, seed=1), args.delay)
    model = tiny_gpt2(vocab_size=128, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    cfg = TrainConfig(
        steps=args.steps,
        lr=3e-3,
        warmup_steps=3,
        accum_steps=2,
        checkpoint_dir=str(work / "ckpt"),
        checkpoint_every=4,
        log_path=args.log,
        progress=False,
    )
    fit(model, loader, cfg)


if __name__ == "__main__":
    main()
