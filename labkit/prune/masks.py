"""Magnitude masks, the base of labkit.prune: which weights are pruned, keep-masks per layer, global or N:M,
masks applied and held through fine-tuning, saved and loaded, and sparsity counted from the real zeros.

Unstructured and N:M pruning zero weights in place and return a `Pruning` that holds the keep-masks;
while it is active, a gradient hook multiplies each pruned weight's gradient by its mask, so
fine-tuning (AdamW included: zero gradient, zero moments, decoupled decay of zero) leaves the zeros
at zero. `remove()` makes the pruning permanent: the zeros stay, the masks stop being enforced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save
from torch import nn

from labkit import fileio

SCOPES = ("layer", "global")


# ----------------------------------------------------------------------------- which weights


def prunable_weights(
    model: nn.Module,
    *,
    modules: Sequence[str] | None = None,
    include_embeddings: bool = False,
    include_lm_head: bool = False,
) -> dict[str, nn.Parameter]:
    """Weights that magnitude pruning acts on, by module name: every nn.Linear but the LM head by default.

    `modules` names the modules explicitly instead. Tied weights (SmolLM2's LM head is its embedding
    matrix) appear once, under the first name, so pruning one prunes both.
    """
    named = dict(model.named_modules())
    if modules is not None:
        missing = [m for m in modules if m not in named]
        if missing:
            sample = ", ".join(n for n, m in named.items() if isinstance(m, nn.Linear))
            raise ValueError(f"no module named {missing[:3]} in the model; prunable ones: {sample[:300]}...")
        wrong = [
            f"{m} ({type(named[m]).__name__})" for m in modules if not isinstance(named[m], (nn.Linear, nn.Embedding))
        ]
        if wrong:
            raise TypeError(f"only nn.Linear and nn.Embedding weights can be magnitude-pruned, not {wrong[:3]}")
        chosen = [(m, named[m]) for m in modules]
    else:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        chosen = [
            (n, m)
            for n, m in named.items()
            if (isinstance(m, nn.Linear) and (m is not head or include_lm_head))
            or (isinstance(m, nn.Embedding) and include_embeddings)
        ]
    weights: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for name, module in chosen:
        if id(module.weight) not in seen:
            seen.add(id(module.weight))
            weights[name] = module.weight
    if not weights:
        raise ValueError(f"{type(model).__name__} has no nn.Linear weights to prune with this selection")
    return weights


# ----------------------------------------------------------------------------- masks


def check_sparsity(sparsity: float) -> None:
    """Refuse a sparsity outside [0, 1): the share of weights set to zero."""
    if not isinstance(sparsity, (int, float)) or not 0 <= sparsity < 1:
        raise ValueError(f"sparsity must be in [0, 1) (the share of weights set to zero), got {sparsity!r}")


def drop_smallest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Keep-mask of a flat tensor that drops exactly its k smallest scores (as torch.nn.utils.prune does)."""
    keep = torch.ones(scores.numel(), dtype=torch.bool, device=scores.device)
    if k:
        keep[torch.topk(scores, k, largest=False, sorted=False).indices] = False
    return keep


def magnitude_masks(
    weights: dict[str, torch.Tensor], sparsity: float, *, scope: str = "layer"
) -> dict[str, torch.Tensor]:
    """Boolean keep-masks that zero the smallest |w|: round(sparsity·n) in each matrix, or across all of them.

    "layer" gives every matrix the same sparsity; "global" ranks all weights together, so matrices
    with small weights lose more.
    """
    check_sparsity(sparsity)
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    with torch.no_grad():
        if scope == "layer":
            return {
                name: drop_smallest(w.abs().flatten(), round(sparsity * w.numel())).view_as(w)
                for name, w in weights.items()
            }
        scores = torch.cat([w.detach().abs().flatten() for w in weights.values()])
        keep = drop_smallest(scores, round(sparsity * scores.numel()))
        del scores
        return {
            name: part.view_as(w)
            for (name, w), part in zip(weights.items(), keep.split([w.numel() for w in weights.values()]))
        }


def check_nm(n: int, m: int) -> None:
    """Refuse an N:M pattern unless 0 < n <= m."""
    if not (isinstance(n, int) and isinstance(m, int)) or not 0 < n <= m:
        raise ValueError(f"N:M pruning keeps n of every m weights: need 0 < n <= m, got n={n}, m={m}")


def check_nm_width(name: str, shape: Sequence[int], n: int, m: int) -> None:
    """Refuse a weight whose input width m does not divide into groups."""
    if len(shape) != 2 or shape[1] % m:
        raise ValueError(f"{name}: {m} must divide the input width for {n}:{m} groups, shape {tuple(shape)}")


def keep_top_n_of_m(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep-mask of the n highest scores in every m consecutive columns of each row."""
    groups = scores.reshape(scores.shape[0], -1, m)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.topk(n, dim=-1).indices, True)
    return keep.view_as(scores)


def nm_masks(weights: dict[str, torch.Tensor], n: int = 2, m: int = 4) -> dict[str, torch.Tensor]:
    """Keep-masks with the n largest |w| of every m consecutive inputs of each row (2:4: NVIDIA's sparse pattern)."""
    check_nm(n, m)
    masks = {}
    with torch.no_grad():
        for name, w in weights.items():
            check_nm_width(name, w.shape, n, m)
            masks[name] = keep_top_n_of_m(w.abs(), n, m)
    return masks


def is_nm_sparse(weight: torch.Tensor, n: int = 2, m: int = 4) -> bool:
    """True when every group of m consecutive inputs in every row holds at most n non-zeros."""
    return bool(((weight.reshape(weight.shape[0], -1, m) != 0).sum(-1) <= n).all())


# ----------------------------------------------------------------------------- applying masks


@dataclass
class Pruning:
    """Keep-masks applied to a model: the pruned weights are zero, and stay zero while this is active."""

    masks: dict[str, torch.Tensor]
    _hooks: list[Any] = field(default_factory=list, repr=False)

    @property
    def active(self) -> bool:
        return bool(self._hooks)

    def remove(self) -> dict[str, torch.Tensor]:
        """Make the pruning permanent: the zeros stay in the weights, gradients are no longer masked."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return self.masks


def apply_masks(model: nn.Module, masks: dict[str, torch.Tensor], *, permanent: bool = False) -> Pruning:
    """Zero the weights where `masks` is False; unless permanent, mask their gradients from now on.

    Every name and shape is checked before any weight changes.
    """
    named = dict(model.named_modules())
    for name, mask in masks.items():
        if name not in named or not hasattr(named[name], "weight"):
            raise ValueError(f"mask for {name!r}, but the model has no module with a weight of that name")
        if tuple(mask.shape) != tuple(named[name].weight.shape):
            raise ValueError(
                f"mask for {name!r} has shape {tuple(mask.shape)}, the weight {tuple(named[name].weight.shape)}"
            )
    pruning = Pruning({})
    with torch.no_grad():
        for name, mask in masks.items():
            weight = named[name].weight
            keep = mask.to(device=weight.device, dtype=torch.bool)
            weight.mul_(keep)
            pruning.masks[name] = keep
            if not permanent:
                pruning._hooks.append(weight.register_hook(lambda g, keep=keep: g * keep))
    return pruning


def magnitude_prune(
    model: nn.Module, sparsity: float, *, scope: str = "layer", permanent: bool = False, **selection: Any
) -> Pruning:
    """Zero the smallest-magnitude weights per layer or globally (`selection`: see prunable_weights)."""
    return apply_masks(
        model, magnitude_masks(prunable_weights(model, **selection), sparsity, scope=scope), permanent=permanent
    )


def nm_prune(model: nn.Module, n: int = 2, m: int = 4, *, permanent: bool = False, **selection: Any) -> Pruning:
    """Keep the n largest of every m consecutive weights in each row of the selected matrices."""
    return apply_masks(model, nm_masks(prunable_weights(model, **selection), n, m), permanent=permanent)


def save_masks(masks: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Write keep-masks as safetensors (uint8), atomically."""
    data = save(
        {name: mask.to(torch.uint8).contiguous().cpu() for name, mask in masks.items()},
        metadata={"format": "labkit.prune keep-masks"},
    )
    return fileio.atomic_write_bytes(path, data)


def load_masks(path: str | Path) -> dict[str, torch.Tensor]:
    """Read keep-masks written by save_masks (boolean tensors on the CPU)."""
    return {name: t.bool() for name, t in load_file(str(path)).items()}


# ----------------------------------------------------------------------------- counting


@dataclass(frozen=True)
class LayerSparsity:
    """Zeros counted in one weight matrix."""

    name: str
    shape: tuple[int, ...]
    zeros: int

    @property
    def params(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def sparsity(self) -> float:
        return self.zeros / self.params


def sparsity_report(model: nn.Module, **selection: Any) -> list[LayerSparsity]:
    """Zeros actually present in each prunable weight (not what a mask says)."""
    return [
        LayerSparsity(name, tuple(w.shape), int((w == 0).sum()))
        for name, w in prunable_weights(model, **selection).items()
    ]


def overall_sparsity(report: list[LayerSparsity]) -> float:
    """Share of zeros over all weights of a report."""
    return sum(r.zeros for r in report) / sum(r.params for r in report)
