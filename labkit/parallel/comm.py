"""What the ranks send each other: bytes per collective, counted where torch calls them, and gradient compression.

`count_collectives` wraps the Python collectives of `torch.distributed` for the length of a `with` block and adds
up the bytes each rank puts in, by kind. FSDP2, ZeroRedundancyOptimizer and DDP communication hooks call them
from Python; DDP's built-in all-reduce runs in C++, so register a hook (`allreduce_hook`, `bf16_compress_hook`,
PowerSGD) to see its traffic. `compress_hook` is written here to show the idea: send the gradients in
bfloat16 or float16, half the bytes, and decompress the average.
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations as objects (dist.GradBucket)
import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

# the collectives torch's data-parallel engines call from Python, and the argument that holds what a rank sends
_SENT = {
    "all_reduce": ("tensor", 0),
    "broadcast": ("tensor", 0),
    "all_gather": ("tensor", 1),
    "all_gather_into_tensor": ("input_tensor", 1),
    "all_gather_single": ("input_tensor", 1),
    "reduce_scatter_tensor": ("input", 1),
    "reduce_scatter_single": ("input", 1),
}


def _sent_bytes(args: tuple, kwargs: dict[str, Any], name: str, position: int) -> int:
    tensor = kwargs.get(name, args[position] if len(args) > position else None)
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """Count, on this rank, the bytes handed to each kind of collective inside the block: a Counter of
    kind -> bytes and "calls:" + kind -> calls. Bytes are the input a rank contributes (a reduce-scatter's whole
    input, an all-gather's shard), not what crosses the wire, which depends on the algorithm (a ring all-reduce
    sends 2 (N - 1) / N of it)."""
    counts: Counter = Counter()
    originals = {kind: getattr(dist, kind) for kind in _SENT if hasattr(dist, kind)}

    def counted(kind: str, fn: Callable) -> Callable:
        name, position = _SENT[kind]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[kind] += _sent_bytes(args, kwargs, name, position)
            counts[f"calls:{kind}"] += 1
            return fn(*args, **kwargs)

        return wrapper

    for kind, fn in originals.items():
        setattr(dist, kind, counted(kind, fn))
    try:
        yield counts
    finally:
        for kind, fn in originals.items():
            setattr(dist, kind, fn)


def compress_hook(dtype: torch.dtype = torch.bfloat16) -> Callable:
    """A DDP communication hook that all-reduces each bucket's gradients in `dtype` (bf16 or fp16: half the bytes
    of fp32), divided by the world size first, and writes the average back in the gradients' own dtype. torch ships
    the same as `default_hooks.fp16_compress_hook` / `bf16_compress_hook` (the latter refused off CUDA/NCCL);
    register with `ddp.register_comm_hook(None, compress_hook(torch.bfloat16))`."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")

    def compressed_allreduce(
        process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(dist.get_world_size(group))
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(fut.value()[0])
            return buffer

        return future.then(decompress)

    return compressed_allreduce
