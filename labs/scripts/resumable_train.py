"""Train lab 03's small Llama with a checkpoint every few steps. Lab 03 kills one run of it with SIGKILL and
starts it again: `fit` resumes from the newest checkpoint, and the losses continue those of an
uninterrupted run.

    python labs/scripts/resumable_train.py SHARDS WORKDIR LOG --vocab-size V [--steps N] [--every K] [--delay S]
"""

import argparse
import os
from pathlib import Path

import torch

from labkit import bench, profiles, shards
from labkit.models import lab_llama
from labkit.train import TrainConfig, fit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shards", type=Path, help="directory of .bin shards (lab 03 writes them in section 3)")
    parser.add_argument("workdir", type=Path, help="the run's checkpoints go to WORKDIR/checkpoints")
    parser.add_argument("log", help="one JSON line per step")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4, help="steps between checkpoints")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds added per batch (changes no number)")
    args = parser.parse_args()
    # GPU kernels that add with atomics (embedding backward, some attention backward) give run-to-run
    # differences at rounding level; deterministic algorithms make two runs comparable bit for bit.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    profile, device = profiles.get_profile(), bench.as_device(None)
    paths = sorted(args.shards.glob("*.bin"))
    loader = shards.make_loader(paths, profile.train.block_size, args.batch_size, seed=0, device=device)
    cfg = TrainConfig(
        steps=args.steps,
        lr=2e-3,
        min_lr=2e-4,
        warmup_steps=args.steps // 5,
        grad_clip=1.0,
        checkpoint_dir=str(args.workdir / "checkpoints"),
        checkpoint_every=args.every,
        log_path=args.log,
        progress=False,
    )
    model = lab_llama(args.vocab_size, profile, seed=1).to(device)
    fit(model, shards.PacedLoader(loader, args.delay) if args.delay else loader, cfg)


if __name__ == "__main__":
    main()
