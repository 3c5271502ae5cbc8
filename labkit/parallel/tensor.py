"""Tensor parallelism as Megatron splits it: an MLP (fc1 by output features, fc2 by input features, one
all-reduce), and a whole Llama decoder block, forward and backward, both by hand (Megatron's f and g operators)
and with torch's DTensor (`parallelize_module`).

In a block, q/k/v and gate/up are column-parallel (each rank holds whole attention heads, whole KV heads under
grouped-query attention, and a slice of the MLP's intermediate features), o_proj and down_proj row-parallel; the
RMSNorms are replicated. Per block, Megatron all-reduces batch x seq x hidden activations twice in the forward
(g, after o_proj and down_proj) and twice in the backward (f, the input gradients of attention and MLP). DTensor
does the same when attention's and the MLP's inputs are made one replicated DTensor first; with ColwiseParallel
alone, each of q, k, v, gate and up all-reduces its own input gradient: five all-reduces in the backward.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.torchutil import check_bool, check_int, is_int

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


def megatron_mlp_shard(fc1: nn.Linear, fc2: nn.Linear, rank: int, world: int) -> tuple[nn.Linear, nn.Linear]:
    """This rank's slices of an MLP fc2(act(fc1(x))): fc1 split by output features (columns of Wᵀ), fc2 by
    input features (rows of Wᵀ). Each rank computes its partial output with no communication; one
    all-reduce sums them. fc2's bias is kept on rank 0 only, so that it is added once."""
    _check_mlp(fc1, fc2)
    check_int("world", world, minimum=1)
    check_int("rank", rank)
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
    _check_mlp(a, b)
    _check_tensor(x)
    if x.shape[-1:] != (a.in_features,):
        raise ValueError(f"x must end in a's {a.in_features} input features, got shape {tuple(x.shape)}")
    if not callable(activation):
        raise TypeError(f"activation must be callable (torch.nn.functional.gelu, say), got {activation!r}")
    y = b(activation(a(x)))
    dist.all_reduce(y, op=dist.ReduceOp.SUM)
    return y


def _check_mlp(fc1: nn.Linear, fc2: nn.Linear) -> None:
    """Two nn.Linear layers of which the second reads what the first writes."""
    for name, layer in (("fc1", fc1), ("fc2", fc2)):
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"{name} must be an nn.Linear, got {type(layer).__name__}")
    if fc2.in_features != fc1.out_features:
        raise ValueError(f"fc2 must read fc1's {fc1.out_features} outputs, but it has {fc2.in_features} inputs")


def _check_tensor(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")


# ----------------------------------------------------------------------------- Megatron's f and g


class _CopyToParallel(torch.autograd.Function):
    """f: identity forward; all-reduce of the input gradient backward (each rank's branch saw part of the use)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()  # autograd may hand the same gradient to others: reduce a copy
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad


class _ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce forward (sum the ranks' partial outputs); identity backward (the sum's gradient is replicated)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def copy_to_parallel(x: torch.Tensor) -> torch.Tensor:
    """Megatron's f, at the entry of a column-parallel region: x as is, its gradient summed over the ranks."""
    _check_tensor(x)
    return _CopyToParallel.apply(x)


def reduce_from_parallel(x: torch.Tensor) -> torch.Tensor:
    """Megatron's g, at the exit of a row-parallel region: x summed over the ranks, its gradient passed as is."""
    _check_tensor(x)
    return _ReduceFromParallel.apply(x)


# ----------------------------------------------------------------------------- a Llama decoder block


def _check_block(block: nn.Module, world: int) -> None:
    """Refuse, naming the rule, a block that is no bias-free LlamaDecoderLayer splitting into `world` equal parts."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if not isinstance(block, LlamaDecoderLayer):
        raise TypeError(f"block must be a transformers LlamaDecoderLayer, got {type(block).__name__}")
    if not is_int(world) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    names = (*COLUMN_PARALLEL, *ROW_PARALLEL)
    biased = [name for name in names if block.get_submodule(name).bias is not None]
    if biased:
        raise ValueError(f"the split handles Llama's bias-free projections; these have a bias: {', '.join(biased)}")
    config = block.self_attn.config
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": block.mlp.gate_proj.out_features,
    }
    for name, size in sizes.items():
        if size % world:
            raise ValueError(
                f"{name} ({size}) does not divide by world ({world}): each rank must hold whole attention heads, "
                "whole KV heads and an equal slice of the MLP"
            )


def _slice_linear(linear: nn.Linear, dim: int, rank: int, world: int) -> None:
    """Keep, in place, this rank's equal slice of the weight along `dim` (0: output features, 1: input features)."""
    part = linear.weight.detach().chunk(world, dim)[rank].clone()
    linear.weight = nn.Parameter(part, requires_grad=linear.weight.requires_grad)
    linear.out_features, linear.in_features = part.shape


def _f_on_input(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Forward pre-hook: f on the hidden states a column-parallel region reads (positional or keyword)."""
    if args:
        return (copy_to_parallel(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": copy_to_parallel(kwargs["hidden_states"])}


def _g_on_output(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """Forward hook: g on a row-parallel projection's partial output."""
    return reduce_from_parallel(out)


def megatron_block_shard(block: nn.Module, rank: int, world: int) -> nn.Module:
    """This rank's Megatron shard of a Llama decoder block, run with the block's own forward: a copy whose
    q/k/v and gate/up keep this rank's output features (whole heads, whole KV heads), o_proj and down_proj its input
    features, norms replicated; f enters attention and the MLP, g follows o_proj and down_proj. The block is not
    changed. Running the shard needs the default process group of `world` ranks."""
    _check_block(block, world)
    if not is_int(rank) or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank={rank!r}, world={world}")
    shard = copy.deepcopy(block)
    for name in COLUMN_PARALLEL:
        _slice_linear(shard.get_submodule(name), 0, rank, world)
    for name in ROW_PARALLEL:
        _slice_linear(shard.get_submodule(name), 1, rank, world)
    # transformers' LlamaAttention reshapes with view(..., -1, head_dim): local head counts need no attribute;
    # num_key_value_groups (heads per KV head) is the same on every rank, so it stays.
    shard.self_attn.register_forward_pre_hook(_f_on_input, with_kwargs=True)
    shard.mlp.register_forward_pre_hook(_f_on_input, with_kwargs=True)
    shard.self_attn.o_proj.register_forward_hook(_g_on_output)
    shard.mlp.down_proj.register_forward_hook(_g_on_output)
    return shard


def parallelize_block(block: nn.Module, mesh: DeviceMesh, *, shared_input: bool = True) -> nn.Module:
    """The same split with torch's DTensor tensor parallelism on a copy of a Llama decoder block: ColwiseParallel on
    q/k/v and gate/up, RowwiseParallel on o_proj and down_proj over a 1-D `mesh`. The block is not changed.
    `shared_input` makes attention's and the MLP's input one replicated DTensor (PrepareModuleInput), so that
    the q/k/v (gate/up) input gradients add up as partial sums and are all-reduced once, as Megatron's f does;
    without it each ColwiseParallel wraps the input itself and all-reduces its own input gradient."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh (init_device_mesh), got {type(mesh).__name__}")
    check_bool("shared_input", shared_input)
    if mesh.ndim != 1:
        raise ValueError(f"mesh must be 1-D (one tensor-parallel dimension), got {mesh.ndim}-D")
    _check_block(block, mesh.size())
    plan: dict[str, Any] = {name: ColwiseParallel() for name in COLUMN_PARALLEL}
    plan |= {name: RowwiseParallel() for name in ROW_PARALLEL}
    # LlamaDecoderLayer calls self_attn(hidden_states=...) by keyword and mlp(hidden_states) by position
    if shared_input:
        plan["self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Replicate()},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        )
        plan["mlp"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
    return parallelize_module(copy.deepcopy(block), mesh, plan)
