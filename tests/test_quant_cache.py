"""Quantize once, load after: the cached result equals a fresh quantization saved and loaded, and is reused."""

import pytest
import torch

from labkit.models import tiny_llama
from labkit.quant.cache import quantize_model_cached
from labkit.quant.formats import QuantConfig
from labkit.quant.whole_model import quantize_model

CFG = QuantConfig(bits=4, group_size=32)


@pytest.fixture
def calibration():
    return torch.randint(2, 512, (8, 64), generator=torch.Generator().manual_seed(0))


def test_the_first_call_quantizes_the_second_reuses_and_both_equal_a_fresh_run(tmp_cache, calibration):
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first, reused_first = quantize_model_cached(model, CFG, calibration, progress=False)
    second, reused_second = quantize_model_cached(model, CFG, calibration, progress=False)
    assert (reused_first, reused_second) == (False, True)
    assert len(list((tmp_cache / "quantized").glob("gptq-*"))) == 1

    fresh = quantize_model(model, CFG, calibration, progress=False)
    reference = fresh.model.state_dict()
    for result in (first, second):  # bit for bit the model a fresh run gives, codes and scales included
        assert result.model.state_dict().keys() == reference.keys()
        assert all(torch.equal(result.model.state_dict()[k], reference[k]) for k in reference)
        assert result.weights.keys() == fresh.weights.keys()
        for name, q in fresh.weights.items():
            got = result.weights[name]
            assert all(torch.equal(getattr(got, f), getattr(q, f)) for f in ("codes", "scales", "zeros", "g_idx"))
    assert second.seconds == first.seconds > 0 and second.layers == first.layers and len(first.layers) > 0
    assert first.calibration_tokens == calibration.numel()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the input model is untouched


def test_other_weights_settings_or_calibration_get_their_own_entry(tmp_cache, calibration):
    model = tiny_llama()
    quantize_model_cached(model, CFG, calibration, progress=False)
    assert quantize_model_cached(model, QuantConfig(bits=3, group_size=32), calibration, progress=False)[1] is False
    assert quantize_model_cached(model, CFG, calibration.flip(0), progress=False)[1] is False
    assert quantize_model_cached(tiny_llama(seed=1), CFG, calibration, progress=False)[1] is False
    assert len(list((tmp_cache / "quantized").glob("gptq-*"))) == 4
