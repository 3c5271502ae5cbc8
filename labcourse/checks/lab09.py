"""Lab 09's exercise checks: the bytes a rank holds under ZeRO stage k, and one ZeRO-1 step."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from labcourse.checks.core import CheckFailed, call_answer, goes_on_with, report_passed
from labkit.parallel.memory import STRATEGIES, state_bytes
from labkit.parallel.zero import owned_slice


def _zero_bytes(n_params: int, stage: int, world: int) -> int:
    """labkit's answer to exercise 09.1, in the exercise's signature (fp32 AdamW: 4 + 4 + 8 bytes per parameter)."""
    return state_bytes(n_params, STRATEGIES[stage], world).state


def _zero1_step(params: torch.Tensor, grads: torch.Tensor, rank: int, world: int, lr: float) -> torch.Tensor:
    """labkit's answer to exercise 09.2: this rank's padded slice after one SGD step."""
    owned = owned_slice(params.numel(), rank, world)
    pad = world * (owned.stop - owned.start) - params.numel()
    return (F.pad(params, (0, pad)) - lr * F.pad(grads, (0, pad)))[owned]


@goes_on_with(_zero_bytes, "memory.state_bytes")
def check_zero_bytes(fn: Callable[[int, int, int], int]) -> Callable:
    """Lab 09: fn(n_params, stage, world) = bytes of weights, gradients and AdamW moments on one rank, fp32, under
    ZeRO stage 0 (DDP) to 3, shards of ceil(n / world)."""
    exercise = "exercise 09.1 (bytes per rank under ZeRO stage k)"
    cases = [(1000, stage, world) for stage in range(4) for world in (1, 2, 8)] + [(7, 3, 2), (10, 1, 4), (10, 2, 3)]
    for n, stage, world in cases:
        expected = _zero_bytes(n, stage, world)
        got = call_answer(exercise, fn, n, stage, world)
        if got == expected:
            continue
        unpadded = sum(size * n / (world if stage >= k else 1) for k, size in ((3, 4), (2, 4), (1, 8)))
        if n % world and got == unpadded:
            hint = "a shard is ceil(n / world) parameters: the last rank's slice is padded, not shorter"
        elif stage and got == _zero_bytes(n, stage - 1, world):
            hint = (
                f"stage {stage} shards one more kind than stage {stage - 1}: 1 the moments, 2 + gradients, 3 + weights"
            )
        elif stage and world > 1 and got == 16 * n // world:
            hint = "only stage 3 shards everything; stages 1 and 2 keep full weights (and, in 1, full gradients)"
        elif stage == 0:
            hint = "stage 0 is DDP: every rank holds all 4 + 4 + 8 bytes per parameter"
        else:
            hint = "per parameter: 4 bytes of weight, 4 of gradient, 8 of AdamW moments; shard what the stage shards"
        raise CheckFailed(
            f"{exercise}: n={n}, stage={stage}, world={world}: expected {expected} bytes, got {got!r}; hint: {hint}"
        )
    return report_passed(exercise, len(cases))


@goes_on_with(_zero1_step, "zero.owned_slice")
def check_zero1_step(fn: Callable[..., torch.Tensor]) -> Callable:
    """Lab 09: fn(params, grads, rank, world, lr) is this rank's slice (ceil(n / world) elements of the zero-padded
    flat vectors) after one SGD step; every rank's slice, concatenated and cut to n, is the whole step."""
    exercise = "exercise 09.2 (one ZeRO-1 step)"
    g = torch.Generator().manual_seed(0)
    cases = [(8, 2), (10, 4), (7, 3), (5, 1)]
    for n, world in cases:
        params, grads = (
            torch.randn(n, generator=g, dtype=torch.float64),
            torch.randn(n, generator=g, dtype=torch.float64),
        )
        size = -(-n // world)
        slices = []
        for rank in range(world):
            got = call_answer(exercise, fn, params.clone(), grads.clone(), rank, world, 0.1)
            if not isinstance(got, torch.Tensor) or got.shape != (size,):
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                hint = (
                    "return only this rank's slice, not the whole vector"
                    if isinstance(got, torch.Tensor) and got.numel() == n
                    else "each slice is ceil(n / world) long: pad the flat vectors with zeros to world slices"
                )
                raise CheckFailed(
                    f"{exercise}: n={n}, world={world}, rank={rank}: expected shape ({size},), got {shape}; "
                    f"hint: {hint}"
                )
            slices.append(got)
        whole = torch.cat(slices)[:n]
        expected = params - 0.1 * grads
        if not torch.allclose(whole, expected):
            hint = (
                "the update is params - lr * grads (SGD), on this rank's slice only"
                if torch.allclose(torch.cat(slices)[:n], params + 0.1 * grads)
                else "rank r owns elements r * ceil(n / world) up to (r + 1) * ceil(n / world) of the padded vector"
            )
            raise CheckFailed(
                f"{exercise}: n={n}, world={world}: the slices of all ranks, concatenated, are not the SGD step "
                f"(largest difference {(whole - expected).abs().max():.3g}); hint: {hint}"
            )
    return report_passed(exercise, len(cases))
