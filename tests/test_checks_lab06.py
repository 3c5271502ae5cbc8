"""labcourse.checks.lab06: an N:M mask and counting sparsity; each check passes an answer written here from the
definition (not labkit's), whose values on small inputs are computed by hand, and fails the usual wrong answers with a
message that says what to fix."""

from __future__ import annotations

import pytest
import torch

from labcourse.checks import core, lab06


def nm_by_hand(weight, n, m):
    """Per row, per group of m consecutive inputs: keep the n of largest magnitude."""
    keep = torch.zeros(weight.shape, dtype=torch.bool)
    for row in range(weight.shape[0]):
        for start in range(0, weight.shape[1], m):
            group = sorted(range(start, start + m), key=lambda j: -abs(weight[row, j].item()))
            for j in group[:n]:
                keep[row, j] = True
    return keep


def test_nm_mask_check_passes_a_hand_written_answer():
    w = torch.tensor([[0.1, -0.9, 0.5, 0.2, 3.0, -4.0, 0.0, 1.0]])
    assert nm_by_hand(w, 2, 4).int().tolist() == [[0, 1, 1, 0, 1, 1, 0, 0]]  # |−0.9|, 0.5 | 3.0, |−4.0|
    assert lab06.check_nm_mask(nm_by_hand) is nm_by_hand


def signed_topk(w, n, m):
    groups = w.reshape(w.shape[0], -1, m)
    return torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.topk(n, dim=-1).indices, True).view_as(w)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda w, n, m: nm_by_hand(w, n, m).float(), "bool"),
        (signed_topk, "magnitude"),
        (
            lambda w, n, m: torch.zeros_like(w, dtype=torch.bool).scatter_(  # the largest of the whole row
                -1, w.abs().topk(w.shape[1] // m * n, dim=-1).indices, True
            ),
            "within each group",
        ),
        (lambda w, n, m: torch.ones(3, dtype=torch.bool), "shape"),
    ],
)
def test_nm_mask_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab06.check_nm_mask(wrong)


def test_overall_sparsity_check_passes_a_hand_written_answer():
    answer = lambda layers: sum(z for z, _ in layers) / sum(p for _, p in layers)  # noqa: E731
    assert answer([(10, 10), (0, 990)]) == 0.01  # 10 zeros in 1000 weights, though one layer is all zeros
    assert lab06.check_overall_sparsity(answer) is answer


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda layers: sum(z / p for z, p in layers) / len(layers), "mean of per-layer sparsities"),
        (lambda layers: 0.0, "total zeros / total weights"),
    ],
)
def test_overall_sparsity_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab06.check_overall_sparsity(wrong)
