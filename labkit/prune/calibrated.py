"""Pruning with calibration data, from scratch: Wanda (Sun et al., 2023) and SparseGPT (Frantar & Alistarh, 2023).

Both walk the decoder block by block as GPTQ does (`labkit.calibration.calibrated_sweep`): each group of linear
layers is pruned on the inputs produced by the layers already pruned, summarized by H = 2 X Xᵀ / n.

- Wanda scores each weight |W_ij| · ‖X_j‖ (‖X_j‖² is H_jj up to a constant) and compares the weights of
  each output row among themselves. The kept weights do not change.
- SparseGPT visits the columns left to right as GPTQ does, choosing the weights to drop by the OBS saliency
  w² / [H⁻¹]_jj and moving each dropped weight's contribution onto the columns not yet visited through the
  inverse Hessian: GPTQ's machinery with "set to zero" in place of "round to the grid".

A sparsity is a share of each layer's weights (0.5) or an N:M pattern, (2, 4): n kept of every m
consecutive inputs of each row, as `masks.nm_masks` counts it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from labkit.calibration import calibrated_sweep, check_calibration, inverse_hessian_factor
from labkit.prune.masks import (
    Pruning,
    apply_masks,
    check_nm,
    check_nm_width,
    check_sparsity,
    drop_smallest,
    keep_top_n_of_m,
)
from labkit.torchutil import check_bool, check_module, decoder_layers, eval_mode, is_int, is_number

Sparsity = float | tuple[int, int]


def _pattern(sparsity: Sparsity) -> tuple[float | None, tuple[int, int] | None]:
    """(share, None) for an unstructured sparsity, (None, (n, m)) for an N:M pattern; anything else refused."""
    if isinstance(sparsity, tuple):
        if len(sparsity) != 2:
            raise ValueError(f"an N:M pattern is a pair (n, m), got {sparsity}")
        check_nm(*sparsity)
        return None, sparsity
    check_sparsity(sparsity)
    return float(sparsity), None


def _check_layer(weight: torch.Tensor, hessian: torch.Tensor, nm: tuple[int, int] | None) -> None:
    """A weight [out, in] whose width fits the N:M groups, and its inputs' Hessian [in, in]."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor [out, in], got {getattr(weight, 'shape', weight)!r}")
    if not isinstance(hessian, torch.Tensor):
        raise TypeError(f"hessian must be a tensor [in, in], got {type(hessian).__name__}")
    if nm:
        check_nm_width("weight", weight.shape, *nm)
    if hessian.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(f"hessian must be [{weight.shape[1]}, {weight.shape[1]}], got {tuple(hessian.shape)}")


def _check_block_size(block_size: int, nm: tuple[int, int] | None) -> None:
    if not is_int(block_size) or block_size < 1 or (nm and block_size % nm[1]):
        raise ValueError(f"block_size must be a positive int (a multiple of m for N:M), got {block_size!r}")


def _check_damp(damp: float) -> None:
    if not (is_number(damp) and 0 <= damp < 1):
        raise ValueError(f"damp must be in [0, 1), got {damp!r}")


@torch.no_grad()
def wanda_mask(weight: torch.Tensor, hessian: torch.Tensor, sparsity: Sparsity) -> torch.Tensor:
    """Wanda's keep-mask [out, in]: in each output row, drop the weights with the smallest |W_ij| · ‖X_j‖."""
    share, nm = _pattern(sparsity)
    _check_layer(weight, hessian, nm)
    score = weight.detach().abs().float() * hessian.diagonal().float().clamp(min=0).sqrt().to(weight.device)
    if nm:
        return keep_top_n_of_m(score, *nm)
    drop = round(share * weight.shape[1])
    keep = torch.ones_like(score, dtype=torch.bool)
    if drop:
        keep.scatter_(1, score.topk(drop, dim=1, largest=False).indices, False)
    return keep


@torch.no_grad()
def sparsegpt_weight(
    weight: torch.Tensor, hessian: torch.Tensor, sparsity: Sparsity, *, damp: float = 0.01, block_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT on one weight [out, in] given its inputs' Hessian: the pruned and updated weight, and its keep-mask.

    Columns are visited in blocks of `block_size`. An unstructured mask is chosen per block, over all its
    rows at once, by the saliency w² / u_jj² (u: the upper Cholesky factor of H⁻¹, u_jj² = [H⁻¹]_jj with the
    earlier columns eliminated); an N:M mask per group of m columns, when the sweep reaches it. Each column's
    error, divided by u_jj and weighted by row j of u, is subtracted from the columns after it.
    """
    share, nm = _pattern(sparsity)
    _check_layer(weight, hessian, nm)
    _check_block_size(block_size, nm)
    _check_damp(damp)
    return _sparsegpt(weight, _inverse_factor(hessian, damp, weight), share, nm, block_size)


def _inverse_factor(hessian: torch.Tensor, damp: float, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's inverse-Hessian factor on `weight`'s device in SparseGPT's working dtype, and the dead inputs
    (zero throughout calibration)."""
    work = torch.float64 if weight.dtype == torch.float64 else torch.float32  # float64 in, float64 throughout
    h = hessian.detach().to(device=weight.device, dtype=work, copy=True)
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    return inverse_hessian_factor(h, damp), dead


def _sparsegpt(
    weight: torch.Tensor,
    factor: tuple[torch.Tensor, torch.Tensor],
    share: float | None,
    nm: tuple[int, int] | None,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT's sweep over one weight, given the factor of its inputs' inverse Hessian (shared by a group)."""
    u, dead = factor
    cols = weight.shape[1]
    w = weight.detach().to(u.dtype, copy=True)
    w[:, dead] = 0.0  # inputs that were zero throughout calibration carry nothing: their weights go
    keep = torch.ones_like(w, dtype=torch.bool)
    for b0 in range(0, cols, block_size):
        b1 = min(b0 + block_size, cols)
        block, ub = w[:, b0:b1], u[b0:b1, b0:b1]  # views: the sweep updates w in place
        pivots = ub.diagonal()
        errors = torch.zeros_like(block)
        if share is not None:
            saliency = block.pow(2) / pivots.pow(2)
            keep[:, b0:b1] = drop_smallest(saliency.flatten(), round(share * saliency.numel())).view_as(block)
        for j in range(b1 - b0):
            if nm and j % nm[1] == 0:
                saliency = block[:, j : j + nm[1]].pow(2) / pivots[j : j + nm[1]].pow(2)
                keep[:, b0 + j : b0 + j + nm[1]] = keep_top_n_of_m(saliency, *nm)
            pruned = block[:, j] * keep[:, b0 + j]
            errors[:, j] = (block[:, j] - pruned) / ub[j, j]
            block[:, j + 1 :].addr_(errors[:, j], ub[j, j + 1 :], alpha=-1)
            block[:, j] = pruned
        w[:, b1:].addmm_(errors, u[b0:b1, b1:], alpha=-1)
    return w.to(weight.dtype), keep


def _check_args(
    model: nn.Module, calibration: Any, sparsity: Sparsity, batch_size: int
) -> tuple[float | None, tuple[int, int] | None]:
    """Everything a whole-model sweep could trip over, checked before any weight changes; returns the sparsity as
    (share, None) or (None, N:M pattern)."""
    check_module(model)
    share, nm = _pattern(sparsity)
    check_calibration(model, calibration, "calibrated pruning")
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    linears = [(name, m) for name, m in decoder_layers(model).named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(
            f"nothing to prune in {type(model).__name__}: calibrated pruning looks for nn.Linear layers inside the "
            "decoder blocks (GPT-2's Conv1D layers are not supported)"
        )
    if nm:
        for name, m in linears:
            check_nm_width(name, m.weight.shape, *nm)
    return share, nm


METHODS = ("wanda", "sparsegpt")


def calibrated_prune(
    model: nn.Module,
    calibration: torch.Tensor,
    sparsity: Sparsity = 0.5,
    *,
    method: str = "wanda",
    damp: float = 0.01,
    block_size: int = 128,
    batch_size: int = 8,
    permanent: bool = False,
    progress: bool = True,
) -> Pruning:
    """Wanda or SparseGPT on every linear of the decoder blocks, in place, swept block by block on `calibration`.

    "wanda" zeros, per output row, the smallest |W_ij| · ‖X_j‖; "sparsegpt" also updates the remaining
    weights (`damp` and `block_size` as in GPTQ). Returns a `Pruning` whose masks hold through fine-tuning
    unless `permanent`.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    share, nm = _check_args(model, calibration, sparsity, batch_size)
    _check_damp(damp)
    _check_block_size(block_size, nm)
    check_bool("permanent", permanent)
    check_bool("progress", progress)
    masks: dict[str, torch.Tensor] = {}

    def solve(names: list[str], modules: list[nn.Linear], hessian: torch.Tensor) -> None:
        # the layers of a group read the same input: one Hessian, and for SparseGPT one factor of its inverse
        factor = _inverse_factor(hessian, damp, modules[0].weight) if method == "sparsegpt" else None
        for name, m in zip(names, modules):  # pruned in place: the next layers' inputs come from the pruned ones
            if method == "wanda":
                masks[name] = wanda_mask(m.weight, hessian, sparsity)
                m.weight.data = m.weight.detach() * masks[name]
            else:
                pruned, masks[name] = _sparsegpt(m.weight, factor, share, nm, block_size)
                m.weight.data = pruned

    with eval_mode(model):
        desc = {"wanda": "Wanda", "sparsegpt": "SparseGPT"}[method]
        calibrated_sweep(model, calibration, solve, batch_size=batch_size, desc=desc, progress=progress)
    return apply_masks(model, masks, permanent=permanent)
