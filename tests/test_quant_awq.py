"""labkit.quant.awq: activation-aware scales before RTN — the search on one layer, and the fold on a model."""

from __future__ import annotations

import pytest
import torch

from labkit.models import tiny_llama
from labkit.quant.awq import activation_scale, awq_model, scaled_rtn, search_scale
from labkit.quant.formats import QuantConfig, quantize_rtn
from labkit.quant.gptq import hessian_error

CFG = QuantConfig(bits=3, group_size=32)


def outlier_inputs(n: int, seed: int) -> torch.Tensor:
    """Inputs whose channels 0-3 are 30x larger than the rest: the activation outliers AWQ is about."""
    x = torch.randn(n, 128, generator=torch.Generator().manual_seed(seed))
    x[:, :4] *= 30
    return x


def hessian(x: torch.Tensor) -> torch.Tensor:
    return 2 * x.T @ x / x.shape[0]


def test_activation_scale_is_the_rms_of_each_input():
    x = outlier_inputs(500, 0)
    assert torch.allclose(activation_scale(hessian(x)), x.pow(2).mean(dim=0).sqrt(), rtol=1e-5)


def test_alpha_zero_is_plain_rtn():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    assert torch.equal(scaled_rtn(w, torch.ones(128), CFG), quantize_rtn(w, CFG).dequantize())
    _, _, errors = search_scale(w, hessian(outlier_inputs(500, 0)), CFG, grid=4)
    assert errors[0] == pytest.approx(
        hessian_error(w, quantize_rtn(w, CFG).dequantize(), hessian(outlier_inputs(500, 0)))
    )


def test_scaling_protects_outlier_channels_on_held_out_inputs():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    calib, held_out = outlier_inputs(1000, 3), outlier_inputs(1000, 4)
    scale, alpha, errors = search_scale(w, hessian(calib), CFG)
    assert alpha > 0 and min(errors) < errors[0]
    assert torch.all(scale[:4] > scale[4:].max())  # the outlier channels are scaled up
    rtn = hessian_error(w, quantize_rtn(w, CFG).dequantize(), hessian(held_out))
    awq = hessian_error(w, scaled_rtn(w, scale, CFG), hessian(held_out))
    assert awq < 0.8 * rtn


def test_folding_keeps_the_model_exactly_and_never_loses_to_rtn_on_calibration():
    model = tiny_llama(num_layers=2)
    with torch.no_grad():  # give the norms something to fold into that is not all ones
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    calib = torch.randint(2, 512, (8, 64), generator=torch.Generator().manual_seed(0))
    ids = torch.randint(2, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    result = awq_model(model, calib, CFG, grid=5, progress=False)
    with torch.no_grad():
        before, after = model(ids).logits, result.model(ids).logits
    assert torch.allclose(before, after, atol=1e-4, rtol=1e-4)
    assert not torch.equal(
        model.model.layers[0].input_layernorm.weight, result.model.model.layers[0].input_layernorm.weight
    )
    assert [r.names[0].rsplit(".", 2)[-2:] for r in result.records[:3]] == [
        ["self_attn", "q_proj"], ["mlp", "gate_proj"], ["mlp", "down_proj"],
    ]  # fmt: skip
    assert len(result.records) == 3 * 2 and all(n.endswith("o_proj") for n in result.skipped)
    assert all(r.error <= r.rtn_error for r in result.records)


def test_bad_arguments_are_refused():
    model = tiny_llama()
    calib = torch.randint(2, 512, (2, 16))
    with pytest.raises(TypeError, match="QuantConfig"):
        awq_model(model, calib, {"bits": 4})
    with pytest.raises(ValueError, match="long tensor"):
        awq_model(model, calib.float(), CFG)
    with pytest.raises(ValueError, match="grid"):
        awq_model(model, calib, CFG, grid=0)
    with pytest.raises(ValueError):
        awq_model(model, torch.full((2, 16), 9999), CFG)
