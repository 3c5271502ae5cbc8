"""FSDP2 (ZeRO-3) on a decoder: `shard_model` wraps torch's `fully_shard` per block, then the root
(`memory.held_bytes` then counts what a rank holds)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from labkit.torchutil import check_bool, check_module, decoder_layers


def shard_model(
    model: nn.Module,
    *,
    reshard_after_forward: bool = True,
    offload: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Shard `model` over the default process group with FSDP2, in place: each decoder block is one unit (gathered
    just before it runs), the root holds the rest (embedding, final norm, head).

    `reshard_after_forward=False` keeps gathered blocks until their backward (ZeRO-2-like: fewer all-gathers,
    more memory); `offload` keeps shards, gradients and optimizer state in host memory (CPUOffloadPolicy);
    `param_dtype` / `reduce_dtype` set the mixed-precision policy (compute and gradient-reduction dtypes).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    check_module(model)
    check_bool("reshard_after_forward", reshard_after_forward)
    check_bool("offload", offload)
    for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"{name} must be None or a torch floating-point dtype (torch.bfloat16, say), got {dtype!r}")
    blocks = decoder_layers(model)  # a model without decoder blocks is refused before any mesh is made
    if not dist.is_initialized():
        raise RuntimeError("init the process group first (labkit.parallel.launch.rank_context)")
    device = next(model.parameters()).device
    if offload and device.type == "cpu":
        raise ValueError("offload moves shards from an accelerator to host memory: these ranks run on the CPU already")
    options = {"mesh": init_device_mesh(device.type, (dist.get_world_size(),))}
    if offload:
        options["offload_policy"] = CPUOffloadPolicy()
    if param_dtype is not None or reduce_dtype is not None:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, **options)  # the root keeps its parameters to the backward, which needs them first
    return model
