"""Lab 02's exercise checks: the loss-scale update, what a format keeps."""

from __future__ import annotations

from collections.abc import Callable

import torch

from labcourse.checks.core import CheckFailed, call_answer, goes_on_with, report_passed
from labkit import precision


@goes_on_with(precision.update_loss_scale, "precision.update_loss_scale")
def check_update_loss_scale(fn: Callable[[float, int, bool, float, float, int], tuple[float, int]]) -> Callable:
    """Lab 02: fn(scale, good_steps, found_inf, growth_factor, backoff_factor, growth_interval) -> (scale, steps)."""
    exercise = "exercise 02.2 (dynamic loss scaling)"
    flags = [False, False, False, True, False, False, False, False, True, True, False, False, False]
    scale, good = 2.0**16, 0
    for step, found_inf in enumerate(flags):
        expected = precision.update_loss_scale(scale, good, found_inf, 2.0, 0.5, 3)
        got = call_answer(exercise, fn, scale, good, found_inf, 2.0, 0.5, 3)
        if not isinstance(got, tuple) or len(got) != 2:
            raise CheckFailed(f"{exercise}: return (new_scale, new_good_steps), got {got!r}")
        if (float(got[0]), int(got[1])) != expected:
            if found_inf:
                hint = "an overflow multiplies the scale by backoff_factor and restarts the count at 0"
            elif expected[0] != scale:
                hint = "after growth_interval = 3 good steps in a row the scale grows by growth_factor, count back to 0"
            else:
                hint = "a good step that does not complete the interval only adds 1 to the count"
            raise CheckFailed(
                f"{exercise}: step {step}, scale {scale:g}, good steps {good}, found_inf {found_inf}: "
                f"expected {expected}, got {got}; hint: {hint}"
            )
        scale, good = expected
    return report_passed(exercise, len(flags))


@goes_on_with(precision.kept_fraction, "precision.kept_fraction")
def check_kept_fraction(fn: Callable[[torch.Tensor, torch.dtype, float], float]) -> Callable:
    """Lab 02: fn(values, dtype, scale) is the share of non-zero values still non-zero after scaling and casting."""
    exercise = "exercise 02.1 (what a format keeps)"
    values = torch.tensor([1e-3, 1e-6, 1e-8, 3e-9, 1e-10, 2.0, 0.0, -5e-8])
    cases = [(torch.float16, 1.0), (torch.float16, 2.0**10), (torch.bfloat16, 1.0), (torch.float16, 2.0**20)]
    tol = 1e-6  # a share computed as a float32 mean is exact to ~6e-8; two possible answers differ by >= 1/8
    for dtype, scale in cases:
        expected = precision.kept_fraction(values, dtype, scale)
        got = call_answer(exercise, fn, values.clone(), dtype, scale)
        if not isinstance(got, (int, float)) or not abs(got - expected) <= tol:  # NaN is no answer
            unscaled = precision.kept_fraction(values, dtype, 1.0)
            with_zero = ((values * scale).to(dtype) != 0).float().mean().item()
            if isinstance(got, (int, float)) and abs(got - with_zero) < tol:
                hint = "count among the values that were non-zero to begin with (drop the exact zeros first)"
            elif isinstance(got, (int, float)) and abs(got - unscaled) < tol:
                hint = "multiply by the loss scale before casting: that is what the scale is for"
            else:
                hint = "cast (values · scale) to the dtype and count what is still non-zero"
            raise CheckFailed(
                f"{exercise}: {dtype}, scale {scale:g}: expected {expected:.4f}, got {got!r}; hint: {hint}"
            )
    return report_passed(exercise, len(cases))
