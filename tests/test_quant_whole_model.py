"""labkit.quant.whole_model: whole models quantized block by block (the sweep itself: tests/test_calibration.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

from labkit.calibration import TOKENS_PER_INPUT
from labkit.models import tiny_llama
from labkit.quant.formats import QuantConfig
from labkit.quant.whole_model import METHODS, quantize_model, weight_bytes


@pytest.mark.parametrize("method", METHODS)
def test_quantize_model_leaves_the_source_alone_and_quantizes_every_block_linear(tiny, calibration, method):
    before = {k: v.clone() for k, v in tiny.state_dict().items()}
    cfg = QuantConfig(bits=3, group_size=32)
    qm = quantize_model(tiny, cfg, calibration, method=method, progress=False)
    assert all(torch.equal(before[k], v) for k, v in tiny.state_dict().items())
    assert len(qm.weights) == len(qm.layers) == 2 * 7
    for name, q in qm.weights.items():
        weight = qm.model.get_submodule(name).weight
        assert torch.equal(weight, q.dequantize())
        assert len(torch.unique(weight[0, :32])) <= 2**3
    assert torch.equal(qm.model.model.embed_tokens.weight, tiny.model.embed_tokens.weight)
    if method == "gptq":
        assert qm.calibration_tokens == calibration.numel()
        assert sum(r.error for r in qm.layers) < sum(r.rtn_error for r in qm.layers)


def test_quantize_model_inplace_changes_the_model():
    model = tiny_llama()
    original = model.model.layers[0].mlp.up_proj.weight.clone()
    qm = quantize_model(model, QuantConfig(bits=4, group_size=32), method="rtn", inplace=True, progress=False)
    assert qm.model is model and not torch.equal(model.model.layers[0].mlp.up_proj.weight, original)


def test_weight_bytes_and_bits_per_weight_count_the_packed_layers_by_hand(tiny):
    qm = quantize_model(tiny, QuantConfig(bits=4, group_size=32), method="rtn", progress=False)
    # per weight 4 bits + an fp16 scale and a 4-bit zero per group of 32 = 4.625 bits; per input column an int32
    # g_idx. q, o: 4,096 weights of 64 inputs; k, v: 2,048 of 64; gate, up: 8,192 of 64; down: 8,192 of 128
    per_layer = 2 * (2368 + 256) + 2 * (1184 + 256) + 2 * (4736 + 256) + (4736 + 512)
    weights = 2 * (2 * 4096 + 2 * 2048 + 3 * 8192)
    assert weight_bytes(qm) == {
        "quantized": 2 * per_layer,
        "fp16": 2 * weights,
        "fp32": 4 * weights,
        "weights": weights,
    }
    assert qm.bits_per_weight() == 8 * 23_360 / 36_864 == 8 * 2 * per_layer / weights


def test_gptq_warns_when_calibration_leaves_the_hessian_nearly_singular(tiny, calibration):
    widest = tiny.config.intermediate_size  # down_proj's inputs
    few = calibration[:, : 3 * widest // calibration.shape[0]]  # 3 tokens per input: full rank, badly conditioned
    assert widest <= few.numel() < TOKENS_PER_INPUT * widest
    with pytest.warns(UserWarning, match="nearly singular"):
        quantize_model(tiny, QuantConfig(group_size=32), few, progress=False)
    enough = calibration[:, : TOKENS_PER_INPUT * widest // calibration.shape[0]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_model(tiny, QuantConfig(group_size=32), enough, progress=False)


def test_quantize_model_bad_input_is_caught_before_any_work(tiny, calibration):
    with pytest.raises(ValueError, match="too few"):
        quantize_model(tiny, QuantConfig(group_size=32), calibration[:1, :16], progress=False)
    with pytest.raises(ValueError, match="does not divide"):
        quantize_model(tiny, QuantConfig(group_size=48), calibration, progress=False)
    with pytest.raises(ValueError, match="long tensor"):
        quantize_model(tiny, QuantConfig(group_size=32), calibration.float(), progress=False)
    with pytest.raises(ValueError, match="method"):
        quantize_model(tiny, QuantConfig(group_size=32), calibration, method="awq")
