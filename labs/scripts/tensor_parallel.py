"""Megatron-style tensor parallelism of one MLP on every rank of a torchrun job: split, compute, all-reduce,
and compare with the unsplit MLP.

    torchrun --standalone --nproc_per_node=2 labs/scripts/tensor_parallel.py
"""

import torch
import torch.nn.functional as F
from torch import nn

from labkit.parallel.launch import rank_context, save_result
from labkit.parallel.tensor import megatron_mlp_shard, tensor_parallel_mlp


def main() -> None:
    with rank_context() as (rank, world, device):
        torch.manual_seed(0)  # the same full MLP and input on every rank
        fc1, fc2 = nn.Linear(64, 256).to(device), nn.Linear(256, 64).to(device)
        x = torch.randn(8, 64, device=device)
        full = fc2(F.gelu(fc1(x)))
        a, b = megatron_mlp_shard(fc1, fc2, rank, world)
        split = tensor_parallel_mlp(x, a.to(device), b.to(device))
        save_result(
            {
                "rank": rank,
                "world": world,
                "max_diff": (split - full).abs().max().item(),
                "shard_params": sum(p.numel() for p in (*a.parameters(), *b.parameters())),
                "full_params": sum(p.numel() for p in (*fc1.parameters(), *fc2.parameters())),
            }
        )


if __name__ == "__main__":
    main()
