"""Tensor parallelism as Megatron splits an MLP: fc1 by output features, fc2 by input features, one all-reduce."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


def megatron_mlp_shard(fc1: nn.Linear, fc2: nn.Linear, rank: int, world: int) -> tuple[nn.Linear, nn.Linear]:
    """This rank's slices of an MLP fc2(act(fc1(x))): fc1 split by output features (columns of Wᵀ), fc2 by
    input features (rows of Wᵀ). Each rank computes its partial output with no communication; one
    all-reduce sums them. fc2's bias is kept on rank 0 only, so that it is added once."""
    hidden = fc1.out_features
    if not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")
    if hidden % world:
        raise ValueError(f"hidden size {hidden} does not split evenly over {world} ranks")
    part = slice(rank * hidden // world, (rank + 1) * hidden // world)
    a = nn.Linear(fc1.in_features, hidden // world, bias=fc1.bias is not None)
    b = nn.Linear(hidden // world, fc2.out_features, bias=fc2.bias is not None and rank == 0)
    with torch.no_grad():
        a.weight.copy_(fc1.weight[part])
        if fc1.bias is not None:
            a.bias.copy_(fc1.bias[part])
        b.weight.copy_(fc2.weight[:, part])
        if b.bias is not None:
            b.bias.copy_(fc2.bias)
    return a, b


def tensor_parallel_mlp(
    x: torch.Tensor,
    a: nn.Linear,
    b: nn.Linear,
    activation: Callable[[torch.Tensor], torch.Tensor] = torch.nn.functional.gelu,
) -> torch.Tensor:
    """The MLP's output from this rank's shard: partial result, then a sum over ranks."""
    y = b(activation(a(x)))
    dist.all_reduce(y, op=dist.ReduceOp.SUM)
    return y
