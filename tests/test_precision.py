"""labkit.precision: the dynamic loss-scale update equals torch's own (what GradScaler runs)."""

from __future__ import annotations

import torch

from labkit import precision


def test_loss_scale_update_follows_torch_amp_step_by_step():
    flags = [False, False, True, False, False, False, False, True, True, False, False, False, False]
    scale, tracker = torch.tensor([65536.0]), torch.tensor([0], dtype=torch.int32)
    ours = (65536.0, 0)
    for found_inf in flags:
        torch._amp_update_scale_(scale, tracker, torch.tensor([float(found_inf)]), 2.0, 0.5, 3)
        ours = precision.update_loss_scale(*ours, found_inf, 2.0, 0.5, 3)
        assert ours == (scale.item(), tracker.item())
    assert ours[0] == 65536.0 * 0.5**3 * 2**2  # three overflows, two completed intervals of 3 good steps
