"""labkit.checks.lab02: the dynamic loss-scale update and what a format keeps; each check passes the reference
answer and fails the usual wrong answers with a message that says what to fix."""

from __future__ import annotations

import pytest
import torch

from labkit import precision
from labkit.checks import core, lab02


def test_loss_scale_check_passes_the_reference():
    assert lab02.check_update_loss_scale(precision.update_loss_scale) is precision.update_loss_scale


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (
            lambda s, g, inf, up, down, n: (
                (s * down, g) if inf else precision.update_loss_scale(s, g, inf, up, down, n)
            ),
            "restarts the count",
        ),
        (lambda s, g, inf, up, down, n: (s * down, 0) if inf else (s * up, 0), "only adds 1"),  # grows every step
        (lambda s, g, inf, up, down, n: (s * down, 0) if inf else (s, g + 1), "grows by growth_factor"),  # never grows
        (lambda s, g, inf, up, down, n: s, "new_scale, new_good_steps"),
    ],
)
def test_loss_scale_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab02.check_update_loss_scale(wrong)


def test_kept_fraction_check_passes_the_reference():
    assert lab02.check_kept_fraction(precision.kept_fraction) is precision.kept_fraction


def test_kept_fraction_check_passes_a_float32_mean():
    """The notebook's solution averages in float32 (4/7 -> 0.5714285969734192), not exactly: still right."""

    def float32_mean(v, dtype, scale):
        nonzero = v[v != 0]
        return ((nonzero * scale).to(dtype) != 0).float().mean().item()

    assert float32_mean(torch.tensor([1e-3, 1e-6, 1e-8, 3e-9, 1e-10, 2.0, 0.0, -5e-8]), torch.float16, 1.0) != 4 / 7
    assert lab02.check_kept_fraction(float32_mean) is float32_mean


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda v, dtype, scale: ((v * scale).to(dtype) != 0).float().mean().item(), "drop the exact zeros"),
        (lambda v, dtype, scale: precision.kept_fraction(v, dtype), "multiply by the loss scale"),
        (lambda v, dtype, scale: 1.0, "cast \\(values · scale\\)"),
    ],
)
def test_kept_fraction_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab02.check_kept_fraction(wrong)


def test_kept_fraction_counts_non_zero_values_and_refuses_all_zeros():
    assert precision.kept_fraction(torch.tensor([1e-10, 1.0, 0.0]), torch.float16) == 0.5
    assert precision.kept_fraction(torch.tensor([1e-10, 1.0]), torch.float16, scale=2.0**16) == 1.0
    with pytest.raises(ValueError, match="no non-zero"):
        precision.kept_fraction(torch.zeros(3), torch.float16)
