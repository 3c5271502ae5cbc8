"""Lab 04's exercise checks: ring steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labcourse.checks.core import CheckFailed, call_answer, goes_on_with, report_passed
from labkit.parallel import ring


def _chunks(world: int, seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 100, (2,), generator=g).double() for _ in range(world)] for _ in range(world)]


def _step_overwriting(chunks: list[list[torch.Tensor]], step: int) -> list[list[torch.Tensor]]:
    """The usual wrong answer: the receiver replaces its copy (all-gather's move) instead of adding to it."""
    world = len(chunks)
    out = [list(row) for row in chunks]
    for rank in range(world):
        c = ring.ring_send_chunk(rank, world, step)
        out[(rank + 1) % world][c] = chunks[rank][c]
    return out


def _first_wrong_chunk(
    exercise: str, fn: Callable, chunks: list[list[torch.Tensor]], step: int, expected: list[list[torch.Tensor]]
) -> tuple[Any, tuple[int, int] | None]:
    """Run a ring-step answer on a copy of `chunks`; return its result and the first (rank, chunk) it got wrong."""
    world = len(chunks)
    got = call_answer(exercise, fn, [[t.clone() for t in row] for row in chunks], step)
    if (
        not isinstance(got, (list, tuple))
        or len(got) != world
        or any(not isinstance(row, (list, tuple)) or len(row) != world for row in got)
    ):
        raise CheckFailed(f"{exercise}: return a list with one list of {world} chunks per rank ({world} ranks)")
    bad = [(r, c) for r in range(world) for c in range(world) if not torch.equal(got[r][c], expected[r][c])]
    return got, (bad[0] if bad else None)


@goes_on_with(ring.ring_step, "parallel.ring.ring_step")
def check_reduce_scatter_step(fn: Callable[[list[list[torch.Tensor]], int], list[list[torch.Tensor]]]) -> Callable:
    """Lab 04: fn(chunks, step) is one reduce-scatter step of a ring all-reduce (chunks[r][c]: rank r, chunk c)."""
    exercise = "exercise 04.1 (a ring reduce-scatter step)"
    cases = [(2, 0), (3, 0), (3, 1), (4, 2), (5, 1)]
    for world, step in cases:
        chunks = _chunks(world, seed=world * 10 + step)
        expected = ring.ring_step(chunks, step)
        got, wrong_at = _first_wrong_chunk(exercise, fn, chunks, step, expected)
        if wrong_at:
            r, c = wrong_at
            wrong = _step_overwriting(chunks, step)
            if all(torch.equal(got[q][k], wrong[q][k]) for q in range(world) for k in range(world)):
                hint = (
                    "reduce-scatter adds the incoming chunk to the receiver's own copy; replacing it is "
                    "the all-gather phase"
                )
            else:
                hint = (
                    f"at step s rank r sends chunk (r − s) mod p to rank (r + 1) mod p, which adds it to its "
                    f"own copy; here rank {(r - 1) % world} sends chunk "
                    f"{ring.ring_send_chunk((r - 1) % world, world, step)}"
                )
            raise CheckFailed(
                f"{exercise}: {world} ranks, step {step}: rank {r}'s chunk {c} should be "
                f"{expected[r][c].tolist()}, got {got[r][c].tolist()}; hint: {hint}"
            )
    return report_passed(exercise, len(cases))


def _all_gather_step(chunks: list[list[torch.Tensor]], step: int) -> list[list[torch.Tensor]]:
    """labkit's answer to exercise 04.2: all-gather step `step` is the ring's step p − 1 + step."""
    return ring.ring_step(chunks, len(chunks) - 1 + step)


@goes_on_with(_all_gather_step, "parallel.ring.ring_step")
def check_all_gather_step(fn: Callable[[list[list[torch.Tensor]], int], list[list[torch.Tensor]]]) -> Callable:
    """Lab 04: fn(chunks, step) is one all-gather step of a ring all-reduce (step 0 … p − 2 of that phase)."""
    exercise = "exercise 04.2 (a ring all-gather step)"
    cases = [(2, 0), (3, 0), (3, 1), (4, 2), (5, 3)]
    for world, step in cases:
        chunks = _chunks(world, seed=world * 10 + step)
        for s in range(world - 1 + step):  # the reduce-scatter, then the all-gather steps before this one
            chunks = ring.ring_step(chunks, s)
        expected = _all_gather_step(chunks, step)
        got, wrong_at = _first_wrong_chunk(exercise, fn, chunks, step, expected)
        if wrong_at:
            r, c = wrong_at
            sent = ring.ring_send_chunk((r - 1) % world, world, world - 1 + step)
            hint = (
                "all-gather passes finished sums along: the receiver replaces its copy, it does not add"
                if torch.equal(got[r][c], chunks[r][c] + chunks[(r - 1) % world][c])
                else f"at all-gather step s rank r sends the finished chunk (r + 1 − s) mod p to rank r + 1; "
                f"here rank {(r - 1) % world} sends chunk {sent}"
            )
            raise CheckFailed(
                f"{exercise}: {world} ranks, all-gather step {step}: rank {r}'s chunk {c} should be "
                f"{expected[r][c].tolist()}, got {got[r][c].tolist()}; hint: {hint}"
            )
    return report_passed(exercise, len(cases))
