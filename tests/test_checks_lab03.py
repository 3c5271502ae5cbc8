"""labcourse.checks.lab03: token-normalized accumulation and the warm-up + cosine schedule; each check passes an answer
written here from the definition (not labkit's), whose values on small inputs are computed by hand, and fails the
usual wrong answers with a message that says what to fix."""

from __future__ import annotations

import math

import pytest

from labcourse.checks import core, lab03


def test_loss_divisors_check_passes_a_hand_written_answer():
    def divisors_by_hand(counts):
        return [sum(counts) for _ in counts]  # every micro-batch's summed loss over all the window's tokens

    assert divisors_by_hand([300, 20, 80, 1]) == [401] * 4
    assert lab03.check_loss_divisors(divisors_by_hand) is divisors_by_hand


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


def lr_by_hand(step, steps, warmup, lr, min_lr):
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup - 1)
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * progress)) / 2


def test_hand_written_schedule_by_hand():
    assert lr_by_hand(0, 10, 3, 1e-3, 1e-4) == pytest.approx(1e-3 / 3)
    assert lr_by_hand(2, 10, 3, 1e-3, 1e-4) == pytest.approx(1e-3)  # warm-up ends at lr
    assert lr_by_hand(9, 10, 3, 1e-3, 1e-4) == pytest.approx(1e-4)  # the last step is min_lr
    assert lr_by_hand(2, 5, 0, 1.0, 0.5) == pytest.approx(0.75)  # half-way: cos(π/2) = 0


def test_lr_at_check_passes_a_hand_written_answer():
    assert lab03.check_lr_at(lr_by_hand) is lr_by_hand


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
