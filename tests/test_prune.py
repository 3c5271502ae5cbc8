"""Pruning: exact sparsity, parity with torch.nn.utils.prune, the 2:4 pattern, masks that survive saving and
fine-tuning, structured models that run, save and reload, sensitivity, recovery, and refusals that change nothing."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import prune as torch_prune

from labkit import prune
from labkit.models import load_model, save_model, tiny_llama
from labkit.train import TrainConfig
from tests.numerics import FLOAT64
from tests.permissions import UMASK_CASES, modes, umask


def _model(**kwargs):
    return tiny_llama(vocab_size=128, num_heads=4, num_kv_heads=2, **kwargs)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model, state):
    return all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


# ----------------------------------------------------------------------------- unstructured


@settings(max_examples=20, deadline=None)
@given(sparsity=st.floats(0, 0.99), scope=st.sampled_from(prune.SCOPES))
def test_requested_sparsity_is_exact_counting_the_zeros(sparsity, scope):
    model = _model()
    weights = prune.prunable_weights(model)
    prune.magnitude_prune(model, sparsity, scope=scope)
    report = prune.sparsity_report(model)
    if scope == "layer":
        assert [r.zeros for r in report] == [round(sparsity * w.numel()) for w in weights.values()]
    else:
        assert sum(r.zeros for r in report) == round(sparsity * sum(w.numel() for w in weights.values()))


def test_pruned_weights_are_the_smallest():
    model = _model()
    before = {n: w.detach().abs().clone() for n, w in prune.prunable_weights(model).items()}
    pruning = prune.magnitude_prune(model, 0.4, scope="global")
    dropped = torch.cat([before[n][~m] for n, m in pruning.masks.items()])
    kept = torch.cat([before[n][m] for n, m in pruning.masks.items()])
    assert dropped.max() <= kept.min()


@pytest.mark.parametrize("scope", prune.SCOPES)
def test_masks_equal_torch_nn_utils_prune(scope):
    ours, theirs = _model(), _model()
    masks = prune.magnitude_prune(ours, 0.6, scope=scope).masks
    modules = dict(theirs.named_modules())
    targets = [(modules[name], "weight") for name in masks]
    if scope == "global":
        torch_prune.global_unstructured(targets, pruning_method=torch_prune.L1Unstructured, amount=0.6)
    else:
        for module, name in targets:
            torch_prune.l1_unstructured(module, name, amount=0.6)
    for name, mask in masks.items():
        assert torch.equal(mask, modules[name].weight_mask.bool()), name
    torch.testing.assert_close(_logits(ours, IDS), _logits(theirs, IDS), rtol=0, atol=0)


def test_lm_head_and_embeddings_are_excluded_by_default_and_tied_weights_counted_once():
    model = _model()  # ties lm_head to embed_tokens
    default = prune.prunable_weights(model)
    assert "lm_head" not in default and "model.embed_tokens" not in default
    assert len(default) == 2 * 7
    with_embeddings = prune.prunable_weights(model, include_embeddings=True, include_lm_head=True)
    assert len(with_embeddings) == len(default) + 1  # one shared matrix
    prune.magnitude_prune(model, 0.5, include_embeddings=True)
    assert torch.equal(model.lm_head.weight == 0, model.model.embed_tokens.weight == 0)
    assert (model.lm_head.weight == 0).float().mean().item() == pytest.approx(0.5, abs=1e-3)


def test_nm_pattern_holds_in_every_group():
    model = _model()
    prune.nm_prune(model, 2, 4)
    for name, w in prune.prunable_weights(model).items():
        groups = (w != 0).reshape(w.shape[0], -1, 4).sum(-1)
        assert (groups == 2).all(), name
        assert prune.is_nm_sparse(w, 2, 4)
    assert prune.overall_sparsity(prune.sparsity_report(model)) == 0.5
    assert not prune.is_nm_sparse(torch.ones(4, 8), 2, 4)


def test_nm_keeps_the_largest_of_each_group():
    w = torch.tensor([[0.1, -4.0, 3.0, 0.2, 1.0, 2.0, -3.0, 0.5]])
    mask = prune.nm_masks({"w": w}, 2, 4)["w"]
    assert mask.tolist() == [[False, True, True, False, False, True, True, False]]


def test_masks_survive_save_and_load(tmp_path):
    model = _model()
    masks = prune.magnitude_prune(model, 0.5, scope="global").masks
    path = prune.save_masks(masks, tmp_path / "masks.safetensors")
    loaded = prune.load_masks(path)
    assert loaded.keys() == masks.keys() and all(torch.equal(loaded[k], masks[k]) for k in masks)
    fresh = _model()
    prune.apply_masks(fresh, loaded)
    torch.testing.assert_close(_logits(fresh, IDS), _logits(model, IDS), rtol=0, atol=0)


def test_pruned_zeros_survive_save_pretrained(tmp_path):
    model = _model()
    prune.magnitude_prune(model, 0.7, scope="global")
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    assert [r.zeros for r in prune.sparsity_report(reloaded)] == [r.zeros for r in prune.sparsity_report(model)]


def _blocks(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(x[:, :-1], x[:, 1:]) for x in torch.randint(0, 128, (n, 2, 17), generator=g)]


def test_fine_tuning_keeps_the_zeros_while_masks_are_active():
    from labkit.train import fit

    model = _model()
    pruning = prune.magnitude_prune(model, 0.5)
    before = _state(model)
    fit(model, _blocks(), TrainConfig(steps=4, lr=1e-2, progress=False))
    assert not _unchanged(model, before)  # it trained
    for name, w in prune.prunable_weights(model).items():
        assert (w[~pruning.masks[name]] == 0).all(), name
    pruning.remove()
    assert not pruning.active
    fit(model, _blocks(), TrainConfig(steps=2, lr=1e-2, progress=False))
    assert prune.overall_sparsity(prune.sparsity_report(model)) < 0.5  # unmasked weights grow back


def test_sensitivity_scores_each_group_and_restores_the_weights():
    model = _model()
    state = _state(model)
    groups = prune.groups_by(prune.prunable_weights(model), "layer")
    assert list(groups) == ["layer 0", "layer 1"] and len(groups["layer 0"]) == 7
    seen = {}

    def score(m):
        seen[len(seen)] = prune.overall_sparsity(prune.sparsity_report(m))
        return float(_logits(m, IDS).abs().sum())

    result = prune.sensitivity(model, score, groups, 0.5)
    assert set(result) == set(groups)
    assert all(s == pytest.approx(0.25, abs=1e-3) for s in seen.values())  # one of two layers at 50%
    assert _unchanged(model, state)
    kinds = prune.groups_by(prune.prunable_weights(model), "kind")
    assert set(kinds) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_prune_and_recover_rounds_reach_each_sparsity_and_recover():
    model = _model()
    texts_ids = IDS

    def score(m):
        with torch.no_grad():
            return m(input_ids=texts_ids, labels=texts_ids).loss.item()

    rounds = prune.prune_and_recover(
        model, _blocks(12), [0.3, 0.6], TrainConfig(steps=3, lr=1e-2, progress=False), score=score
    )
    assert [r["sparsity"] for r in rounds] == pytest.approx([0.3, 0.6], abs=1e-3)
    assert all(len(r["history"]) == 3 for r in rounds)
    assert all(r["recovered"] < r["pruned"] for r in rounds)


# ----------------------------------------------------------------------------- structured


def test_mlp_channel_pruning_gives_a_smaller_model_that_generates_saves_and_reloads(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _model()
    before = prune.model_shapes(model)
    shapes = prune.prune_mlp_channels(model, 0.25)
    assert shapes["mlp_channels"] == 96 and model.config.intermediate_size == 96
    assert shapes["params"] == before["params"] - 2 * 3 * 64 * 32
    out = model.generate(input_ids=IDS[:1, :4], max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 9)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert prune.model_shapes(reloaded) == shapes
    torch.testing.assert_close(_logits(reloaded, IDS), _logits(model, IDS), rtol=0, atol=0)


def test_mlp_channel_pruning_keeps_the_channels_with_the_largest_norms():
    model, reference = _model(), _model()
    prune.prune_mlp_channels(model, 0.5)
    mlp = reference.model.layers[0].mlp
    norm = mlp.gate_proj.weight.pow(2).sum(1) + mlp.up_proj.weight.pow(2).sum(1) + mlp.down_proj.weight.pow(2).sum(0)
    keep = norm.topk(64).indices.sort().values
    torch.testing.assert_close(model.model.layers[0].mlp.up_proj.weight, mlp.up_proj.weight[keep])


def test_taylor_importance_uses_calibration_gradients_and_clears_them():
    model = _model()
    shapes = prune.prune_mlp_channels(model, 0.25, importance="taylor", calibration=[IDS])
    assert shapes["mlp_channels"] == 96
    assert all(p.grad is None for p in model.parameters())
    heads = prune.prune_attention_heads(_model(), 2, importance="taylor", calibration=[IDS])
    assert heads["heads"] == 2


def test_removing_a_head_equals_zeroing_its_output_columns(tmp_path):
    model, reference = _model(), _model()
    state = reference.state_dict()
    shapes = prune.prune_attention_heads(model, 2)  # 4 heads in 2 key/value groups: one from each
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
    prune.prune_mlp_channels(model, 0.1)
    shapes = prune.prune_attention_heads(model, 3)
    assert (shapes["mlp_channels"], shapes["heads"], shapes["kv_heads"]) == (1376, 6, 3)
    reloaded, _ = load_model(str(save_model(model, tokenizer, tmp_path / "pruned")))
    assert prune.model_shapes(reloaded) == shapes
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    torch.testing.assert_close(_logits(reloaded, ids), _logits(model, ids), rtol=0, atol=0)


@pytest.mark.model
def test_global_sparsity_on_the_default_model_is_exact(default_model):
    model = copy.deepcopy(default_model[0])
    weights = prune.prunable_weights(model)
    n = sum(w.numel() for w in weights.values())
    already = sum(int((w == 0).sum()) for w in weights.values())  # the GGUF weights hold a few exact zeros
    assert already < 0.001 * n
    prune.magnitude_prune(model, 0.3, scope="global", permanent=True)
    assert sum(r.zeros for r in prune.sparsity_report(model)) == round(0.3 * n)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("sparsity", [-0.1, 1.0, 1.5, float("nan"), "0.5"])
def test_sparsity_outside_the_range_is_refused_and_changes_nothing(sparsity):
    model = _model()
    state = _state(model)
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
        prune.magnitude_prune(model, sparsity)
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
        prune.prune_mlp_channels(model, sparsity)
    assert _unchanged(model, state)


@pytest.mark.parametrize("n, m, match", [(4, 2, "0 < n <= m"), (0, 4, "0 < n <= m"), (2, 5, "5 must divide")])
def test_bad_nm_is_refused_and_changes_nothing(n, m, match):
    model = _model()
    state = _state(model)
    with pytest.raises(ValueError, match=match):
        prune.nm_prune(model, n, m)
    assert _unchanged(model, state)


def test_modules_that_cannot_be_pruned_are_named():
    model = _model()
    with pytest.raises(TypeError, match=r"only nn.Linear and nn.Embedding.*LlamaRMSNorm"):
        prune.magnitude_prune(model, 0.5, modules=["model.norm"])
    with pytest.raises(ValueError, match=r"no module named \['model.layers.9.mlp'\].*q_proj"):
        prune.magnitude_prune(model, 0.5, modules=["model.layers.9.mlp"])
    with pytest.raises(ValueError, match="scope must be one of"):
        prune.magnitude_prune(model, 0.5, scope="row")
    with pytest.raises(TypeError, match="Llama-style"):
        prune.prune_mlp_channels(nn.Sequential(nn.Linear(4, 4)), 0.5)


@pytest.mark.parametrize("heads", [1, 3, 4, -2])
def test_head_counts_that_break_grouping_are_refused_and_change_nothing(heads):
    model = _model()
    state = _state(model)
    with pytest.raises(ValueError, match="share 2 key/value heads, 2 query heads each, so remove a multiple of 2"):
        prune.prune_attention_heads(model, heads)
    assert _unchanged(model, state)


def test_bad_importance_is_refused_and_changes_nothing():
    model = _model()
    state = _state(model)
    with pytest.raises(ValueError, match="needs calibration batches"):
        prune.prune_mlp_channels(model, 0.25, importance="taylor")
    with pytest.raises(ValueError, match="importance must be one of"):
        prune.prune_attention_heads(model, 2, importance="random")
    assert _unchanged(model, state)


def test_masks_that_do_not_fit_are_refused_and_change_nothing():
    model = _model()
    state = _state(model)
    good = prune.magnitude_masks(prune.prunable_weights(model), 0.5)
    bad_shape = dict(good) | {"model.layers.1.mlp.up_proj": torch.ones(3, 3, dtype=torch.bool)}
    with pytest.raises(ValueError, match=r"has shape \(3, 3\), the weight \(128, 64\)"):
        prune.apply_masks(model, bad_shape)
    with pytest.raises(ValueError, match="no module with a weight"):
        prune.apply_masks(model, dict(good) | {"model.layers.7.foo": torch.ones(1, dtype=torch.bool)})
    assert _unchanged(model, state)


def test_recovery_refuses_decreasing_sparsity():
    with pytest.raises(ValueError, match="must not decrease"):
        prune.prune_and_recover(_model(), _blocks(), [0.5, 0.3], TrainConfig(steps=1), score=lambda m: 0.0)


# ----------------------------------------------------------------------------- 2:4 kernels


@pytest.mark.parametrize("cusparselt, backend", [(True, "cusparselt"), (False, "cutlass")])
def test_2_4_kernels_fall_back_to_cutlass_without_cusparselt(monkeypatch, cusparselt, backend):
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    monkeypatch.setattr(torch.backends.cusparselt, "is_available", lambda: cusparselt)
    assert prune.semi_structured_backend() == backend
    chosen = []
    for cls in (SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS):
        monkeypatch.setattr(cls, "from_dense", classmethod(lambda c, w: chosen.append(c) or w))
    prune._semi_structured(torch.zeros(4, 4))
    assert chosen == [
        {"cusparselt": SparseSemiStructuredTensorCUSPARSELT, "cutlass": SparseSemiStructuredTensorCUTLASS}[backend]
    ]


def test_semi_structured_kernels_report_why_they_cannot_run_here():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the speed-up test runs instead")
    assert "NVIDIA GPUs only" in prune.semi_structured_support("cpu")
    with pytest.raises(RuntimeError, match="NVIDIA GPUs only"):
        prune.semi_structured_speedup(128, 128, 64, device="cpu")
    with pytest.raises(RuntimeError, match="NVIDIA GPUs only"):
        prune.to_semi_structured(_model())


@pytest.mark.skipif(
    not torch.cuda.is_available() or prune.semi_structured_support("cuda") is not None,
    reason="needs an Ampere-or-newer NVIDIA GPU",
)
def test_semi_structured_linear_matches_dense():
    result = prune.semi_structured_speedup(1024, 1024, 256, repeats=3)
    assert result["max_abs_error"] < 0.5 and result["speedup"] > 0


@pytest.mark.skipif(
    not torch.cuda.is_available() or prune.semi_structured_support("cuda") is not None,
    reason="needs an Ampere-or-newer NVIDIA GPU",
)
def test_semi_structured_model_matches_its_dense_2_4_twin():
    model = tiny_llama(vocab_size=128, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)
    model = model.half().cuda()
    with pytest.raises(ValueError, match="not 2:4-sparse"):
        prune.to_semi_structured(model)
    prune.nm_prune(model, 2, 4, permanent=True)
    ids = IDS.cuda()
    expected = _logits(model, ids)
    assert prune.to_semi_structured(model) == 14
    torch.testing.assert_close(_logits(model, ids), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("mask, file_mode, dir_mode", UMASK_CASES)
def test_saved_masks_get_the_modes_the_umask_gives(tmp_path, mask, file_mode, dir_mode):
    masks = prune.magnitude_prune(_model(), 0.5).masks
    with umask(mask):
        prune.save_masks(masks, tmp_path / "out" / "masks.safetensors")
    assert modes(tmp_path / "out") == {".": dir_mode, "masks.safetensors": file_mode}
