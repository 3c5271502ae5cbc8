"""Data parallelism written from scratch next to torch DDP: the naive version (one all-reduce per gradient
after backward), then gradients bucketed and all-reduced while backward runs, and a timer for one all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.bench import time_fn


def all_reduce_gradients(model: nn.Module) -> None:
    """The naive version: after backward, average every gradient across ranks, one all-reduce each."""
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world


class BucketedDataParallel:
    """Gradient all-reduce in buckets, started during backward as soon as a bucket's gradients are ready.

    Parameters are bucketed in reverse order (the order backward produces their gradients); a hook on
    each parameter marks it ready, and a full bucket is flattened and all-reduced asynchronously while
    backward goes on computing earlier layers' gradients. `finish()` waits for the last transfers and
    copies the averaged gradients back. This is the idea inside torch DDP, without its refinements.
    """

    def __init__(self, model: nn.Module, bucket_mb: float = 25.0):
        if not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be a positive number of MiB, got {bucket_mb!r}")
        if not dist.is_initialized():
            raise RuntimeError("init the process group first (labkit.parallel.launch.rank_context)")
        self.model, self.world = model, dist.get_world_size()
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:  # start identical, as DDP does
            dist.broadcast(p.data, src=0)
        limit = bucket_mb * 2**20
        self.buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in reversed(params):
            if self.buckets[-1] and size + p.numel() * p.element_size() > limit:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._pending: list[int] = [0] * len(self.buckets)
        self._works: list[tuple[Any, torch.Tensor, int]] = []
        for p in params:
            p.register_post_accumulate_grad_hook(self._ready)
        self.reset()

    def reset(self) -> None:
        """Before each backward: no bucket has its gradients yet."""
        self._pending = [len(b) for b in self.buckets]
        self._works = []

    def _ready(self, p: nn.Parameter) -> None:
        i = self._bucket_of[id(p)]
        self._pending[i] -= 1
        if self._pending[i] == 0:  # the whole bucket is ready: send it while backward continues
            flat = torch.cat([q.grad.flatten() for q in self.buckets[i]])
            self._works.append((dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True), flat, i))

    def finish(self) -> None:
        """After backward: wait for every bucket and write the averaged gradients back."""
        if any(self._pending):
            raise RuntimeError(
                "some parameters received no gradient in this backward; every parameter must take part (or be frozen)"
            )
        for work, flat, i in self._works:
            work.wait()
            flat /= self.world
            offset = 0
            for q in self.buckets[i]:
                q.grad.copy_(flat[offset : offset + q.numel()].view_as(q.grad))
                offset += q.numel()
        self.reset()


def time_all_reduce(
    numel: int, device: torch.device, repeats: int = 5, all_reduce: Callable[[torch.Tensor], Any] = dist.all_reduce
) -> float:
    """Median seconds for one all-reduce of `numel` fp32 values across the group (call on every rank)."""
    x = torch.ones(numel, device=device)
    return time_fn(lambda: all_reduce(x), warmup=1, repeats=repeats, device=device, before=dist.barrier).median
