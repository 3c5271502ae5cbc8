"""labkit.quant.model: calibration windows, input Hessians, whole models block by block."""

from __future__ import annotations

import warnings

import pytest
import torch

from labkit.models import tiny_llama
from labkit.quant.formats import QuantConfig
from labkit.quant.model import (
    METHODS,
    TOKENS_PER_INPUT,
    _first_block_inputs,
    _input_hessian,
    _sequential_groups,
    calibration_blocks,
    input_hessian,
    quantize_model,
)
from labkit.torchutil import decoder_layers
from tests.numerics import assert_within, reorder_bound


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


@pytest.fixture(scope="module")
def calibration():
    return torch.randint(2, 512, (8, 64), generator=torch.Generator().manual_seed(0))


def test_sequential_groups_follow_the_data_flow(tiny, calibration):
    layers = decoder_layers(tiny)
    inputs, kwargs = _first_block_inputs(tiny, layers, calibration[:2], batch_size=2)
    groups = _sequential_groups(layers[0], inputs[0], kwargs[0])
    assert groups == [
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        ["self_attn.o_proj"],
        ["mlp.gate_proj", "mlp.up_proj"],
        ["mlp.down_proj"],
    ]


def test_input_hessian_is_two_x_xt_over_n(tiny, calibration):
    layers = decoder_layers(tiny)
    inputs, kwargs = _first_block_inputs(tiny, layers, calibration[:4], batch_size=2)
    seen = []
    down = layers[0].mlp.down_proj
    handle = down.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, m.in_features)))
    with torch.no_grad():
        for x, kw in zip(inputs, kwargs):
            layers[0](x, **kw)
    handle.remove()
    x = torch.cat(seen)
    h, n = _input_hessian(layers[0], down, inputs, kwargs)
    assert n == 4 * 64 and h.dtype == torch.float32
    x = x.double()  # H: a float64 sum (in another order than this one) rounded once to fp32
    expected = 2 * x.T @ x / n
    bound = torch.finfo(torch.float32).eps / 2 * expected.abs() + reorder_bound(
        n, 2 * x.abs().T @ x.abs() / n, torch.float64
    )
    assert_within(h.double(), expected, bound)


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


class CharTokenizer:
    """One token per character (ids = code points), EOS = 0: enough for calibration_blocks."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_calibration_blocks_are_deterministic_non_overlapping_windows():
    texts = ["abcdefgh" * 5, "ijklmnop" * 5]  # 82 tokens with the two EOS
    blocks = calibration_blocks(CharTokenizer(), texts, n_blocks=3, block_size=16, seed=1)
    assert blocks.shape == (3, 16) and blocks.dtype == torch.long
    assert torch.equal(blocks, calibration_blocks(CharTokenizer(), texts, 3, 16, seed=1))
    stream = [t for text in texts for t in [ord(c) for c in text] + [0]]
    starts = [next(i for i in range(0, len(stream), 16) if stream[i : i + 16] == row.tolist()) for row in blocks]
    assert len(set(starts)) == 3
    with pytest.raises(ValueError, match="fewer than the 9"):
        calibration_blocks(CharTokenizer(), texts, n_blocks=9, block_size=16)


def test_input_hessian_of_a_whole_model_equals_the_block_level_one(tiny, calibration):
    layers = decoder_layers(tiny)
    inputs, kwargs = _first_block_inputs(tiny, layers, calibration[:4], batch_size=2)
    expected, _ = _input_hessian(layers[0], layers[0].self_attn.q_proj, inputs, kwargs)
    h = input_hessian(tiny, "model.layers.0.self_attn.q_proj", calibration[:4], batch_size=2)
    torch.testing.assert_close(h, expected)
    with pytest.raises(ValueError, match="not an nn.Linear"):
        input_hessian(tiny, "model.layers.0.self_attn", calibration[:4])
