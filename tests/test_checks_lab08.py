"""labcourse.checks.lab08: the LoRA forward and merging an adapter; each check passes an answer written here
from the definition (not labkit's), whose values on small inputs are computed by hand, and fails the usual wrong
answers with a message that says what to fix."""

from __future__ import annotations

import pytest
import torch

from labcourse.checks import core, lab08


def reference_lora_forward(x, weight, bias, lora_A, lora_B, alpha, r):
    return x @ weight.T + bias + (x @ lora_A.T @ lora_B.T) * (alpha / r)


def test_lora_forward_check_passes_a_hand_written_answer():
    x, w, b = torch.tensor([[1.0, 2.0]]), torch.eye(2), torch.tensor([0.5, 0.0])
    a, up = torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0], [0.0]])  # r = 1: x Aᵀ = 3, then B · 3 = (6, 0)
    # base (1, 2) + (0.5, 0) plus alpha / r = 2 times (6, 0)
    assert reference_lora_forward(x, w, b, a, up, 2.0, 1).tolist() == [[13.5, 2.0]]
    assert lab08.check_lora_forward(reference_lora_forward) is reference_lora_forward


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda x, w, b, A, B, alpha, r: x @ w.T + b + x @ A.T @ B.T, "alpha / r"),
        (lambda x, w, b, A, B, alpha, r: x @ w.T + (x @ A.T @ B.T) * (alpha / r), "plus the base"),  # no bias
        (lambda x, w, b, A, B, alpha, r: (x @ A.T @ B.T) * (alpha / r), "plus the base"),
        (lambda x, w, b, A, B, alpha, r: (x @ w.T)[..., :1], "shape"),
    ],
)
def test_lora_forward_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab08.check_lora_forward(wrong)


def test_lora_merge_check_passes_a_hand_written_answer():
    answer = lambda w, a, b, alpha, r: w + (alpha / r) * b @ a  # noqa: E731
    a, up = torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0], [0.0]])
    assert answer(torch.eye(2), a, up, 2.0, 1).tolist() == [[5.0, 4.0], [0.0, 1.0]]  # I + 2 · [[2, 2], [0, 0]]
    assert lab08.check_lora_merge(answer) is answer


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda w, a, b, alpha, r: w + b @ a, "scale the update by alpha / r"),
        (lambda w, a, b, alpha, r: w + (alpha / r) * (b @ a).T if w.shape[0] == w.shape[1] else w, "B @ A"),
        (lambda w, a, b, alpha, r: (alpha / r) * b @ a[:, :1], "shape"),
    ],
)
def test_lora_merge_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab08.check_lora_merge(wrong)
