"""labkit.quant.gptq: GPTQ on one layer (its inverse-Hessian factor: tests/test_calibration.py)."""

from __future__ import annotations

import pytest
import torch

from labkit.quant.formats import QuantConfig, quantize_rtn
from labkit.quant.gptq import gptq_quantize, hessian_error
from labkit.quant.gptq_format import pack_weight, unpack_weight


def correlated_inputs(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Inputs with strongly correlated features, as real activations have (where GPTQ beats RTN)."""
    g = torch.Generator().manual_seed(seed)
    factors = torch.randn(n, dim // 4, generator=g) @ torch.randn(dim // 4, dim, generator=g)
    return factors + 0.1 * torch.randn(n, dim, generator=g)


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    return 2 * x.T @ x / x.shape[0]


@pytest.mark.parametrize("group_size", [16, -1])
def test_gptq_with_a_diagonal_hessian_is_round_to_nearest(group_size):
    """No correlation between inputs: no error to propagate, so GPTQ must reduce to RTN exactly."""
    w = torch.randn(16, 64)
    h = torch.diag(torch.rand(64) + 0.5)
    cfg = QuantConfig(bits=3, group_size=group_size, block_size=32)
    assert torch.equal(gptq_quantize(w, h, cfg).codes, quantize_rtn(w, cfg).codes)


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_correlated_inputs(bits, act_order):
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    x = correlated_inputs(512, 64)
    h = hessian_of(x)
    cfg = QuantConfig(bits=bits, group_size=16, act_order=act_order, block_size=32)
    gptq = gptq_quantize(w, h, cfg).dequantize()
    rtn = quantize_rtn(w, cfg).dequantize()
    out_err = lambda wq: ((x @ (w - wq).T) ** 2).sum() / ((x @ w.T) ** 2).sum()  # noqa: E731
    assert out_err(gptq) < 0.8 * out_err(rtn)
    assert hessian_error(w, gptq, h) == pytest.approx(float(out_err(gptq)), rel=1e-3)


def test_gptq_act_order_groups_are_full_and_consistent():
    w = torch.randn(8, 64)
    h = hessian_of(correlated_inputs(256, 64))
    q = gptq_quantize(w, h, QuantConfig(bits=4, group_size=16, act_order=True))
    assert sorted(torch.bincount(q.g_idx.long()).tolist()) == [16, 16, 16, 16]
    assert not torch.equal(q.g_idx, torch.arange(64, dtype=torch.int32) // 16)  # columns were reordered
    back = unpack_weight(pack_weight(q), 4, 64)
    assert torch.equal(back.dequantize(), q.dequantize())


def test_gptq_dead_inputs_get_zero_weights():
    w = torch.randn(8, 32)
    x = correlated_inputs(128, 32)
    x[:, 5] = 0
    q = gptq_quantize(w, hessian_of(x), QuantConfig(bits=4, group_size=16))
    assert (q.dequantize()[:, 5] == 0).all()


def test_gptq_singular_hessian_without_damping_is_a_clear_error():
    x = correlated_inputs(8, 32)  # 8 tokens cannot span 32 dimensions
    with pytest.raises(ValueError, match="not positive definite"):
        gptq_quantize(torch.randn(4, 32), hessian_of(x), QuantConfig(group_size=16, damp=0.0))


def test_gptq_rejects_a_hessian_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"hessian must be \[32, 32\]"):
        gptq_quantize(torch.randn(4, 32), torch.eye(16), QuantConfig(group_size=16))


@pytest.mark.parametrize("act_order", [False, True])
def test_layers_sharing_an_input_quantize_stacked_as_each_alone(act_order):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 512, generator=g)
    x[1] += x[0]
    h = 2 * x @ x.T / 512
    a, b = torch.randn(8, 64, generator=g), torch.randn(4, 64, generator=g)
    cfg = QuantConfig(bits=4, group_size=16, act_order=act_order)
    both = gptq_quantize(torch.cat([a, b]), h, cfg)
    for w, part in ((a, both.rows(0, 8)), (b, both.rows(8, 12))):
        alone = gptq_quantize(w, h, cfg)
        assert torch.equal(part.codes, alone.codes) and torch.equal(part.g_idx, alone.g_idx)
        assert torch.equal(part.zeros, alone.zeros)
        torch.testing.assert_close(part.scales, alone.scales)


def naive_gptq_codes(w: torch.Tensor, h: torch.Tensor, bits: int, group: int, damp: float) -> torch.Tensor:
    """GPTQ as OBQ states it, in float64 and without any of labkit's machinery: quantize column i, spread its
    error over the later columns by the inverse Hessian's row i, then remove variable i from that inverse
    (H⁻¹ ← H⁻¹ − H⁻¹[:, i] H⁻¹[i, :] / H⁻¹[i, i]); a group's symmetric grid (fp16 scale, zero at the middle
    code) is fitted to its columns as updated when the group starts."""
    w, maxq = w.double().clone(), 2**bits - 1
    h = h.double() + damp * h.double().diagonal().mean() * torch.eye(h.shape[0], dtype=torch.float64)
    hinv = torch.linalg.inv(h)
    codes = torch.empty_like(w)
    for i in range(w.shape[1]):
        if i % group == 0:
            scale = (2 * w[:, i : i + group].abs().amax(dim=1) / maxq).half().double()
            zero = (maxq + 1) // 2
        codes[:, i] = torch.clamp(torch.round(w[:, i] / scale) + zero, 0, maxq)
        err = (w[:, i] - scale * (codes[:, i] - zero)) / hinv[i, i]
        w[:, i + 1 :] -= err[:, None] * hinv[i, i + 1 :][None, :]
        hinv = hinv - hinv[:, i : i + 1] @ hinv[i : i + 1, :] / hinv[i, i]
    return codes


@pytest.mark.parametrize("bits, group_size", [(4, 32), (3, 32), (4, -1)])
def test_gptq_codes_equal_a_naive_float64_obq_loop(bits, group_size):
    """The Cholesky factor, the lazy block updates and the group grids change how GPTQ is computed, not its
    result: every code equals the textbook loop's, on a layer where GPTQ and RTN disagree."""
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(1))
    h = hessian_of(correlated_inputs(512, 96, seed=2))
    cfg = QuantConfig(bits=bits, group_size=group_size, block_size=32)  # three blocks of lazy updates
    ours = gptq_quantize(w, h, cfg).codes
    reference = naive_gptq_codes(w, h, bits, group_size if group_size != -1 else 96, cfg.damp)
    assert torch.equal(ours.double(), reference)
    assert (ours != quantize_rtn(w, cfg).codes).float().mean() > 0.1  # the error feedback moved many codes
