"""labcourse.checks.lab02: the dynamic loss-scale update and what a format keeps; each check passes an answer
written here from the definition (not labkit's), whose values on small inputs are computed by hand, and fails the
usual wrong answers with a message that says what to fix."""

from __future__ import annotations

import pytest
import torch

from labcourse.checks import core, lab02
from labkit import precision


def update_by_hand(scale, good_steps, found_inf, growth_factor, backoff_factor, growth_interval):
    if found_inf:
        return scale * backoff_factor, 0
    if good_steps + 1 == growth_interval:
        return scale * growth_factor, 0
    return scale, good_steps + 1


def test_loss_scale_check_passes_a_hand_written_answer():
    assert update_by_hand(2.0**16, 2, False, 2.0, 0.5, 3) == (2.0**17, 0)  # the third good step in a row
    assert update_by_hand(2.0**16, 1, False, 2.0, 0.5, 3) == (2.0**16, 2)
    assert update_by_hand(2.0**16, 2, True, 2.0, 0.5, 3) == (2.0**15, 0)
    assert lab02.check_update_loss_scale(update_by_hand) is update_by_hand


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


def test_kept_fraction_check_passes_a_hand_written_answer():
    def kept_by_hand(values, dtype, scale):
        nonzero = [v for v in values.tolist() if v != 0]
        kept = [v for v in nonzero if torch.tensor(v * scale).to(dtype).item() != 0]
        return len(kept) / len(nonzero)

    values = torch.tensor([1e-3, 1e-6, 1e-8, 3e-9, 1e-10, 2.0, 0.0, -5e-8])
    # fp16's smallest subnormal is 2^-24 = 5.96e-8: values under half of it (1e-8, 3e-9, 1e-10) round to 0,
    # -5e-8 rounds to -2^-24; 4 of the 7 non-zero values survive. bf16 has fp32's range: all 7 do.
    assert kept_by_hand(values, torch.float16, 1.0) == 4 / 7
    assert kept_by_hand(values, torch.bfloat16, 1.0) == 1.0
    assert kept_by_hand(values, torch.float16, 2.0**10) == 1.0  # even 1e-10 · 1024 ≈ 1.0e-7 > 2^-25 now rounds up
    assert lab02.check_kept_fraction(kept_by_hand) is kept_by_hand


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
