"""Quantization formats and the grid: QuantConfig, QuantizedWeight, scale and zero per group, round to nearest,
and the stored size of a quantized layer.

A quantized weight stores, per output row and per group of `group_size` input columns, a scale and a
zero point; each weight becomes an integer code q in [0, 2^bits - 1] standing for scale * (q - zero).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.torchutil import is_int

BITS = (2, 3, 4, 8)


@dataclass(frozen=True)
class QuantConfig:
    """How to quantize: bits, group size (-1: one scale per output row), symmetry, and GPTQ's knobs."""

    bits: int = 4
    group_size: int = 64  # input columns sharing one scale and zero; -1 = per output channel
    sym: bool = True  # symmetric grid around zero (zero point fixed at 2^(bits-1))
    damp: float = 0.01  # GPTQ: added to the Hessian diagonal, as a share of its mean
    block_size: int = 128  # GPTQ: columns per block of lazy updates
    act_order: bool = False  # GPTQ: quantize columns by decreasing Hessian diagonal ("desc_act")

    def __post_init__(self) -> None:
        if not is_int(self.bits) or self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits!r}")
        for name in ("sym", "act_order"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not is_int(self.group_size) or (self.group_size < 1 and self.group_size != -1):
            raise ValueError(f"group_size must be a positive int or -1 (per channel), got {self.group_size!r}")
        if not (isinstance(self.damp, (int, float)) and 0 <= self.damp < 1):
            raise ValueError(f"damp must be in [0, 1), got {self.damp!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1

    def width(self, in_features: int) -> int:
        """Columns per group for a layer with `in_features` inputs; raises if the group size does not divide it."""
        if self.group_size == -1:
            return in_features
        if in_features % self.group_size:
            options = [g for g in (16, 32, 64, 128, 256) if in_features % g == 0]
            raise ValueError(
                f"group_size {self.group_size} does not divide in_features {in_features}: every group must be "
                f"full (the packed kernels assume it); use one of {options} or -1 (per channel)"
            )
        return self.group_size

    def label(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"{self.bits}-bit {group}" + ("" if self.sym else " asym") + (" act-order" if self.act_order else "")


# ----------------------------------------------------------------------------- one weight matrix


@dataclass
class QuantizedWeight:
    """Integer codes [out, in], scales and zeros [groups, out], and each input column's group g_idx [in]."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    bits: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the codes stand for: scale * (code - zero), per group."""
        scales = self.scales.float()[self.g_idx.long()].T  # [out, in]
        zeros = self.zeros.float()[self.g_idx.long()].T
        return (scales * (self.codes.float() - zeros)).to(dtype)

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        """Output rows start:stop with their scales and zeros, as tensors of their own (not views)."""
        return QuantizedWeight(
            self.codes[start:stop].clone(),
            self.scales[:, start:stop].clone(),
            self.zeros[:, start:stop].clone(),
            self.g_idx.clone(),
            self.bits,
        )


def grid(w: torch.Tensor, cfg: QuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scale and zero point whose grid spans the row's range (and 0), as checkpoints store them.

    The scale is rounded to fp16 before use, so the codes are computed against the very scale the
    checkpoint will hold: dequantizing a saved checkpoint gives exactly the in-memory weights.
    """
    w = w.float()
    lo = w.min(dim=1).values.clamp(max=0)
    hi = w.max(dim=1).values.clamp(min=0)
    if cfg.sym:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    flat = hi == lo  # an all-zero row: any scale works
    lo, hi = torch.where(flat, -1.0, lo), torch.where(flat, 1.0, hi)
    tiny = torch.finfo(torch.float16).tiny
    scale = ((hi - lo) / cfg.maxq).to(torch.float16).float().clamp(min=tiny)
    if cfg.sym:
        zero = torch.full_like(scale, (cfg.maxq + 1) // 2)
    else:
        zero = torch.round(-lo / scale).clamp(0, cfg.maxq)
    return scale, zero


def to_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Nearest grid point per weight, as an integer code (w [rows, cols]; scale, zero [rows])."""
    return torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, maxq)


def check_weight(weight: torch.Tensor) -> None:
    """Refuse anything but a finite 2-D weight [out_features, in_features] before it is quantized."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight [out_features, in_features], got {getattr(weight, 'shape', weight)!r}")
    if not torch.isfinite(weight).all():
        raise ValueError("the weight holds NaN or inf values; quantizing them would hide the problem")


def quantize_rtn(weight: torch.Tensor, cfg: QuantConfig) -> QuantizedWeight:
    """Round to nearest: each group of columns gets its own grid, each weight its nearest point."""
    check_weight(weight)
    out_features, in_features = weight.shape
    width = cfg.width(in_features)
    w = weight.detach().float().cpu()
    codes = torch.empty_like(w)
    scales, zeros = [], []
    for start in range(0, in_features, width):
        cols = slice(start, start + width)
        scale, zero = grid(w[:, cols], cfg)
        codes[:, cols] = to_codes(w[:, cols], scale, zero, cfg.maxq)
        scales.append(scale)
        zeros.append(zero)
    g_idx = torch.arange(in_features) // width
    return QuantizedWeight(
        codes.to(torch.uint8), torch.stack(scales), torch.stack(zeros).to(torch.int32), g_idx.to(torch.int32), cfg.bits
    )


# ----------------------------------------------------------------------------- sizes


def bits_per_weight(cfg: QuantConfig, in_features: int, out_features: int) -> float:
    """Stored bits per weight of one layer: the codes plus fp16 scales, packed zeros and the int32 g_idx."""
    groups = in_features // cfg.width(in_features)
    total = out_features * in_features * cfg.bits + groups * out_features * (16 + cfg.bits) + in_features * 32
    return total / (out_features * in_features)
