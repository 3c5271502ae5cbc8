"""GPTQ (Frantar et al., 2022) on one weight matrix: quantize one input column at a time and spread its
rounding error over the columns not yet quantized, in proportion to the inverse Hessian H = 2 X Xᵀ / n
of the layer's calibration inputs, which minimizes ‖WX − ŴX‖² column by column. The Hessian and the factor of
its inverse come from `labkit.calibration`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from labkit.calibration import inverse_hessian_factor
from labkit.quant.formats import QuantConfig, QuantizedWeight, check_weight, grid


def hessian_error(weight: torch.Tensor, quantized: torch.Tensor, hessian: torch.Tensor) -> float:
    """Relative output error tr(ΔW H ΔWᵀ) / tr(W H Wᵀ) = ‖(W − Ŵ)X‖² / ‖WX‖² on the calibration inputs."""
    return relative_errors(weight, hessian)(quantized)


def relative_errors(weight: torch.Tensor, hessian: torch.Tensor) -> Callable[[torch.Tensor], float]:
    """`hessian_error` against one weight and Hessian for many candidates: tr(W H Wᵀ) is computed once."""
    w = weight.detach().float()
    h = hessian.float().to(w.device)
    den = ((w @ h) * w).sum().clamp(min=1e-30)

    def error(quantized: torch.Tensor) -> float:
        delta = w - quantized.float().to(w.device)
        return float(((delta @ h) * delta).sum() / den)

    return error


def quantize_column(
    block: torch.Tensor, i: int, u: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's inner step: round column i of `block` to the grid, then subtract its error, divided by the
    pivot u[i, i] and weighted by row i of the inverse-Hessian factor, from the columns after it (in place).
    Returns the codes of column i and the scaled error (kept for the lazy update of later blocks)."""
    q = torch.clamp(torch.round(block[:, i] / scale) + zero, 0, maxq)
    err = (block[:, i] - scale * (q - zero)) / u[i, i]
    block[:, i + 1 :].addr_(err, u[i, i + 1 :], alpha=-1)
    return q, err


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, cfg: QuantConfig) -> QuantizedWeight:
    """GPTQ on one weight [out, in] given its inputs' Hessian [in, in]; returns codes, scales, zeros, g_idx.

    Columns are quantized left to right (or by decreasing Hessian diagonal with act_order). After each
    column, its rounding error divided by the inverse Hessian's pivot is subtracted from the remaining
    columns of the block; whole blocks are then updated at once (lazy batch updates). Inputs that were
    zero throughout calibration (dead: H_ii = 0) carry no information: their weights are set to 0.
    """
    check_weight(weight)
    out_features, in_features = weight.shape
    if hessian.shape != (in_features, in_features):
        raise ValueError(f"hessian must be [{in_features}, {in_features}], got {tuple(hessian.shape)}")
    width = cfg.width(in_features)
    block = max(cfg.block_size // width, 1) * width if cfg.group_size != -1 else cfg.block_size
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(h.diagonal(), descending=True) if cfg.act_order else torch.arange(in_features, device=w.device)
    w, h = w[:, perm], h[perm][:, perm]
    u = inverse_hessian_factor(h, cfg.damp)

    codes = torch.empty_like(w)
    scales, zeros = [], []
    scale = zero = None
    for b0 in range(0, in_features, block):
        b1 = min(b0 + block, in_features)
        wb, errors = w[:, b0:b1].clone(), torch.empty(out_features, b1 - b0, device=w.device)
        ub = u[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if col % width == 0:  # a new group starts: fit its grid to the columns as updated so far
                scale, zero = grid(wb[:, i : i + width] if cfg.group_size != -1 else w, cfg)
                scales.append(scale)
                zeros.append(zero)
            codes[:, col], errors[:, i] = quantize_column(wb, i, ub, scale, zero, cfg.maxq)
        w[:, b1:] -= errors @ u[b0:b1, b1:]

    inverse = torch.argsort(perm).cpu()
    g_idx = (torch.arange(in_features) // width)[inverse]
    return QuantizedWeight(
        codes.cpu()[:, inverse].to(torch.uint8),
        torch.stack(scales).cpu(),
        torch.stack(zeros).cpu().to(torch.int32),
        g_idx.to(torch.int32),
        cfg.bits,
    )
