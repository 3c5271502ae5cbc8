"""Megatron-style tensor parallelism on every rank of a torchrun job: one MLP (split, compute, all-reduce), then a
SmolLM2-shaped Llama decoder block forward and backward, split by labkit's Megatron shard and by torch's DTensor,
each compared with the unsplit block (float64, so any difference beyond rounding is a bug), with the collectives
each issues per block and the parameters each rank holds.

    torchrun --standalone --nproc_per_node=2 labs/scripts/tensor_parallel.py
"""

import contextlib
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from labkit.models import tiny_llama
from labkit.parallel.comm import count_collectives
from labkit.parallel.launch import rank_context, save_result
from labkit.parallel.tensor import (
    COLUMN_PARALLEL,
    ROW_PARALLEL,
    megatron_block_shard,
    megatron_mlp_shard,
    parallelize_block,
    tensor_parallel_mlp,
)

# SmolLM2-135M's block shape (head_dim 64, grouped-query attention, intermediate about 8/3 of hidden) at a size that
# splits over 2 ranks: 4 heads, 2 KV heads, 682 intermediate features. SmolLM2's own 9 heads and 3 KV heads do not.
BLOCK = {"hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 682, "batch": 2, "seq": 8}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|: a difference relative to the reference's scale."""
    return ((a - b).abs().max() / b.abs().max()).item()


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, a plain tensor as is."""
    return t.to_local() if isinstance(t, DTensor) else t


def _compare(shard: nn.Module, out: torch.Tensor, x: torch.Tensor, full: nn.Module, reference: tuple) -> dict:
    """Output, input gradient and every weight gradient of a shard against the unsplit block's `reference` (output,
    input gradient) and the matching slice of each sharded weight's gradient; and the parameters the shard holds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    slices = {name: 0 for name in COLUMN_PARALLEL} | {name: 1 for name in ROW_PARALLEL}
    grads = {}
    for name, param in full.named_parameters():
        expected = param.grad
        module = name.removesuffix(".weight")
        if module in slices:
            expected = expected.chunk(world, slices[module])[rank]
        grads[name] = _relative(_local(shard.get_parameter(name).grad), expected)
    return {
        "out": _relative(out, reference[0]),
        "input_grad": _relative(x.grad, reference[1]),
        "weight_grads": grads,
        "params": sum(_local(p).numel() for p in shard.parameters()),
    }


def _forward_backward(block: nn.Module, x: torch.Tensor, rope: tuple, probe: torch.Tensor, counter: Any) -> tuple:
    """Run the block on a fresh leaf copy of x, loss = (out * probe).sum(), backward; `counter()` is entered around
    the forward and, separately, the backward. Returns (out, x, forward counts, backward counts)."""
    x = x.clone().requires_grad_()
    with counter() as forward:
        out = block(x, position_embeddings=rope)
    with counter() as backward, warnings.catch_warnings():
        # CommDebugMode's module tracker hooks the backward of modules whose inputs need no gradient; harmless
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        (out * probe).sum().backward()
    return out, x, forward, backward


def _block_case(rank: int, world: int, device: torch.device) -> dict[str, Any]:
    """The decoder block split two ways over the ranks, each compared with the unsplit block."""
    torch.manual_seed(0)  # the same full block, input and loss on every rank
    model = tiny_llama(
        hidden_size=BLOCK["hidden"],
        num_heads=BLOCK["heads"],
        num_kv_heads=BLOCK["kv_heads"],
        intermediate_size=BLOCK["intermediate"],
        num_layers=1,
    )
    model = model.to(device, torch.float64)
    full = model.model.layers[0]
    shape = (BLOCK["batch"], BLOCK["seq"], BLOCK["hidden"])
    x = torch.randn(shape, dtype=torch.float64, device=device)
    probe = torch.randn(shape, dtype=torch.float64, device=device)
    rope = model.model.rotary_emb(x, torch.arange(BLOCK["seq"], device=device)[None])

    out, xs = _forward_backward(full, x, rope, probe, contextlib.nullcontext)[:2]
    reference = (out.detach(), xs.grad)
    megatron = megatron_block_shard(full, rank, world)
    out, xs, forward, backward = _forward_backward(megatron, x, rope, probe, count_collectives)
    result = {
        "block": {**BLOCK, "head_dim": model.config.head_dim},
        "block_full_params": sum(p.numel() for p in full.parameters()),
        "megatron": _compare(megatron, out, xs, full, reference),
        "megatron_collectives": {"forward": dict(forward), "backward": dict(backward)},
    }
    mesh = init_device_mesh(device.type, (world,))
    for key, shared_input in (("dtensor", True), ("dtensor_unshared", False)):
        # DTensor issues functional collectives (c10d_functional.all_reduce), which CommDebugMode counts and
        # count_collectives, wrapping torch.distributed's Python functions, does not see. With shared_input the
        # count is Megatron's 2 + 2; without it each ColwiseParallel all-reduces its own input gradient: 2 + 5.
        block = parallelize_block(full, mesh, shared_input=shared_input)
        out, xs, forward, backward = _forward_backward(block, x, rope, probe, CommDebugMode)
        result[key] = _compare(block, out, xs, full, reference)
        result[f"{key}_collectives"] = {
            "forward": {str(op): n for op, n in forward.get_comm_counts().items()},
            "backward": {str(op): n for op, n in backward.get_comm_counts().items()},
        }
    return result


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
                **_block_case(rank, world, device),
            }
        )


if __name__ == "__main__":
    main()
