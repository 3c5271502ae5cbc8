"""labkit.quant.landscape: every method's point is that method run alone and scored alike; bad input fails first."""

from __future__ import annotations

import copy

import pytest
import torch

from labkit.models import tiny_llama
from labkit.quant.awq import awq_model
from labkit.quant.formats import QuantConfig
from labkit.quant.landscape import ptq_landscape
from labkit.quant.nf4 import quantize_model_nf4
from labkit.quant.whole_model import quantize_model
from labkit.torchutil import decoder_linears


def weight_error(reference):
    """A score anyone can recompute: the squared distance of a model's decoder weights from the reference's."""
    original = {name: m.weight.detach().clone() for name, m in decoder_linears(reference).items()}

    def score(model) -> float:
        return sum(float(((m.weight.detach() - original[n]) ** 2).sum()) for n, m in decoder_linears(model).items())

    return score


def test_each_point_is_its_method_run_alone(tiny, calibration):
    score = weight_error(tiny)
    before = {k: v.clone() for k, v in tiny.state_dict().items()}
    points = list(ptq_landscape(tiny, calibration, score, awq_blocks=4, awq_grid=4))
    g64 = QuantConfig(bits=4, group_size=64)
    alone = {
        "RTN 8-bit per channel": quantize_model(tiny, QuantConfig(bits=8, group_size=-1), method="rtn", progress=False),
        "RTN 4-bit g64": quantize_model(tiny, g64, method="rtn", progress=False),
        "NF4 + double quant": quantize_model_nf4(tiny, progress=False),
        "GPTQ 4-bit g64 act-order": quantize_model(
            tiny, QuantConfig(bits=4, group_size=64, act_order=True), calibration, progress=False
        ),
    }
    scaled = awq_model(tiny, calibration[:4], g64, grid=4, progress=False)
    alone["AWQ-style + RTN 4-bit g64"] = quantize_model(scaled.model, g64, method="rtn", progress=False)

    assert [p.method for p in points] == [
        "RTN 8-bit per channel",
        "RTN 4-bit g64",
        "NF4 + double quant",
        "AWQ-style + RTN 4-bit g64",
        "GPTQ 4-bit g64 act-order",
    ]
    for p in points:
        assert p.score == pytest.approx(score(alone[p.method].model), rel=1e-6), p.method
        assert p.bits == pytest.approx(alone[p.method].bits_per_weight()), p.method
        assert p.seconds > 0 and not p.reused
    assert points[0].score < points[1].score  # 8 bits round finer than 4
    assert points[3].alphas == tuple(r.alpha for r in scaled.records) and len(points[3].alphas) == 3 * 2
    assert all(torch.equal(v, before[k]) for k, v in tiny.state_dict().items())  # the source model is untouched


def test_cache_reuses_gptq_and_without_act_order_names_it(tiny, calibration, tmp_cache):
    score = weight_error(tiny)
    first, second = (
        list(ptq_landscape(tiny, calibration, score, act_order=False, awq_grid=2, cache=True)) for _ in range(2)
    )
    assert first[-1].method == "GPTQ 4-bit g64"
    assert (first[-1].reused, second[-1].reused) == (False, True)
    assert second[-1].score == first[-1].score and second[-1].seconds == first[-1].seconds


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"group_size": 48}, ValueError),  # 48 divides none of the widths 64 and 128
        ({"calibration": torch.zeros(1, 100, dtype=torch.long)}, ValueError),  # under the 128 inputs of down_proj
        ({"calibration": torch.zeros(2, 64)}, ValueError),  # not token ids
        ({"score": 3.0}, TypeError),
        ({"awq_blocks": 0}, ValueError),
        ({"awq_blocks": 9}, ValueError),  # the calibration holds 8 windows
        ({"awq_grid": 0}, ValueError),
        ({"act_order": "yes"}, TypeError),
        ({"progress": 1}, TypeError),
    ],
)
def test_bad_input_fails_before_any_method_runs(tiny, calibration, kwargs, error):
    calls = []
    args = {"calibration": calibration, "score": lambda m: calls.append(m) or 0.0} | kwargs
    with pytest.raises(error):
        ptq_landscape(tiny, args.pop("calibration"), args.pop("score"), **args)
    assert not calls


def test_progress_shows_the_two_calibrated_methods_and_only_when_asked(tiny, calibration, capsys):
    for progress in (True, False):
        list(ptq_landscape(tiny, calibration, weight_error(tiny), awq_grid=2, progress=progress))
        shown = capsys.readouterr().err
        assert ("AWQ scales" in shown and "GPTQ" in shown) is progress, shown[-300:]
        assert "RTN" not in shown and "NF4" not in shown  # seconds each: no bar


def test_a_model_that_nf4_or_awq_cannot_take_fails_before_any_method_runs(tiny, calibration):
    calls = []
    no_norm = copy.deepcopy(tiny)
    no_norm.model.layers[0].input_layernorm = torch.nn.Identity()  # nothing to fold q/k/v's scale into
    odd = tiny_llama(hidden_size=40, num_heads=4, num_kv_heads=2, intermediate_size=72)  # k_proj: 800 weights
    for model, group_size, message in ((no_norm, 64, "input_layernorm"), (odd, -1, "blocks of 64")):
        with pytest.raises(ValueError, match=message):
            ptq_landscape(model, calibration, lambda m: calls.append(m) or 0.0, group_size=group_size)
    assert not calls
