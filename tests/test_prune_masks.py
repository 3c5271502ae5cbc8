"""Magnitude masks: exact sparsity counted from the zeros, parity with torch.nn.utils.prune, the 2:4 pattern,
masks that survive saving and fine-tuning, and refusals that change nothing."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import prune as torch_prune

from labkit.prune import masks, structured
from labkit.train import TrainConfig
from tests.permissions import UMASK_CASES, modes, umask
from tests.prune_helpers import IDS, _blocks, _logits, _model, _state, _unchanged

# ----------------------------------------------------------------------------- unstructured


@settings(max_examples=20, deadline=None)
@given(sparsity=st.floats(0, 0.99), scope=st.sampled_from(masks.SCOPES))
def test_requested_sparsity_is_exact_counting_the_zeros(sparsity, scope):
    model = _model()
    weights = masks.prunable_weights(model)
    masks.magnitude_prune(model, sparsity, scope=scope)
    report = masks.sparsity_report(model)
    if scope == "layer":
        assert [r.zeros for r in report] == [round(sparsity * w.numel()) for w in weights.values()]
    else:
        assert sum(r.zeros for r in report) == round(sparsity * sum(w.numel() for w in weights.values()))


def test_pruned_weights_are_the_smallest():
    model = _model()
    before = {n: w.detach().abs().clone() for n, w in masks.prunable_weights(model).items()}
    pruning = masks.magnitude_prune(model, 0.4, scope="global")
    dropped = torch.cat([before[n][~m] for n, m in pruning.masks.items()])
    kept = torch.cat([before[n][m] for n, m in pruning.masks.items()])
    assert dropped.max() <= kept.min()


@pytest.mark.parametrize("scope", masks.SCOPES)
def test_masks_equal_torch_nn_utils_prune(scope):
    ours, theirs = _model(), _model()
    keep = masks.magnitude_prune(ours, 0.6, scope=scope).masks
    modules = dict(theirs.named_modules())
    targets = [(modules[name], "weight") for name in keep]
    if scope == "global":
        torch_prune.global_unstructured(targets, pruning_method=torch_prune.L1Unstructured, amount=0.6)
    else:
        for module, name in targets:
            torch_prune.l1_unstructured(module, name, amount=0.6)
    for name, mask in keep.items():
        assert torch.equal(mask, modules[name].weight_mask.bool()), name
    torch.testing.assert_close(_logits(ours, IDS), _logits(theirs, IDS), rtol=0, atol=0)


def test_lm_head_and_embeddings_are_excluded_by_default_and_tied_weights_counted_once():
    model = _model()  # ties lm_head to embed_tokens
    default = masks.prunable_weights(model)
    assert "lm_head" not in default and "model.embed_tokens" not in default
    assert len(default) == 2 * 7
    with_embeddings = masks.prunable_weights(model, include_embeddings=True, include_lm_head=True)
    assert len(with_embeddings) == len(default) + 1  # one shared matrix
    masks.magnitude_prune(model, 0.5, include_embeddings=True)
    assert torch.equal(model.lm_head.weight == 0, model.model.embed_tokens.weight == 0)
    assert (model.lm_head.weight == 0).float().mean().item() == pytest.approx(0.5, abs=1e-3)


def test_nm_pattern_holds_in_every_group():
    model = _model()
    masks.nm_prune(model, 2, 4)
    for name, w in masks.prunable_weights(model).items():
        groups = (w != 0).reshape(w.shape[0], -1, 4).sum(-1)
        assert (groups == 2).all(), name
        assert masks.is_nm_sparse(w, 2, 4)
    assert masks.overall_sparsity(masks.sparsity_report(model)) == 0.5
    assert not masks.is_nm_sparse(torch.ones(4, 8), 2, 4)


def test_nm_keeps_the_largest_of_each_group():
    w = torch.tensor([[0.1, -4.0, 3.0, 0.2, 1.0, 2.0, -3.0, 0.5]])
    mask = masks.nm_masks({"w": w}, 2, 4)["w"]
    assert mask.tolist() == [[False, True, True, False, False, True, True, False]]


@settings(max_examples=80, deadline=None)
@given(m=st.integers(1, 8), rows=st.integers(1, 6), groups=st.integers(1, 5), data=st.data())
def test_nm_masks_keep_exactly_n_of_every_m_and_the_largest(m, rows, groups, data):
    n = data.draw(st.integers(1, m))
    order = torch.randperm(rows * groups * m, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 999))))
    w = (order.double() + 1).reshape(rows, groups * m) * torch.where(order.reshape(rows, -1) % 2 == 0, 1.0, -1.0)
    keep = masks.nm_masks({"w": w}, n, m)["w"].reshape(rows, groups, m)
    assert (keep.sum(-1) == n).all()  # exactly n of every m
    size = w.abs().reshape(rows, groups, m)  # distinct magnitudes: no ties to break
    smallest_kept = size.masked_fill(~keep, float("inf")).amin(-1)
    largest_dropped = size.masked_fill(keep, 0.0).amax(-1)
    assert (smallest_kept > largest_dropped).all()


def test_masks_survive_save_and_load(tmp_path):
    model = _model()
    keep = masks.magnitude_prune(model, 0.5, scope="global").masks
    path = masks.save_masks(keep, tmp_path / "masks.safetensors")
    loaded = masks.load_masks(path)
    assert loaded.keys() == keep.keys() and all(torch.equal(loaded[k], keep[k]) for k in keep)
    fresh = _model()
    masks.apply_masks(fresh, loaded)
    torch.testing.assert_close(_logits(fresh, IDS), _logits(model, IDS), rtol=0, atol=0)


def test_pruned_zeros_survive_save_pretrained(tmp_path):
    model = _model()
    masks.magnitude_prune(model, 0.7, scope="global")
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    assert [r.zeros for r in masks.sparsity_report(reloaded)] == [r.zeros for r in masks.sparsity_report(model)]


def test_fine_tuning_keeps_the_zeros_while_masks_are_active():
    from labkit.train import fit

    model = _model()
    pruning = masks.magnitude_prune(model, 0.5)
    before = _state(model)
    fit(model, _blocks(), TrainConfig(steps=4, lr=1e-2, progress=False))
    assert not _unchanged(model, before)  # it trained
    for name, w in masks.prunable_weights(model).items():
        assert (w[~pruning.masks[name]] == 0).all(), name
    pruning.remove()
    assert not pruning.active
    fit(model, _blocks(), TrainConfig(steps=2, lr=1e-2, progress=False))
    assert masks.overall_sparsity(masks.sparsity_report(model)) < 0.5  # unmasked weights grow back


@pytest.mark.model
def test_global_sparsity_on_the_default_model_is_exact(default_model):
    model = copy.deepcopy(default_model[0])
    weights = masks.prunable_weights(model)
    n = sum(w.numel() for w in weights.values())
    already = sum(int((w == 0).sum()) for w in weights.values())  # the GGUF weights hold a few exact zeros
    assert already < 0.001 * n
    masks.magnitude_prune(model, 0.3, scope="global", permanent=True)
    assert sum(r.zeros for r in masks.sparsity_report(model)) == round(0.3 * n)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("sparsity", [-0.1, 1.0, 1.5, float("nan"), "0.5"])
def test_sparsity_outside_the_range_is_refused_and_changes_nothing(sparsity):
    model = _model()
    state = _state(model)
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
        masks.magnitude_prune(model, sparsity)
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
        structured.prune_mlp_channels(model, sparsity)
    assert _unchanged(model, state)


@pytest.mark.parametrize("n, m, match", [(4, 2, "0 < n <= m"), (0, 4, "0 < n <= m"), (2, 5, "5 must divide")])
def test_bad_nm_is_refused_and_changes_nothing(n, m, match):
    model = _model()
    state = _state(model)
    with pytest.raises(ValueError, match=match):
        masks.nm_prune(model, n, m)
    assert _unchanged(model, state)


def test_modules_that_cannot_be_pruned_are_named():
    model = _model()
    with pytest.raises(TypeError, match=r"only nn.Linear and nn.Embedding.*LlamaRMSNorm"):
        masks.magnitude_prune(model, 0.5, modules=["model.norm"])
    with pytest.raises(ValueError, match=r"no module named \['model.layers.9.mlp'\].*q_proj"):
        masks.magnitude_prune(model, 0.5, modules=["model.layers.9.mlp"])
    with pytest.raises(ValueError, match="scope must be one of"):
        masks.magnitude_prune(model, 0.5, scope="row")
    with pytest.raises(TypeError, match="Llama-style"):
        structured.prune_mlp_channels(nn.Sequential(nn.Linear(4, 4)), 0.5)


def test_masks_that_do_not_fit_are_refused_and_change_nothing():
    model = _model()
    state = _state(model)
    good = masks.magnitude_masks(masks.prunable_weights(model), 0.5)
    bad_shape = dict(good) | {"model.layers.1.mlp.up_proj": torch.ones(3, 3, dtype=torch.bool)}
    with pytest.raises(ValueError, match=r"has shape \(3, 3\), the weight \(128, 64\)"):
        masks.apply_masks(model, bad_shape)
    with pytest.raises(ValueError, match="no module with a weight"):
        masks.apply_masks(model, dict(good) | {"model.layers.7.foo": torch.ones(1, dtype=torch.bool)})
    assert _unchanged(model, state)


@pytest.mark.parametrize("mask, file_mode, dir_mode", UMASK_CASES)
def test_saved_masks_get_the_modes_the_umask_gives(tmp_path, mask, file_mode, dir_mode):
    keep = masks.magnitude_prune(_model(), 0.5).masks
    with umask(mask):
        masks.save_masks(keep, tmp_path / "out" / "masks.safetensors")
    assert modes(tmp_path / "out") == {".": dir_mode, "masks.safetensors": file_mode}
