"""Sensitivity scans that restore the weights, prune-and-recover rounds that reach each sparsity and
recover, and a sparsity schedule that would go backwards refused."""

import pytest
import torch

from labkit.prune import masks, recover
from labkit.train import TrainConfig
from tests.prune_helpers import IDS, _blocks, _logits, _model, _state, _unchanged


def test_sensitivity_scores_each_group_and_restores_the_weights():
    model = _model()
    state = _state(model)
    groups = recover.groups_by(masks.prunable_weights(model), "layer")
    assert list(groups) == ["layer 0", "layer 1"] and len(groups["layer 0"]) == 7
    seen = {}

    def score(m):
        seen[len(seen)] = masks.overall_sparsity(masks.sparsity_report(m))
        return float(_logits(m, IDS).abs().sum())

    result = recover.sensitivity(model, score, groups, 0.5)
    assert set(result) == set(groups)
    assert all(s == pytest.approx(0.25, abs=1e-3) for s in seen.values())  # one of two layers at 50%
    assert _unchanged(model, state)
    kinds = recover.groups_by(masks.prunable_weights(model), "kind")
    assert set(kinds) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_prune_and_recover_rounds_reach_each_sparsity_and_recover():
    model = _model()
    texts_ids = IDS

    def score(m):
        with torch.no_grad():
            return m(input_ids=texts_ids, labels=texts_ids).loss.item()

    rounds = recover.prune_and_recover(
        model, _blocks(12), [0.3, 0.6], TrainConfig(steps=3, lr=1e-2, progress=False), score=score
    )
    assert [r["sparsity"] for r in rounds] == pytest.approx([0.3, 0.6], abs=1e-3)
    assert all(len(r["history"]) == 3 for r in rounds)
    assert all(r["recovered"] < r["pruned"] for r in rounds)


def test_recovery_refuses_decreasing_sparsity():
    with pytest.raises(ValueError, match="must not decrease"):
        recover.prune_and_recover(_model(), _blocks(), [0.5, 0.3], TrainConfig(steps=1), score=lambda m: 0.0)
