"""What a forward leaves for its backward, and what activation checkpointing trades for it (labs 03 and 09).

autograd's saved-tensor hooks see every tensor a layer saves, but not inside a checkpoint: there the block's
inputs are held by the checkpoint itself and its internals exist again, one block at a time, while it is
recomputed. `checkpointing_cost` counts both, so "with checkpointing" is the memory the backward really needs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from labkit import bench, precision
from labkit.torchutil import activation_checkpointing, is_int
from labkit.train import accumulate_gradients, loss_sum


def _checkpoint_blocks(model: nn.Module) -> list[nn.Module]:
    """The layers transformers checkpoints one by one (its decoder blocks)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _activations(model: nn.Module, batch: dict[str, torch.Tensor], policy: precision.Policy) -> dict[str, int]:
    """Bytes one forward leaves for its backward, with checkpointing as the model has it: what autograd saves
    (`saved`), what the blocks save (their sum and the largest; none where checkpointing hides the blocks'
    internals from autograd's hooks) and the tensors the blocks were called with (`inputs`, which a checkpoint
    keeps for its recomputation; `inputs_saved`, the part autograd holds too), each storage once, parameters
    left out."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    per_block: list[dict[int, int]] = []
    inputs: dict[int, int] = {}
    current: list[dict[int, int]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip and storage.data_ptr() not in saved:
            saved[storage.data_ptr()] = storage.nbytes()
            if current:
                current[-1][storage.data_ptr()] = storage.nbytes()
        return tensor

    def enter(block: nn.Module, args: tuple, kwargs: dict) -> None:
        values = [*args, *kwargs.values()]
        while values:
            t = values.pop()
            if isinstance(t, (tuple, list)):  # position embeddings come as a (cos, sin) pair
                values.extend(t)
            elif isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in skip:
                inputs[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        current.append({})

    def leave(block: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        per_block.append(current.pop())

    blocks = _checkpoint_blocks(model)
    hooks = [b.register_forward_pre_hook(enter, with_kwargs=True) for b in blocks]
    hooks += [b.register_forward_hook(leave, with_kwargs=True) for b in blocks]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = loss_sum(model, batch, policy)
        del loss  # the graph and what it saved are freed here
    finally:
        for hook in hooks:
            hook.remove()
    return {
        "saved": sum(saved.values()),
        "block_sum": sum(sum(b.values()) for b in per_block),
        "block_max": max((sum(b.values()) for b in per_block), default=0),
        "inputs": sum(inputs.values()),
        "inputs_saved": sum(n for ptr, n in inputs.items() if ptr in saved),
    }


def checkpointing_cost(
    model: nn.Module, batch: dict[str, torch.Tensor], policy: precision.Policy, repeats: int = 3
) -> dict[str, dict[str, float]]:
    """What activation checkpointing "off" and "on" cost one forward + backward, measured on the model.

    Per setting: `activation_bytes`, what the backward needs held (exact on any device, each storage once) and
    its part inside the decoder blocks, `block_bytes` — with checkpointing, the inputs each checkpoint keeps
    plus one block's activations while it is recomputed, which autograd's hooks (`saved_bytes`) do not see;
    the peak memory above the step's start; the median seconds. The model's training mode and checkpointing
    setting are given back as they were."""
    if not is_int(repeats) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    device, was_on, was_training = batch["input_ids"].device, activation_checkpointing(model), model.training

    def step() -> None:
        model.zero_grad(set_to_none=True)
        accumulate_gradients(model, [batch], policy)

    cost, largest_block = {}, 0
    try:
        model.train()  # transformers recomputes only in training mode
        for on in (False, True):
            activation_checkpointing(model, on=on)
            counted = _activations(model, batch, policy)
            if on:  # each checkpoint keeps its inputs; the internals come back one block at a time, recomputed
                block, outside = counted["inputs"] + largest_block, counted["saved"] - counted["inputs_saved"]
            else:
                block, largest_block = counted["block_sum"], counted["block_max"]
                outside = counted["saved"] - block  # embedding, final norm, logits: never checkpointed
            step()  # warm-up: allocations and the gradient buffers exist before the measured step
            with bench.track_peak_memory(device) as mem:
                step()
            seconds = bench.time_fn(step, warmup=0, repeats=repeats, device=device).median
            cost["on" if on else "off"] = {
                "saved_bytes": float(counted["saved"]),
                "activation_bytes": float(outside + block),
                "block_bytes": float(block),
                "peak_bytes": float(mem.delta_bytes),
                "seconds": seconds,
            }
    finally:
        activation_checkpointing(model, on=was_on)
        model.train(was_training)
    return cost
