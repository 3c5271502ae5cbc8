"""Data-parallel training under torchrun: each rank trains on its own share of the shards, DDP averages
the gradients, and labkit.train.fit does the rest (accumulation with no_sync, checkpoints on rank 0).

    labkit shards                      (once: the training corpus as shards, in $LABKIT_CACHE)
    torchrun --standalone --nproc_per_node=2 labs/scripts/ddp_train.py --steps 20
    labkit slurm labs/scripts/ddp_train.py --nodes 2 --gpus-per-node 4 -- --steps 200   (a cluster)
"""

import argparse
import hashlib
import statistics
from pathlib import Path

import torch
from safetensors.torch import save_model

from labkit import shards
from labkit.models import tiny_llama
from labkit.parallel.launch import rank_context, save_result
from labkit.train import TrainConfig, fit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shards",
        type=Path,
        default=shards.default_dir(),
        help="directory of .bin shards (default: what `labkit shards` wrote, %(default)s)",
    )
    parser.add_argument("--vocab", type=int, help="vocabulary size (default: the shards')")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per micro-batch")
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--save", help="write the final weights here (safetensors), from rank 0")
    parser.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        default="float32",
        help="float64 to compare runs exactly (tests): fp32 sums differ with the rank count",
    )
    args = parser.parse_args()
    paths = sorted(args.shards.glob("*.bin"))
    if not paths:
        parser.error(f"no .bin shards in {args.shards}: write them with `labkit shards {args.shards}`")
    vocab = args.vocab or shards.read_shard_info(paths[0]).vocab_size
    with rank_context() as (rank, world, device):
        loader = shards.make_loader(
            paths, args.block, args.micro_batch, seed=0, rank=rank, world_size=world, device=device
        )
        model = tiny_llama(
            vocab_size=vocab,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=3 * args.hidden,
            max_position_embeddings=args.block,
            seed=0,
        ).to(device, getattr(torch, args.dtype))
        cfg = TrainConfig(steps=args.steps, lr=args.lr, accum_steps=args.accum, progress=rank == 0)
        history = fit(model, loader, cfg)
        if args.save and rank == 0:
            save_model(model, args.save)
        params = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
        save_result(
            {
                "rank": rank,
                "world": world,
                "losses": [h["loss"] for h in history],
                "params_sha256": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
                "tokens_per_s": statistics.median(h["tokens_per_s"] for h in history[1:] or history),
            }
        )


if __name__ == "__main__":
    main()
