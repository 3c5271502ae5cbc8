"""The ring all-reduce from scratch: which chunk each rank sends at each step, the whole ring simulated in one
process, and the real thing on a process group built from point-to-point sends.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def ring_send_chunk(rank: int, world: int, step: int) -> int:
    """The chunk `rank` sends to rank + 1 at `step` of a ring all-reduce (steps 0 … 2(p − 1) − 1).

    Reduce-scatter (steps < p − 1) passes partial sums along, so after it rank r holds the whole sum of
    chunk r + 1; all-gather then passes the finished sums along. Each rank receives chunk (sent − 1).
    """
    if not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")
    if not 0 <= step < 2 * (world - 1):
        raise ValueError(f"a ring all-reduce over {world} ranks has steps 0..{2 * (world - 1) - 1}, got {step}")
    if step < world - 1:
        return (rank - step) % world
    return (rank + 1 - (step - world + 1)) % world


def ring_step(chunks: list[list[torch.Tensor]], step: int) -> list[list[torch.Tensor]]:
    """One step of a ring all-reduce simulated in one process: chunks[r][c] is rank r's copy of chunk c.
    All ranks send at once, so every message carries the value from before the step."""
    world = len(chunks)
    out = [list(row) for row in chunks]
    for rank in range(world):
        c, right = ring_send_chunk(rank, world, step), (rank + 1) % world
        out[right][c] = chunks[right][c] + chunks[rank][c] if step < world - 1 else chunks[rank][c]
    return out


def simulate_ring_all_reduce(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sum p tensors (one per simulated rank) with 2(p − 1) ring steps; every rank ends with the sum."""
    world = len(tensors)
    if world == 0 or any(t.shape != tensors[0].shape for t in tensors):
        raise ValueError("need one tensor per rank, all of the same shape")
    chunks = [list(t.flatten().tensor_split(world)) for t in tensors]
    for step in range(2 * (world - 1)):
        chunks = ring_step(chunks, step)
    return [torch.cat(row).view_as(tensors[0]) for row in chunks]


def ring_all_reduce_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` across the process group in place with the ring algorithm, built from point-to-point
    sends: each rank sends 2(p − 1)/p of the tensor whatever p is, which is why rings scale."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce_ works in place on a contiguous tensor")
    chunks = tensor.view(-1).tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(2 * (world - 1)):
        send = ring_send_chunk(rank, world, step)
        recv = (send - 1) % world
        incoming = torch.empty_like(chunks[recv])
        ops = [dist.P2POp(dist.isend, chunks[send], right), dist.P2POp(dist.irecv, incoming, left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if step < world - 1:
            chunks[recv].add_(incoming)
        else:
            chunks[recv].copy_(incoming)
    return tensor
