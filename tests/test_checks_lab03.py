"""labkit.checks.lab03: token-normalized accumulation and the warm-up + cosine schedule; each check passes the
reference answer and fails the usual wrong answers with a message that says what to fix."""

from __future__ import annotations

import pytest

from labkit import train
from labkit.checks import core, lab03


def test_loss_divisors_check_passes_the_reference():
    assert lab03.check_loss_divisors(train.loss_divisors) is train.loss_divisors


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda counts: [n * len(counts) for n in counts], "per-micro-batch means"),
        (lambda counts: [sum(counts)], "one divisor per micro-batch"),
    ],
)
def test_loss_divisors_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab03.check_loss_divisors(wrong)


def lr_reference(step, steps, warmup, lr, min_lr):
    return train.lr_at(
        step, train.TrainConfig(steps=steps, warmup_steps=warmup, lr=lr, min_lr=min_lr, schedule="cosine")
    )


def test_lr_at_check_passes_the_reference():
    assert lab03.check_lr_at(lr_reference) is lr_reference


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda *a: lab03._cosine(*a, warmup_from_zero=True), "step 0 already trains"),
        (lambda *a: lab03._cosine(*a, floor=0.0), "decay to min_lr, not to 0"),
        (lambda *a: lab03._cosine(*a, span_offset=0), "the last step is exactly min_lr"),
        (lambda step, steps, w, lr, mn: lr, "linear warm-up to lr, then"),
    ],
)
def test_lr_at_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab03.check_lr_at(wrong)
