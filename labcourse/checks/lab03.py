"""Lab 03's exercise checks: accumulation and the schedule."""

from __future__ import annotations

import math
from collections.abc import Callable

from labcourse.checks.core import CheckFailed, call_answer, goes_on_with, report_passed
from labkit import train


@goes_on_with(train.loss_divisors, "train.loss_divisors")
def check_loss_divisors(fn: Callable[[list[int]], list[int]]) -> Callable:
    """Lab 03: fn(token_counts) gives, per micro-batch, the divisor of its summed loss (token-normalized)."""
    exercise = "exercise 03.1 (token-normalized accumulation)"
    cases = [[100, 100], [300, 20, 80, 1], [7], [0, 5, 5]]
    for counts in cases:
        expected = train.loss_divisors(counts)
        got = call_answer(exercise, fn, list(counts))
        if list(got) != expected:
            wrong = train.loss_divisors(counts, "per_microbatch_mean")
            hint = (
                "that is the mean of per-micro-batch means: it weights the tokens of short micro-batches "
                "more. Divide every summed loss by the same number: all target tokens of the window"
                if list(got) == wrong
                else "one divisor per micro-batch; the big batch's loss is a mean over all of its target tokens"
            )
            raise CheckFailed(f"{exercise}: token counts {counts} need divisors {expected}, got {got}; hint: {hint}")
    return report_passed(exercise, len(cases))


def _cosine(
    step: int,
    steps: int,
    warmup: int,
    lr: float,
    min_lr: float,
    *,
    warmup_from_zero: bool = False,
    floor: float | None = None,
    span_offset: int = 1,
) -> float:
    """The warm-up + cosine schedule with the usual mistakes as switches (the check's wrong answers)."""
    if step < warmup:
        return lr * (step if warmup_from_zero else step + 1) / warmup
    low = min_lr if floor is None else floor
    progress = min(1.0, (step - warmup) / max(1, steps - warmup - span_offset))
    return low + 0.5 * (lr - low) * (1 + math.cos(math.pi * progress))


def _lr_at_step(step: int, steps: int, warmup_steps: int, lr: float, min_lr: float) -> float:
    """labkit's answer to exercise 03.2, in the exercise's signature."""
    cfg = train.TrainConfig(steps=steps, warmup_steps=warmup_steps, lr=lr, min_lr=min_lr, schedule="cosine")
    return train.lr_at(step, cfg)


@goes_on_with(_lr_at_step, "train.lr_at")
def check_lr_at(fn: Callable[[int, int, int, float, float], float]) -> Callable:
    """Lab 03: fn(step, steps, warmup_steps, lr, min_lr) is the warm-up + cosine learning rate at 0-based `step`."""
    exercise = "exercise 03.2 (warm-up and cosine decay)"
    configs = [(10, 3, 1e-3, 1e-4), (100, 10, 2e-3, 1e-4), (5, 0, 1.0, 0.5), (4, 4, 1.0, 0.1)]
    mistakes = {
        "a convention, not an error, but this exercise's: step 0 already trains, lr · (step + 1) / "
        "warmup_steps, reaching lr at the last warm-up step (transformers' schedulers start at 0)": {
            "warmup_from_zero": True
        },
        "decay to min_lr, not to 0 (this exercise's floor; transformers' cosine goes to 0)": {"floor": 0.0},
        "a convention, not an error, but this exercise's: the last step is exactly min_lr, progress = "
        "(step − warmup_steps) / (steps − warmup_steps − 1)": {"span_offset": 0},
    }
    for steps, warmup, lr, min_lr in configs:
        expected = [_lr_at_step(step, steps, warmup, lr, min_lr) for step in range(steps)]
        got = [call_answer(exercise, fn, step, steps, warmup, lr, min_lr) for step in range(steps)]
        bad = [
            i
            for i, (g, e) in enumerate(zip(got, expected))
            if not isinstance(g, (int, float)) or not abs(g - e) <= 1e-9 * lr  # NaN is no answer
        ]
        if bad:
            hint = next(
                (
                    h
                    for h, switch in mistakes.items()
                    if all(
                        isinstance(g, (int, float))
                        and abs(g - _cosine(i, steps, warmup, lr, min_lr, **switch)) <= 1e-9 * lr
                        for i, g in enumerate(got)
                    )
                ),
                "linear warm-up to lr, then min_lr + (lr − min_lr) · (1 + cos(π · progress)) / 2",
            )
            i = bad[0]
            raise CheckFailed(
                f"{exercise}: steps={steps}, warmup_steps={warmup}, lr={lr:g}, min_lr={min_lr:g}: "
                f"step {i} should get {expected[i]:.6g}, got {got[i]!r}; hint: {hint}"
            )
    return report_passed(exercise, len(configs))
