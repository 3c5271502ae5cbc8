"""Which weights matter and getting the quality back: per-group sensitivity scans, and gradual
magnitude pruning with fine-tuning (labkit.train) between the rounds, the masks held."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from labkit.checkpoint import DataStream
from labkit.prune.masks import (
    apply_masks,
    check_sparsity,
    magnitude_masks,
    magnitude_prune,
    overall_sparsity,
    prunable_weights,
    sparsity_report,
)
from labkit.train import TrainConfig, fit

# ----------------------------------------------------------------------------- sensitivity


def groups_by(names: Iterable[str], by: str) -> dict[str, list[str]]:
    """Group module names by decoder layer ("layer 7") or by kind ("q_proj"), for sensitivity scans."""
    if by not in ("layer", "kind"):
        raise ValueError(f"group by 'layer' or 'kind', got {by!r}")
    groups: dict[str, list[str]] = {}
    for name in names:
        found = re.search(r"\.(\d+)\.", name)
        key = (f"layer {found.group(1)}" if found else name) if by == "layer" else name.rsplit(".", 1)[-1]
        groups.setdefault(key, []).append(name)
    return groups


def sensitivity(
    model: nn.Module,
    score: Callable[[nn.Module], float],
    groups: dict[str, list[str]],
    sparsity: float,
) -> dict[str, float]:
    """score(model) after pruning each group alone to `sparsity` per layer; the weights are restored after each."""
    check_sparsity(sparsity)
    weights = {name: w for names in groups.values() for name, w in prunable_weights(model, modules=names).items()}
    results = {}
    for group, names in groups.items():
        chosen = {n: weights[n] for n in names if n in weights}
        saved = {n: w.detach().clone() for n, w in chosen.items()}
        try:
            apply_masks(model, magnitude_masks(chosen, sparsity), permanent=True)
            results[group] = score(model)
        finally:
            with torch.no_grad():
                for n, w in chosen.items():
                    w.copy_(saved[n])
    return results


# ----------------------------------------------------------------------------- recovery


def prune_and_recover(
    model: nn.Module,
    loader: Iterable,
    sparsities: Sequence[float],
    train: TrainConfig,
    *,
    score: Callable[[nn.Module], float],
    scope: str = "global",
    **selection: Any,
) -> list[dict[str, Any]]:
    """Gradual magnitude pruning: for each sparsity in turn, prune, score, fine-tune with the masks held, score.

    `train` configures each round's fine-tune; the rounds draw successive batches from one stream
    over `loader`, epoch after epoch. Returns one record per round (sparsity counted from the zeros).
    """
    if list(sparsities) != sorted(sparsities):
        raise ValueError(f"sparsities must not decrease from round to round, got {list(sparsities)}")
    if train.checkpoint_dir:
        raise ValueError("prune_and_recover runs several short fits: leave train.checkpoint_dir unset")
    for s in sparsities:
        check_sparsity(s)
    stream = DataStream(loader)
    batches = iter(stream.__next__, None)  # endless: each round continues where the last stopped
    rounds = []
    for s in sparsities:
        pruning = magnitude_prune(model, s, scope=scope, **selection)
        pruned = score(model)
        try:
            history = fit(model, batches, train)
        finally:
            pruning.remove()
        model.eval()
        rounds.append(
            {
                "target": s,
                "sparsity": overall_sparsity(sparsity_report(model, **selection)),
                "pruned": pruned,
                "recovered": score(model),
                "history": history,
            }
        )
    return rounds
