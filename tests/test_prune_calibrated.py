"""Wanda and SparseGPT (labkit.prune.calibrated): masks equal to a direct computation, SparseGPT equal to a
naive OBS loop with explicit inverses, SparseGPT ahead of Wanda ahead of magnitude on held-out output error,
the block-by-block sweep wired as GPTQ's, and bad input refused before any weight changes."""

from __future__ import annotations

import pytest
import torch

from labkit.calibration import input_hessian
from labkit.models import tiny_llama
from labkit.prune import calibrated, masks
from tests.numerics import FLOAT64
from tests.prune_helpers import _logits, _state, _unchanged


def _inputs(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Correlated inputs whose features differ in scale by 10x, as real activations do: a fixed mixing of
    dim / 2 factors plus noise, so every seed draws other samples from the same distribution."""
    mix = torch.randn(dim // 2, dim, generator=torch.Generator().manual_seed(dim), dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim // 2, generator=g, dtype=torch.float64) @ mix
    x += 0.3 * torch.randn(n, dim, generator=g, dtype=torch.float64)
    return x * torch.logspace(0, 1, dim, dtype=torch.float64)


def _hessian(x: torch.Tensor) -> torch.Tensor:
    return 2 * x.T @ x / x.shape[0]


WEIGHT = torch.randn(6, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def test_wanda_mask_drops_the_smallest_weight_times_input_norm_in_each_row():
    x = _inputs(200, 16)
    keep = calibrated.wanda_mask(WEIGHT, _hessian(x), 0.25)
    metric = WEIGHT.abs() * x.norm(dim=0)
    for row, kept in zip(metric, keep):
        dropped = sorted(range(16), key=lambda j: row[j].item())[:4]
        assert sorted(j for j in range(16) if not kept[j]) == sorted(dropped)


def test_wanda_2_4_mask_keeps_the_two_largest_scores_of_each_group():
    x = _inputs(200, 16)
    keep = calibrated.wanda_mask(WEIGHT, _hessian(x), (2, 4))
    metric = WEIGHT.abs() * x.norm(dim=0)
    for r in range(6):
        for g0 in range(0, 16, 4):
            best = sorted(range(g0, g0 + 4), key=lambda j: -metric[r, j].item())[:2]
            assert [j for j in range(g0, g0 + 4) if keep[r, j]] == sorted(best)
    assert masks.is_nm_sparse(WEIGHT * keep, 2, 4)


def _naive_sparsegpt(w: torch.Tensor, h: torch.Tensor, share, nm, damp: float, block: int) -> torch.Tensor:
    """Column by column with the inverse of H over the columns not yet visited, recomputed each time."""
    w, cols = w.clone(), w.shape[1]
    h = h + damp * h.diagonal().mean() * torch.eye(cols, dtype=h.dtype)
    pivot = torch.stack([torch.linalg.inv(h[j:, j:])[0, 0] for j in range(cols)])  # [H⁻¹]_jj, earlier ones gone
    keep = torch.ones_like(w, dtype=torch.bool)
    for j in range(cols):
        if share is not None and j % block == 0:
            saliency = w[:, j : j + block] ** 2 / pivot[j : j + block]
            order = saliency.flatten().argsort()[: round(share * saliency.numel())]
            block_keep = torch.ones(saliency.numel(), dtype=torch.bool)
            block_keep[order] = False
            keep[:, j : j + block] = block_keep.view_as(saliency)
        if nm and j % nm[1] == 0:
            saliency = w[:, j : j + nm[1]] ** 2 / pivot[j : j + nm[1]]
            keep[:, j : j + nm[1]] = False
            for r in range(w.shape[0]):
                keep[r, j + saliency[r].argsort(descending=True)[: nm[0]]] = True
        inverse = torch.linalg.inv(h[j:, j:])
        error = w[:, j] * ~keep[:, j]
        w[:, j:] -= error[:, None] * inverse[0][None, :] / inverse[0, 0]
        w[:, j] = w[:, j] * keep[:, j]
    return w


@pytest.mark.parametrize(("sparsity", "block"), [(0.5, 16), (0.5, 4), (0.3, 8), ((2, 4), 8), ((1, 4), 4)])
def test_sparsegpt_equals_a_naive_obs_loop_with_explicit_inverses(sparsity, block):
    h = _hessian(_inputs(300, 16))
    share, nm = (None, sparsity) if isinstance(sparsity, tuple) else (sparsity, None)
    pruned, keep = calibrated.sparsegpt_weight(WEIGHT, h, sparsity, damp=0.01, block_size=block)
    expected = _naive_sparsegpt(WEIGHT, h, share, nm, 0.01, block)
    torch.testing.assert_close(pruned, expected, **FLOAT64)
    assert torch.equal(keep, expected != 0)
    assert (pruned[~keep] == 0).all()


def test_sparsegpt_beats_wanda_beats_magnitude_on_held_out_output_error():
    w = WEIGHT.repeat(4, 4) + 0.1 * torch.randn(24, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    fit, held_out = _inputs(2000, 64, seed=3), _inputs(2000, 64, seed=4)

    def error(pruned: torch.Tensor) -> float:
        return ((held_out @ (w - pruned).T).norm() / (held_out @ w.T).norm()).item()

    magnitude = w * masks.magnitude_masks({"w": w}, 0.5)["w"]
    wanda = w * calibrated.wanda_mask(w, _hessian(fit), 0.5)
    sparsegpt, _ = calibrated.sparsegpt_weight(w, _hessian(fit), 0.5)
    assert error(sparsegpt) < error(wanda) < error(magnitude)


@pytest.mark.model
def test_on_the_default_model_sparsegpt_beats_wanda_beats_magnitude_on_a_held_out_layer_error(default_model):
    from labkit.calibration import calibration_blocks
    from labkit.data import load_corpus
    from labkit.quant.gptq import hessian_error

    model, tokenizer = default_model
    name = "model.layers.3.self_attn.q_proj"
    fit = calibration_blocks(tokenizer, load_corpus("wiki", "train")[:200], 8, 256)
    held = calibration_blocks(tokenizer, load_corpus("wiki", "validation")[:200], 8, 256)
    h_fit, h_held = input_hessian(model, name, fit), input_hessian(model, name, held)
    w = dict(model.named_modules())[name].weight.detach()
    errors = {
        "magnitude": hessian_error(w, w * masks.magnitude_masks({"w": w}, 0.5)["w"], h_held),
        "wanda": hessian_error(w, w * calibrated.wanda_mask(w, h_fit, 0.5), h_held),
        "sparsegpt": hessian_error(w, calibrated.sparsegpt_weight(w, h_fit, 0.5)[0], h_held),
    }
    assert errors["sparsegpt"] < errors["wanda"] < errors["magnitude"], errors


def _model():
    return tiny_llama(vocab_size=128, num_heads=4, num_kv_heads=2)


CALIBRATION = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
@pytest.mark.parametrize("sparsity", [0.5, (2, 4)])
def test_whole_model_pruning_gives_the_sparsity_asked_and_holds_its_masks(method, sparsity):
    model = _model()
    pruning = calibrated.calibrated_prune(model, CALIBRATION, sparsity, method=method, progress=False)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    assert set(pruning.masks) == set(linears) and pruning.active
    for name, m in linears.items():
        if sparsity == (2, 4):
            assert masks.is_nm_sparse(m.weight, 2, 4), name
        else:
            assert (m.weight == 0).float().mean().item() == pytest.approx(0.5, abs=0.01), name
    pruning.remove()


def test_wanda_on_the_first_layers_uses_the_unpruned_inputs_and_later_ones_the_pruned():
    model, reference = _model(), _model()
    calibrated.calibrated_prune(model, CALIBRATION, 0.5, progress=False, permanent=True)
    first = "model.layers.0.self_attn.q_proj"
    h = input_hessian(reference, first, CALIBRATION)
    expected = calibrated.wanda_mask(dict(reference.named_modules())[first].weight, h, 0.5)
    assert torch.equal(dict(model.named_modules())[first].weight != 0, expected)
    later = "model.layers.1.mlp.down_proj"
    h_dense = input_hessian(reference, later, CALIBRATION)
    stale = calibrated.wanda_mask(dict(reference.named_modules())[later].weight, h_dense, 0.5)
    assert not torch.equal(dict(model.named_modules())[later].weight != 0, stale)


def test_sparsegpt_keeps_the_model_closer_to_dense_than_magnitude():
    dense, sparse, magnitude = _model(), _model(), _model()
    calibrated.calibrated_prune(sparse, CALIBRATION, 0.5, method="sparsegpt", progress=False, permanent=True)
    masks.magnitude_prune(magnitude, 0.5, permanent=True)  # every linear but the LM head: the decoder's
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(9))
    ref = _logits(dense, ids)
    assert (_logits(sparse, ids) - ref).norm() < (_logits(magnitude, ids) - ref).norm()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sparsity": 1.0}, "sparsity must be in"),
        ({"sparsity": (3, 2)}, "keeps n of every m"),
        ({"sparsity": (2, 5)}, "5 must divide the input width"),
        ({"calibration": CALIBRATION.float()}, "long tensor"),
        ({"calibration": CALIBRATION + 1000}, "calibration ids"),
        ({"batch_size": 0}, "batch_size"),
        ({"block_size": 6, "sparsity": (2, 4)}, "block_size"),
        ({"damp": 1.5}, "damp"),
        ({"method": "obs"}, "method must be one of"),
    ],
)
@pytest.mark.parametrize("method", calibrated.METHODS)
def test_bad_input_is_refused_before_any_weight_changes(kwargs, message, method):
    model = _model()
    state = _state(model)
    args = {"calibration": CALIBRATION, "sparsity": 0.5, "method": method, "progress": False} | kwargs
    with pytest.raises(ValueError, match=message):
        calibrated.calibrated_prune(model, **args)
    assert _unchanged(model, state)
