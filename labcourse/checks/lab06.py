"""Lab 06's exercise checks: a 2:4 mask, counting sparsity."""

from __future__ import annotations

from collections.abc import Callable

import torch

from labcourse.checks.core import CheckFailed, call_answer, goes_on_with, report_passed
from labkit import prune


def _groups_topk(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    groups = scores.reshape(scores.shape[0], -1, m)
    return torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.topk(n, dim=-1).indices, True).view_as(scores)


def _row_topk(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    k = scores.shape[1] // m * n
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, scores.topk(k, dim=-1).indices, True)


def _nm_mask(weight: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """labkit's answer to exercise 06.1, in the exercise's signature."""
    return prune.nm_masks({"w": weight}, n, m)["w"]


@goes_on_with(_nm_mask, "prune.nm_masks")
def check_nm_mask(fn: Callable[[torch.Tensor, int, int], torch.Tensor]) -> Callable:
    """Lab 06: fn(weight, n, m) is a bool keep-mask with the n largest |w| of every m consecutive inputs per row."""
    exercise = "exercise 06.1 (an N:M mask)"
    g = torch.Generator().manual_seed(0)
    cases = [
        (torch.tensor([[0.1, -0.9, 0.5, 0.2, 3.0, -4.0, 0.0, 1.0]]), 2, 4),
        (torch.randn(6, 16, generator=g), 2, 4),
        (torch.randn(4, 16, generator=g), 4, 8),
        (torch.randn(3, 12, generator=g), 1, 4),
    ]
    mistakes = {
        "rank by magnitude |w|: a large negative weight matters as much as a large positive one": lambda w, n, m: (
            _groups_topk(w, n, m)
        ),
        "choose within each group of m consecutive inputs, not across the whole row": lambda w, n, m: _row_topk(
            w.abs(), n, m
        ),
    }
    for weight, n, m in cases:
        expected = _nm_mask(weight, n, m)
        got = call_answer(exercise, fn, weight.clone(), n, m)
        if not isinstance(got, torch.Tensor) or got.shape != weight.shape:
            raise CheckFailed(
                f"{exercise}: return a mask of the weight's shape {tuple(weight.shape)}, "
                f"got {getattr(got, 'shape', type(got).__name__)}"
            )
        if got.dtype != torch.bool:
            raise CheckFailed(f"{exercise}: return a bool mask (True = keep), got dtype {got.dtype}")
        if not torch.equal(got, expected):
            row = int((got != expected).any(dim=1).nonzero()[0])
            hint = next(
                (h for h, wrong in mistakes.items() if torch.equal(wrong(weight, n, m), got)),
                f"keep exactly n = {n} weights, the largest |w|, in every group of m = {m}",
            )
            raise CheckFailed(
                f"{exercise}: {n}:{m} mask of row {row} = {[round(v, 3) for v in weight[row].tolist()]} "
                f"should be {expected[row].int().tolist()}, got {got[row].int().tolist()}; hint: {hint}"
            )
    return report_passed(exercise, len(cases))


def _overall_sparsity(layers: list[tuple[int, int]]) -> float:
    """labkit's answer to exercise 06.2, in the exercise's signature."""
    return prune.overall_sparsity([prune.LayerSparsity(f"w{i}", (n,), zeros) for i, (zeros, n) in enumerate(layers)])


@goes_on_with(_overall_sparsity, "prune.overall_sparsity")
def check_overall_sparsity(fn: Callable[[list[tuple[int, int]]], float]) -> Callable:
    """Lab 06: fn([(zeros, params), ...]) is the share of zeros over all weights of the layers listed."""
    exercise = "exercise 06.2 (counting sparsity)"
    cases = [[(50, 100), (0, 100)], [(10, 10), (0, 990)], [(0, 7)], [(3, 4), (1, 4), (0, 8)]]
    for layers in cases:
        expected = _overall_sparsity(layers)
        got = call_answer(exercise, fn, list(layers))
        if not isinstance(got, (int, float)) or not abs(got - expected) <= 1e-12:  # NaN is no answer
            mean_of_layers = sum(z / p for z, p in layers) / len(layers)
            hint = (
                "that is the mean of per-layer sparsities: a small layer counts as much as a big one. "
                "Divide all zeros by all weights"
                if isinstance(got, (int, float)) and abs(got - mean_of_layers) < 1e-12
                else "total zeros / total weights"
            )
            raise CheckFailed(
                f"{exercise}: layers (zeros, params) {layers}: expected {expected:.4f}, got {got!r}; hint: {hint}"
            )
    return report_passed(exercise, len(cases))
