"""labkit.checks.lab08: the LoRA forward and merging an adapter; each check passes the reference answer and fails
the usual wrong answers with a message that says what to fix."""

from __future__ import annotations

import pytest

from labkit.checks import core, lab08


def reference_lora_forward(x, weight, bias, lora_A, lora_B, alpha, r):
    return x @ weight.T + bias + (x @ lora_A.T @ lora_B.T) * (alpha / r)


def test_lora_forward_check_passes_the_reference():
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


def test_lora_merge_check_passes_the_reference():
    answer = lambda w, a, b, alpha, r: w + (alpha / r) * b @ a  # noqa: E731
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
