"""ZeRO-1 from scratch (Rajbhandari et al., 2020): the optimizer state sharded over data-parallel ranks.

Every rank still holds all parameters and averages all gradients (DDP does that); but each rank keeps
AdamW's moments for only its 1/N of the parameters, updates only that slice, and the ranks then all-gather
the updated slices so that every rank holds every parameter again. AdamW is elementwise, so the slices'
updates are exactly the whole model's. torch's `ZeroRedundancyOptimizer` does the same with whole
parameters assigned to ranks instead of equal slices of one flat vector.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.torchutil import check_bool, is_int


def owned_slice(numel: int, rank: int, world: int) -> slice:
    """The slice of a flat vector of `numel` elements that `rank` of `world` updates: ceil(numel / world) elements
    each, the vector padded at the end so that every rank's slice has the same length (one all-gather call)."""
    if not is_int(numel) or numel < 1 or not is_int(world) or world < 1:
        raise ValueError(f"need numel >= 1 and world >= 1, got numel={numel!r}, world={world!r}")
    if not is_int(rank) or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank={rank!r}, world={world}")
    size = math.ceil(numel / world)
    return slice(rank * size, (rank + 1) * size)


class Zero1AdamW:
    """AdamW whose state is sharded over the ranks of the default process group (call `step` on every rank).

    The parameters are re-homed as views of one flat buffer, padded to N equal slices; rank r owns slice r.
    `step()` takes the already averaged gradients (after DDP's all-reduce), updates the owned slice with a
    local `torch.optim.AdamW`, then all-gathers the slices into the buffer — the parameters themselves.
    """

    def __init__(self, params: Iterable[nn.Parameter], **adamw: Any) -> None:
        if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
            raise TypeError(
                f"params must be an iterable of parameters (model.parameters()), got {type(params).__name__}"
            )
        params = list(params)
        bad = next((p for p in params if not isinstance(p, torch.Tensor)), None)
        if bad is not None:
            raise TypeError(f"params must hold tensors (model.parameters()), got {bad!r}")
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("Zero1AdamW got no parameters that require a gradient")
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) > 1:
            raise ValueError(f"all parameters must share one dtype and one device, got {sorted(map(str, kinds))}")
        first = self.params[0]
        try:  # AdamW's own checks (lr, betas, eps ...) on a stand-in, before any parameter is re-homed
            torch.optim.AdamW([nn.Parameter(torch.zeros(1, dtype=first.dtype, device=first.device))], **adamw)
        except (TypeError, ValueError) as err:
            raise type(err)(f"Zero1AdamW's AdamW arguments {adamw}: {err}") from None
        if not dist.is_initialized():
            raise RuntimeError("init the process group first (labkit.parallel.launch.rank_context)")
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.owned = owned_slice(sum(p.numel() for p in self.params), self.rank, self.world)
        self.shard_numel = self.owned.stop - self.owned.start
        self.flat = torch.zeros(self.shard_numel * self.world, dtype=first.dtype, device=first.device)
        offset = 0
        for p in self.params:  # the parameters become views of the flat buffer: gathering into it updates them
            self.flat[offset : offset + p.numel()].copy_(p.detach().flatten())
            p.data = self.flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.slices = list(self.flat.split(self.shard_numel))
        self.shard = nn.Parameter(self.slices[self.rank])  # shares storage with the owned slice
        self.optimizer = torch.optim.AdamW([self.shard], **adamw)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients (None, or zeros in place), as torch's optimizers do."""
        check_bool("set_to_none", set_to_none)
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """Update the owned slice from the (averaged) gradients, then all-gather every rank's slice."""
        start = self.owned.start
        grad = torch.zeros_like(self.shard)
        offset = 0
        for p in self.params:  # copy the part of each gradient that falls in the owned slice
            lo, hi = max(offset, start), min(offset + p.numel(), start + self.shard_numel)
            if lo < hi and p.grad is not None:
                grad[lo - start : hi - start] = p.grad.flatten()[lo - offset : hi - offset]
            offset += p.numel()
        self.shard.grad = grad
        self.optimizer.step()
        self.shard.grad = None
        dist.all_gather(self.slices, self.shard.detach().clone())
