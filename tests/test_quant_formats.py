"""labkit.quant.formats: QuantConfig, round to nearest, the stored bits per weight."""

from __future__ import annotations

import pytest
import torch

from labkit.quant.formats import BITS, QuantConfig, bits_per_weight, quantize_rtn


@pytest.mark.parametrize(
    "kwargs",
    [{"bits": 5}, {"bits": 1}, {"group_size": 0}, {"group_size": -2}, {"damp": 1.0}, {"damp": -0.1}, {"block_size": 0}],
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        QuantConfig(**kwargs)


def test_group_size_must_divide_the_input_width():
    with pytest.raises(ValueError, match=r"does not divide in_features 576.*\[16, 32, 64\]"):
        QuantConfig(group_size=128).width(576)
    assert QuantConfig(group_size=64).width(576) == 64
    assert QuantConfig(group_size=-1).width(576) == 576


def test_rtn_on_a_hand_checked_row():
    w = torch.tensor([[-1.0, 0.0, 1.0, 2.0]])
    q = quantize_rtn(w, QuantConfig(bits=2, group_size=-1, sym=False))
    assert q.scales.tolist() == [[1.0]] and q.zeros.tolist() == [[1]]
    assert q.codes.tolist() == [[0, 1, 2, 3]]
    assert torch.equal(q.dequantize(), w)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", [16, -1])
def test_rtn_error_is_at_most_half_a_step_on_an_asymmetric_grid(bits, group_size):
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(bits))
    q = quantize_rtn(w, QuantConfig(bits=bits, group_size=group_size, sym=False))
    assert int(q.codes.max()) <= 2**bits - 1
    step = q.scales[q.g_idx.long()].T
    assert ((w - q.dequantize()).abs() <= step / 2 + 1e-6).all()
    assert q.scales.shape == (64 // (group_size if group_size > 0 else 64), 8)


def test_rtn_symmetric_zero_point_is_the_middle_code():
    q = quantize_rtn(torch.randn(4, 32), QuantConfig(bits=4, group_size=16, sym=True))
    assert (q.zeros == 8).all()


def test_rtn_rejects_non_finite_weights():
    w = torch.randn(4, 32)
    w[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_rtn(w, QuantConfig(group_size=16))


def test_bits_per_weight_counts_scales_zeros_and_g_idx():
    assert bits_per_weight(QuantConfig(bits=4, group_size=64), 576, 576) == pytest.approx(4 + 20 / 64 + 32 / 576)
    assert bits_per_weight(QuantConfig(bits=3, group_size=-1), 576, 1536) == pytest.approx(3 + 19 / 576 + 32 / 1536)
