"""Structured pruning: smaller models that run, save and reload, the channels and heads the importance
ranks first kept, and head counts or importances that cannot work refused without a change."""

import copy

import pytest
import torch

from labkit.models import load_model, save_model
from labkit.prune import structured
from tests.numerics import FLOAT64
from tests.prune_helpers import IDS, _logits, _model, _state, _unchanged


def test_mlp_channel_pruning_gives_a_smaller_model_that_generates_saves_and_reloads(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _model()
    before = structured.model_shapes(model)
    shapes = structured.prune_mlp_channels(model, 0.25)
    assert shapes["mlp_channels"] == 96 and model.config.intermediate_size == 96
    assert shapes["params"] == before["params"] - 2 * 3 * 64 * 32
    out = model.generate(input_ids=IDS[:1, :4], max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 9)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert structured.model_shapes(reloaded) == shapes
    torch.testing.assert_close(_logits(reloaded, IDS), _logits(model, IDS), rtol=0, atol=0)


def test_mlp_channel_pruning_keeps_the_channels_with_the_largest_norms():
    model, reference = _model(), _model()
    structured.prune_mlp_channels(model, 0.5)
    mlp = reference.model.layers[0].mlp
    norm = mlp.gate_proj.weight.pow(2).sum(1) + mlp.up_proj.weight.pow(2).sum(1) + mlp.down_proj.weight.pow(2).sum(0)
    keep = norm.topk(64).indices.sort().values
    torch.testing.assert_close(model.model.layers[0].mlp.up_proj.weight, mlp.up_proj.weight[keep])


def _written_output_by_hand(model, ids):
    """‖W_down[:, c]‖ · ‖silu(gate x) · up x‖ over the tokens, per channel, from each MLP's input."""
    inputs = []
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, a: inputs.append(a[0])) for layer in model.model.layers]
    _logits(model, ids)
    for h in hooks:
        h.remove()
    scores = []
    for layer, x in zip(model.model.layers, inputs):
        mlp = layer.mlp
        hidden = torch.nn.functional.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)
        scores.append(mlp.down_proj.weight.norm(dim=0) * hidden.flatten(0, 1).norm(dim=0))
    return scores


def test_activation_importance_keeps_the_channels_that_write_most_on_calibration_text():
    model, reference = _model(), _model()
    structured.prune_mlp_channels(model, 0.5, importance="activation", calibration=[IDS[:1], IDS[1:]])
    with torch.no_grad():
        scores = _written_output_by_hand(reference, IDS)
    for layer, ref, score in zip(model.model.layers, reference.model.layers, scores):
        keep = score.topk(64).indices.sort().values
        torch.testing.assert_close(layer.mlp.up_proj.weight, ref.mlp.up_proj.weight[keep], rtol=0, atol=0)
        torch.testing.assert_close(layer.mlp.down_proj.weight, ref.mlp.down_proj.weight[:, keep], rtol=0, atol=0)
    magnitude = _model()
    structured.prune_mlp_channels(magnitude, 0.5)
    assert not torch.equal(magnitude.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)


def test_activation_importance_keeps_the_heads_that_write_most():
    model, reference = _model(), _model()
    captured = {}
    for i, layer in enumerate(reference.model.layers):
        layer.self_attn.o_proj.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, a[0]))
    _logits(reference, IDS)
    structured.prune_attention_heads(model, 2, importance="activation", calibration=[IDS])
    for i, layer in enumerate(reference.model.layers):
        o = layer.self_attn.o_proj.weight.detach()
        per_column = o.pow(2).sum(0) * captured[i].flatten(0, 1).pow(2).sum(0)
        head = per_column.view(4, 16).sum(1).view(2, 2)  # 2 key/value groups of 2 query heads
        kept = head.argmax(1) + torch.tensor([0, 2])
        rows = (kept[:, None] * 16 + torch.arange(16)).flatten()
        q = layer.self_attn.q_proj.weight[rows]
        torch.testing.assert_close(model.model.layers[i].self_attn.q_proj.weight, q, rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())


def test_taylor_importance_uses_calibration_gradients_and_clears_them():
    model = _model()
    shapes = structured.prune_mlp_channels(model, 0.25, importance="taylor", calibration=[IDS])
    assert shapes["mlp_channels"] == 96
    assert all(p.grad is None for p in model.parameters())
    heads = structured.prune_attention_heads(_model(), 2, importance="taylor", calibration=[IDS])
    assert heads["heads"] == 2


def test_removing_a_head_equals_zeroing_its_output_columns(tmp_path):
    model, reference = _model(), _model()
    state = reference.state_dict()
    shapes = structured.prune_attention_heads(model, 2)  # 4 heads in 2 key/value groups: one from each
    assert (shapes["heads"], shapes["kv_heads"], shapes["head_dim"]) == (2, 2, 16)
    for i, layer in enumerate(reference.model.layers):
        q = state[f"model.layers.{i}.self_attn.q_proj.weight"].view(4, 16, -1)
        kept = [
            h
            for h in range(4)
            if any(torch.equal(q[h], r) for r in model.model.layers[i].self_attn.q_proj.weight.view(2, 16, -1))
        ]
        assert len(kept) == 2 and {h // 2 for h in kept} == {0, 1}  # one per group
        with torch.no_grad():
            for h in set(range(4)) - set(kept):
                layer.self_attn.o_proj.weight[:, h * 16 : (h + 1) * 16] = 0
    fewer_heads, zeroed = copy.deepcopy(model).double(), copy.deepcopy(reference).double()  # different shapes: float64
    torch.testing.assert_close(_logits(fewer_heads, IDS), _logits(zeroed, IDS), **FLOAT64)
    tokenizer_free = tmp_path / "m"
    model.save_pretrained(tokenizer_free)
    reloaded = type(model).from_pretrained(tokenizer_free)
    torch.testing.assert_close(_logits(reloaded, IDS), _logits(model, IDS), rtol=0, atol=0)


@pytest.mark.model
def test_structured_default_model_saves_and_reloads_with_identical_outputs(default_model, tmp_path):
    model, tokenizer = copy.deepcopy(default_model[0]), default_model[1]
    structured.prune_mlp_channels(model, 0.1)
    shapes = structured.prune_attention_heads(model, 3)
    assert (shapes["mlp_channels"], shapes["heads"], shapes["kv_heads"]) == (1376, 6, 3)
    reloaded, _ = load_model(str(save_model(model, tokenizer, tmp_path / "pruned")))
    assert structured.model_shapes(reloaded) == shapes
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    torch.testing.assert_close(_logits(reloaded, ids), _logits(model, ids), rtol=0, atol=0)


@pytest.mark.parametrize("heads", [1, 3, 4, -2])
def test_head_counts_that_break_grouping_are_refused_and_change_nothing(heads):
    model = _model()
    state = _state(model)
    with pytest.raises(ValueError, match="share 2 key/value heads, 2 query heads each, so remove a multiple of 2"):
        structured.prune_attention_heads(model, heads)
    assert _unchanged(model, state)


def test_bad_importance_is_refused_and_changes_nothing():
    model = _model()
    state = _state(model)
    with pytest.raises(ValueError, match="needs calibration batches"):
        structured.prune_mlp_channels(model, 0.25, importance="taylor")
    with pytest.raises(ValueError, match="activation importance needs calibration batches"):
        structured.prune_attention_heads(model, 2, importance="activation", calibration=[])
    with pytest.raises(ValueError, match="importance must be one of"):
        structured.prune_attention_heads(model, 2, importance="random")
    assert _unchanged(model, state)
