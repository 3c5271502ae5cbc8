"""labkit.checks.lab06: an N:M mask and counting sparsity; each check passes the reference answer and fails the
usual wrong answers with a message that says what to fix."""

from __future__ import annotations

import pytest
import torch

from labkit import prune
from labkit.checks import core, lab06


def test_nm_mask_check_passes_the_reference():
    answer = lambda w, n, m: prune.nm_masks({"w": w}, n, m)["w"]  # noqa: E731
    assert lab06.check_nm_mask(answer) is answer


def signed_topk(w, n, m):
    groups = w.reshape(w.shape[0], -1, m)
    return torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.topk(n, dim=-1).indices, True).view_as(w)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda w, n, m: prune.nm_masks({"w": w}, n, m)["w"].float(), "bool"),
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


def test_overall_sparsity_check_passes_the_reference():
    answer = lambda layers: sum(z for z, _ in layers) / sum(p for _, p in layers)  # noqa: E731
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
