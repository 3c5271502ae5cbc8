"""Weight quantization: round-to-nearest and GPTQ from scratch, saved as standard GPTQ checkpoints.

A quantized weight stores, per output row and per group of `group_size` input columns, a scale and a
zero point; each weight becomes an integer code q in [0, 2^bits - 1] standing for scale * (q - zero).

- `quantize_rtn`: every weight to its nearest grid point. No data needed.
- `gptq_quantize`: GPTQ (Frantar et al., 2022). Quantize one input column at a time and spread its
  rounding error over the columns not yet quantized, in proportion to the inverse Hessian
  H = 2 X Xᵀ / n of the layer's calibration inputs, which minimizes ‖WX − ŴX‖² column by column.
- `quantize_model`: the whole decoder, block by block: calibration activations flow through the
  blocks already quantized, so each block corrects for the error of those before it.
- `PackedLinear` / `pack_model`: the codes kept packed in memory and dequantized on the fly, in the
  forward and the backward: a 4-bit base to train LoRA adapters on (QLoRA, lab 08).
- `save_gptq` / `load_gptq`: the classic "gptq" checkpoint (int32-packed qweight/qzeros, fp16 scales,
  g_idx, `quantization_config` in config.json) that transformers (through GPTQModel) and GPTQModel
  load; `load_gptq` also reads checkpoints that GPTQModel wrote.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from labkit import assets

BITS = (2, 3, 4, 8)
METHODS = ("rtn", "gptq")
# Calibration tokens per input of the widest layer below which GPTQ fits noise. Measured on SmolLM2's
# layers.0.mlp.down_proj (1536 inputs): with 2048 tokens its Hessian has 489 eigenvalues under 1e-3 of
# its mean diagonal and GPTQ's held-out error is RTN's (5.0e-3 vs 5.1e-3); the whole model's 4-bit g64
# perplexity then ranged from 26.4 to 31.0 with the CPU and thread count (22 % of the codes changed
# between 1 and 2 threads). With 8192 tokens none is that small and the held-out error halves (2.9e-3);
# with the Hessian summed and factored in float64 too, 1 and 2 threads give identical codes.
TOKENS_PER_INPUT = 4


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
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits!r}")
        if not isinstance(self.group_size, int) or (self.group_size < 1 and self.group_size != -1):
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


def _check_weight(weight: torch.Tensor) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight [out_features, in_features], got {getattr(weight, 'shape', weight)!r}")
    if not torch.isfinite(weight).all():
        raise ValueError("the weight holds NaN or inf values; quantizing them would hide the problem")


def quantize_rtn(weight: torch.Tensor, cfg: QuantConfig) -> QuantizedWeight:
    """Round to nearest: each group of columns gets its own grid, each weight its nearest point."""
    _check_weight(weight)
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


def hessian_error(weight: torch.Tensor, quantized: torch.Tensor, hessian: torch.Tensor) -> float:
    """Relative output error tr(ΔW H ΔWᵀ) / tr(W H Wᵀ) = ‖(W − Ŵ)X‖² / ‖WX‖² on the calibration inputs."""
    w = weight.detach().float()
    delta = w - quantized.float().to(w.device)
    h = hessian.float().to(w.device)
    num = ((delta @ h) * delta).sum()
    den = ((w @ h) * w).sum().clamp(min=1e-30)
    return float(num / den)


def _inverse_hessian_factor(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of the damped inverse Hessian; its rows drive GPTQ's error updates.

    Factored in float64 (a few ms even for 1536 inputs): with a condition number near 1e4, an fp32
    factorization depends on how the LAPACK routine split its sums, and GPTQ's error feedback turns that
    into other codes (on SmolLM2, 1 vs 2 threads changed 22 % of them; in float64, none). The factor
    comes back in the Hessian's dtype.
    """
    h = hessian.to(torch.float64, copy=True)  # damped in place below: never the caller's tensor
    h.diagonal().add_(damp * h.diagonal().mean())
    factor, info = torch.linalg.cholesky_ex(h)
    if info.item() != 0:
        raise ValueError(
            f"the Hessian is not positive definite after damping ({damp:.3g} of its mean diagonal); "
            "use more calibration tokens or a larger damp (0.01-0.1)"
        )
    return torch.linalg.cholesky(torch.cholesky_inverse(factor), upper=True).to(hessian.dtype)


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
    _check_weight(weight)
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
    u = _inverse_hessian_factor(h, cfg.damp)

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


# ----------------------------------------------------------------------------- the whole model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks of a causal LM (Llama/SmolLM2, OPT, GPT-NeoX, Qwen, Mistral ...)."""
    for path in ("model.layers", "model.decoder.layers", "gpt_neox.layers", "transformer.h"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return obj
    raise ValueError(
        f"cannot find the decoder blocks of {type(model).__name__} (looked for model.layers, "
        "model.decoder.layers, gpt_neox.layers, transformer.h)"
    )


def calibration_blocks(tokenizer, texts: Sequence[str], n_blocks: int, block_size: int, seed: int = 0) -> torch.Tensor:
    """`n_blocks` random non-overlapping windows of `block_size` tokens from the EOS-joined texts: [n, block_size]."""
    from labkit.evaluate import token_stream
    from labkit.shards import pack_blocks

    if n_blocks < 1 or block_size < 2:
        raise ValueError(f"need n_blocks >= 1 and block_size >= 2, got {n_blocks}, {block_size}")
    blocks = pack_blocks(np.asarray(token_stream(tokenizer, list(texts))), block_size)
    if len(blocks) < n_blocks:
        raise ValueError(
            f"the texts hold {len(blocks)} blocks of {block_size} tokens, fewer than the "
            f"{n_blocks} asked for: pass more texts"
        )
    chosen = np.random.default_rng(seed).choice(len(blocks), size=n_blocks, replace=False)
    return torch.from_numpy(blocks[np.sort(chosen)].copy())


class _Stop(Exception):
    """Raised by a hook once it has what it came for, to cut a forward pass short."""


def _block_output(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def _first_block_inputs(
    model: nn.Module, layers: nn.ModuleList, calibration: torch.Tensor, batch_size: int
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """Hidden states and keyword arguments (masks, positions, rotary tables) entering block 0, per batch."""
    inputs, kwargs_list = [], []

    def grab(module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        inputs.append(hidden)
        kwargs_list.append({k: v for k, v in kwargs.items() if k != "hidden_states"})
        raise _Stop

    handle = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        _forward_until_stopped(model, calibration, batch_size)
    finally:
        handle.remove()
    return inputs, kwargs_list


def _forward_until_stopped(model: nn.Module, calibration: torch.Tensor, batch_size: int) -> None:
    """Run the calibration windows through the model; a hook raising _Stop ends each pass early."""
    device = next(model.parameters()).device
    for batch in calibration.split(batch_size):
        try:
            model(input_ids=batch.to(device), use_cache=False)
        except _Stop:
            pass


@torch.no_grad()
def _sequential_groups(block: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> list[list[str]]:
    """The block's linear layers in execution order, grouped by shared input (q/k/v; o; gate/up; down)."""
    seen: list[tuple[str, torch.Tensor]] = []
    hooks = [
        m.register_forward_hook(lambda m, a, o, name=name: seen.append((name, a[0])))
        for name, m in block.named_modules()
        if isinstance(m, nn.Linear)
    ]
    try:
        block(hidden, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    groups: list[list[str]] = []
    for i, (name, x) in enumerate(seen):
        if i and x is seen[i - 1][1]:
            groups[-1].append(name)
        else:
            groups.append([name])
    return groups


class _HessianHook:
    """Accumulates H = 2 X Xᵀ / n over the inputs of one linear layer, then stops the forward pass.

    The sum runs in float64 and H is returned in float32: an fp32 sum depends on the GEMM kernel the
    CPU's BLAS picks for its SIMD width, and GPTQ turns such differences into other codes (see
    `_inverse_hessian_factor`). The sums take ~25 s instead of ~14 s per SmolLM2 run at 8192 tokens on 2 cores.
    """

    def __init__(self, module: nn.Linear) -> None:
        self.sum = torch.zeros(module.in_features, module.in_features, device=module.weight.device, dtype=torch.float64)
        self.count = 0
        self.handle = module.register_forward_pre_hook(self)

    def __call__(self, module: nn.Linear, args: tuple) -> None:
        x = args[0].reshape(-1, module.in_features).to(torch.float64)
        self.sum.addmm_(x.T, x)
        self.count += x.shape[0]
        raise _Stop  # the layers after this one are not needed

    def result(self) -> tuple[torch.Tensor, int]:
        self.handle.remove()
        return (self.sum * (2.0 / max(self.count, 1))).float(), self.count


@torch.no_grad()
def _input_hessian(
    block: nn.Module, module: nn.Linear, inputs: list[torch.Tensor], kwargs_list: list[dict[str, Any]]
) -> tuple[torch.Tensor, int]:
    """H = 2 X Xᵀ / n over every calibration token entering `module`; forwards stop right after it."""
    hook = _HessianHook(module)
    try:
        for hidden, kwargs in zip(inputs, kwargs_list):
            try:
                block(hidden, **kwargs)
            except _Stop:
                pass
    finally:
        hessian = hook.result()
    return hessian


@torch.no_grad()
def input_hessian(model: nn.Module, module_name: str, calibration: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """H = 2 X Xᵀ / n of the inputs X that one linear layer of the (unquantized) model sees on `calibration`."""
    module = dict(model.named_modules()).get(module_name)
    if not isinstance(module, nn.Linear):
        raise ValueError(f"{module_name!r} is not an nn.Linear of {type(model).__name__}")
    hook = _HessianHook(module)
    try:
        _forward_until_stopped(model, calibration, batch_size)
    finally:
        hessian, _ = hook.result()
    return hessian


@dataclass
class LayerRecord:
    """One quantized linear layer: its name, shape, relative output error (and RTN's on the same inputs), time."""

    name: str
    shape: tuple[int, int]
    error: float
    rtn_error: float | None
    seconds: float


@dataclass
class QuantizedModel:
    """A model whose decoder linears hold dequantized weights, with the codes needed to save them packed."""

    model: nn.Module
    config: QuantConfig
    method: str
    weights: dict[str, QuantizedWeight]
    layers: list[LayerRecord] = field(default_factory=list)
    seconds: float = 0.0
    calibration_tokens: int = 0


def quantize_model(
    model: nn.Module,
    cfg: QuantConfig,
    calibration: torch.Tensor | None = None,
    *,
    method: str = "gptq",
    batch_size: int = 8,
    inplace: bool = False,
    progress: bool = True,
) -> QuantizedModel:
    """Quantize every nn.Linear inside the decoder blocks (the embeddings and LM head stay as they are).

    GPTQ goes block by block: the calibration activations entering a block are those produced by
    the blocks already quantized; within a block, layers that read the same input (q/k/v, gate/up)
    share one Hessian and are quantized before the layers after them see their inputs. `calibration`
    is a [n, T] tensor of token ids (see `calibration_blocks`) with at least as many tokens as the
    widest layer has inputs, or its Hessian is rank-deficient — and many more in practice: with too few,
    GPTQ fits the calibration tokens and does worse than RTN on other text (lab 07 measures where).
    The source model is copied first unless `inplace=True`.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(cfg, QuantConfig):
        raise TypeError(f"cfg must be a QuantConfig, got {type(cfg).__name__}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    layers = decoder_layers(model)
    linears = [m for block in layers for m in block.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(
            f"no nn.Linear inside the decoder blocks of {type(model).__name__} "
            "(GPT-2's Conv1D layers are not supported)"
        )
    for m in linears:
        cfg.width(m.in_features)  # fail before any work if a group size does not fit
    tokens = 0
    if method == "gptq":
        if not isinstance(calibration, torch.Tensor) or calibration.dim() != 2 or calibration.dtype != torch.long:
            raise ValueError(
                "GPTQ needs calibration token ids as a [n_blocks, block_size] long tensor "
                "(labkit.quant.calibration_blocks makes one)"
            )
        tokens = calibration.numel()
        widest = max(m.in_features for m in linears)
        if tokens < widest:
            raise ValueError(
                f"{tokens} calibration tokens are too few: a layer with {widest} inputs needs at "
                f"least {widest} for a full-rank Hessian (GPTQ used 128 x 2048)"
            )
        if tokens < TOKENS_PER_INPUT * widest:
            warnings.warn(
                f"{tokens} calibration tokens for a layer with {widest} inputs: under "
                f"{TOKENS_PER_INPUT * widest} the Hessian is nearly singular, GPTQ fits the calibration "
                "text and its result changes with the CPU's rounding; pass more tokens",
                stacklevel=2,
            )

    if not inplace:
        model = copy.deepcopy(model)
        layers = decoder_layers(model)
    prefix = _layers_prefix(model, layers)
    was_training = model.training
    model.eval()
    result = QuantizedModel(model, cfg, method, {}, calibration_tokens=tokens)
    start = time.perf_counter()
    try:
        if method == "rtn":
            for i, block in enumerate(tqdm(layers, desc="RTN", disable=not progress, leave=False)):
                for name, m in block.named_modules():
                    if isinstance(m, nn.Linear):
                        t0 = time.perf_counter()
                        q = quantize_rtn(m.weight, cfg)
                        _store(result, f"{prefix}.{i}.{name}", m, q, None, None, time.perf_counter() - t0)
        else:
            _gptq_blocks(result, layers, prefix, calibration, batch_size, progress)
    finally:
        model.train(was_training)
    result.seconds = time.perf_counter() - start
    return result


def _layers_prefix(model: nn.Module, layers: nn.ModuleList) -> str:
    return next(name for name, m in model.named_modules() if m is layers)


def _store(
    result: QuantizedModel,
    name: str,
    module: nn.Linear,
    q: QuantizedWeight,
    hessian: torch.Tensor | None,
    rtn: QuantizedWeight | None,
    seconds: float,
) -> None:
    """Write the dequantized weight into the module and record the codes and the errors."""
    original = module.weight.detach()
    deq = q.dequantize().to(original.device)
    err = hessian_error(original, deq, hessian) if hessian is not None else float("nan")
    rtn_err = hessian_error(original, rtn.dequantize().to(original.device), hessian) if rtn is not None else None
    module.weight.data = deq.to(original.dtype)
    result.weights[name] = q
    result.layers.append(LayerRecord(name, tuple(original.shape), err, rtn_err, seconds))


@torch.no_grad()
def _gptq_blocks(
    result: QuantizedModel,
    layers: nn.ModuleList,
    prefix: str,
    calibration: torch.Tensor,
    batch_size: int,
    progress: bool,
) -> None:
    cfg = result.config
    inputs, kwargs_list = _first_block_inputs(result.model, layers, calibration, batch_size)
    bar = tqdm(
        total=sum(1 for b in layers for m in b.modules() if isinstance(m, nn.Linear)),
        desc="GPTQ",
        disable=not progress,
        leave=False,
    )
    try:
        for i, block in enumerate(layers):
            named = dict(block.named_modules())
            for group in _sequential_groups(block, inputs[0], kwargs_list[0]):
                hessian, _ = _input_hessian(block, named[group[0]], inputs, kwargs_list)
                # The layers of a group read the same input: one Hessian serves all, and since GPTQ treats
                # every output row alone given H, one pass over their stacked rows quantizes them all.
                bar.set_postfix_str(f"{i}.{'+'.join(n.rsplit('.', 1)[-1] for n in group)}")
                modules, t0 = [named[n] for n in group], time.perf_counter()
                stacked = gptq_quantize(torch.cat([m.weight for m in modules]), hessian, cfg)
                share = (time.perf_counter() - t0) / stacked.codes.shape[0]  # seconds per row
                start = 0
                for name, m in zip(group, modules):
                    rows = m.weight.shape[0]
                    _store(
                        result,
                        f"{prefix}.{i}.{name}",
                        m,
                        stacked.rows(start, start + rows),
                        hessian,
                        quantize_rtn(m.weight, cfg),
                        share * rows,
                    )
                    start += rows
                    bar.update()
            inputs = [_block_output(block(x, **kw)) for x, kw in zip(inputs, kwargs_list)]
    finally:
        bar.close()


# ----------------------------------------------------------------------------- packed in memory (QLoRA's base)


PACKABLE_BITS = (2, 4, 8)  # whole codes per byte; 3-bit codes are packed only in checkpoints


class PackedLinear(nn.Module):
    """A frozen linear layer that keeps its codes packed in memory (two 4-bit codes per byte) and
    dequantizes them on the fly, in the forward and again in the backward, so the full-precision
    weight exists only one layer at a time: the memory saving QLoRA trains adapters on top of."""

    def __init__(
        self, q: QuantizedWeight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        if q.bits not in PACKABLE_BITS:
            raise ValueError(f"PackedLinear packs {PACKABLE_BITS}-bit codes, not {q.bits}-bit ones")
        out_features, in_features = q.codes.shape
        per_byte = 8 // q.bits
        if in_features % per_byte:
            raise ValueError(f"{in_features} inputs do not fill whole bytes of {per_byte} codes")
        self.in_features, self.out_features, self.bits, self.dtype = in_features, out_features, q.bits, dtype
        codes = q.codes.to(torch.uint8).reshape(out_features, in_features // per_byte, per_byte)
        shifts = torch.arange(per_byte, dtype=torch.uint8) * q.bits
        self.register_buffer("packed", (codes << shifts).sum(dim=-1, dtype=torch.uint8))
        self.register_buffer("scales", q.scales.to(torch.float16))
        self.register_buffer("zeros", q.zeros.to(torch.uint8))
        self.register_buffer("g_idx", q.g_idx.to(torch.int32))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        width = in_features // q.scales.shape[0]
        consecutive = torch.equal(q.g_idx.long(), torch.arange(in_features) // width)
        self.width = width if consecutive else 0

    def codes(self) -> torch.Tensor:
        """The integer codes [out, in], unpacked."""
        mask = 2**self.bits - 1
        parts = [(self.packed >> shift) & mask for shift in range(0, 8, self.bits)]
        return torch.stack(parts, dim=-1).reshape(self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in the compute dtype: scale * (code - zero), per group."""
        codes = self.codes().to(self.dtype)
        if self.width:  # groups of consecutive columns: broadcast per group instead of gathering per column
            zeros, scales = self.zeros.T[..., None].to(self.dtype), self.scales.T[..., None].to(self.dtype)
            grouped = codes.view(self.out_features, -1, self.width).sub_(zeros).mul_(scales)
            return grouped.view(self.out_features, self.in_features)
        g = self.g_idx.long()  # act-order: each column names its group
        return (codes - self.zeros[g].T.to(self.dtype)) * self.scales[g].T.to(self.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (a fresh tensor: the layer stores only the packed codes)."""
        return self.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _DequantizedMatmul.apply(x, self)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"


class _DequantizedMatmul(torch.autograd.Function):
    """x @ Wᵀ that saves nothing for the backward but the layer, and dequantizes W again there."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: PackedLinear) -> torch.Tensor:
        ctx.layer = layer
        return x @ layer.dequantize().to(x.dtype).T

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad @ ctx.layer.dequantize().to(grad.dtype), None


def pack_model(qm: QuantizedModel) -> nn.Module:
    """Swap each quantized linear of `qm.model` for a PackedLinear, in place: the same outputs, ~1/8 the bytes."""
    if not qm.weights:
        raise ValueError("nothing quantized to pack")
    if qm.config.bits not in PACKABLE_BITS:
        raise ValueError(f"PackedLinear packs {PACKABLE_BITS}-bit codes; this model has {qm.config.bits}-bit ones")
    for name, q in qm.weights.items():
        parent_name, _, child = name.rpartition(".")
        parent = qm.model.get_submodule(parent_name)
        linear = getattr(parent, child)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{name} is a {type(linear).__name__}, not the nn.Linear that was quantized")
        packed = PackedLinear(q, linear.bias, dtype=linear.weight.dtype).to(linear.weight.device)
        setattr(parent, child, packed)
    return qm.model


# ----------------------------------------------------------------------------- sizes


def bits_per_weight(cfg: QuantConfig, in_features: int, out_features: int) -> float:
    """Stored bits per weight of one layer: the codes plus fp16 scales, packed zeros and the int32 g_idx."""
    groups = in_features // cfg.width(in_features)
    total = out_features * in_features * cfg.bits + groups * out_features * (16 + cfg.bits) + in_features * 32
    return total / (out_features * in_features)


def weight_bytes(qm: QuantizedModel) -> dict[str, int]:
    """Bytes of the quantized layers as stored packed, against the same layers in fp16 and fp32."""
    packed = sum(
        math.ceil(bits_per_weight(qm.config, q.codes.shape[1], q.codes.shape[0]) * q.codes.numel() / 8)
        for q in qm.weights.values()
    )
    numel = sum(q.codes.numel() for q in qm.weights.values())
    return {"quantized": packed, "fp16": 2 * numel, "fp32": 4 * numel, "weights": numel}


# ----------------------------------------------------------------------------- GPTQ checkpoint format


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack [rows, cols] integers of `bits` bits into int32 along the rows: a little-endian bit stream,
    32 values per `bits` words (the GPTQ layout; for 2, 4 and 8 bits each word holds 32/bits whole values)."""
    v = values.to(torch.int64).cpu().numpy()
    rows, cols = v.shape
    if rows * bits % 32:
        raise ValueError(f"{rows} rows of {bits}-bit values do not fill whole 32-bit words")
    if v.min(initial=0) < 0 or v.max(initial=0) >= 2**bits:
        raise ValueError(f"values must lie in [0, {2**bits - 1}] to pack into {bits} bits")
    bitplanes = (v[:, None, :] >> np.arange(bits)[None, :, None]) & 1  # [rows, bits, cols]
    words = bitplanes.reshape(rows * bits // 32, 32, cols)
    packed = (words << np.arange(32, dtype=np.int64)[None, :, None]).sum(axis=1)
    return torch.from_numpy(packed.astype(np.uint32).view(np.int32))


def unpack_rows(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """Inverse of pack_rows: int32 [rows * bits / 32, cols] back to [rows, cols] integers (int32)."""
    p = packed.cpu().numpy().view(np.uint32).astype(np.int64)
    if p.shape[0] * 32 != rows * bits:
        raise ValueError(f"{p.shape[0]} packed words cannot hold {rows} values of {bits} bits")
    bitstream = (p[:, None, :] >> np.arange(32)[None, :, None]) & 1  # [words, 32, cols]
    bitplanes = bitstream.reshape(rows, bits, -1)
    values = (bitplanes << np.arange(bits)[None, :, None]).sum(axis=1)
    return torch.from_numpy(values.astype(np.int32))


def pack_weight(q: QuantizedWeight) -> dict[str, torch.Tensor]:
    """qweight [in*bits/32, out], qzeros [groups, out*bits/32] (stored minus one: the "gptq" v1 format),
    scales [groups, out] fp16, g_idx [in] int32."""
    maxq = 2**q.bits - 1
    return {
        "qweight": pack_rows(q.codes.T, q.bits),
        "qzeros": pack_rows(((q.zeros.to(torch.int64) - 1) & maxq).T, q.bits).T.contiguous(),
        "scales": q.scales.to(torch.float16).contiguous(),
        "g_idx": q.g_idx.to(torch.int32).contiguous(),
    }


def unpack_weight(tensors: dict[str, torch.Tensor], bits: int, in_features: int, v1: bool = True) -> QuantizedWeight:
    """Read one layer's qweight/qzeros/scales/g_idx back into codes, scales and zeros."""
    maxq = 2**bits - 1
    scales = tensors["scales"].float()
    out_features = scales.shape[1]
    codes = unpack_rows(tensors["qweight"], bits, in_features).T
    zeros = unpack_rows(tensors["qzeros"].T.contiguous(), bits, out_features).T
    if v1:
        zeros = (zeros + 1) & maxq
    g_idx = tensors.get("g_idx")
    if g_idx is None:
        raise ValueError("the checkpoint layer has no g_idx")
    return QuantizedWeight(
        codes.to(torch.uint8).contiguous(), scales, zeros.to(torch.int32).contiguous(), g_idx.to(torch.int32), bits
    )


def quantization_config(qm: QuantizedModel) -> dict[str, Any]:
    """The `quantization_config` entry of config.json that transformers and GPTQModel read."""
    from labkit import __version__

    cfg = qm.config
    return {
        "quant_method": "gptq",
        "bits": cfg.bits,
        "group_size": cfg.group_size,
        "desc_act": cfg.act_order,
        "sym": cfg.sym,
        "lm_head": False,
        "format": "gptq",
        "checkpoint_format": "gptq",
        "pack_dtype": "int32",
        "damp_percent": cfg.damp,
        "true_sequential": True,
        "meta": {
            "quantizer": [f"labkit:{__version__}"],
            "method": qm.method,
            "calibration_tokens": qm.calibration_tokens,
        },
    }


def save_gptq(qm: QuantizedModel, tokenizer, dest: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """Write a GPTQ checkpoint into `dest` atomically: packed quantized layers, the rest in `dtype`."""
    from safetensors.torch import save_file

    if not qm.weights:
        raise ValueError("nothing quantized to save")
    modules = dict(qm.model.named_modules())
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in qm.model.state_dict().items():
        module_name, _, param = key.rpartition(".")
        if module_name in qm.weights and param == "weight":
            continue
        if value.data_ptr() in seen:  # a tied weight (SmolLM2's LM head is its embedding): saved once
            continue
        seen.add(value.data_ptr())
        tensors[key] = value.detach().to(dtype if value.is_floating_point() else value.dtype).cpu().contiguous()
    for name, q in qm.weights.items():
        if not isinstance(modules.get(name), nn.Linear):
            raise ValueError(f"{name} is not a linear layer of this model")
        tensors.update({f"{name}.{k}": v for k, v in pack_weight(q).items()})
    config = qm.model.config.to_dict()
    config["quantization_config"] = quantization_config(qm)
    config["dtype"] = str(dtype).removeprefix("torch.")
    with assets.atomic_directory(dest) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
        (tmp / "quantize_config.json").write_text(json.dumps(config["quantization_config"], indent=2))
        if getattr(qm.model, "generation_config", None) is not None:
            qm.model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(dest)


def read_quantization_config(path: str | Path) -> dict[str, Any]:
    """The checkpoint's quantization_config (config.json, else quantize_config.json), validated."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} holds no config.json: not a model directory")
    qc = json.loads(config_file.read_text()).get("quantization_config")
    if qc is None and (path / "quantize_config.json").is_file():
        qc = json.loads((path / "quantize_config.json").read_text())
    if not qc or qc.get("quant_method", "gptq") != "gptq":
        raise ValueError(f"{path} is not a GPTQ checkpoint (quantization_config: {qc!r})")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"unsupported GPTQ checkpoint format {fmt!r}: labkit reads 'gptq' and 'gptq_v2'")
    return qc


def load_gptq(path: str | Path, dtype: torch.dtype = torch.float32) -> QuantizedModel:
    """Load a GPTQ checkpoint (labkit's or GPTQModel's) into a plain model with dequantized weights."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    qc = read_quantization_config(path)
    cfg = QuantConfig(
        bits=int(qc["bits"]),
        group_size=int(qc.get("group_size", -1)),
        sym=bool(qc.get("sym", True)),
        act_order=bool(qc.get("desc_act", False)),
    )
    v1 = qc.get("checkpoint_format", qc.get("format", "gptq")) == "gptq"
    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no .safetensors weights")
    for f in files:
        tensors.update(load_file(f))
    modules = dict(model.named_modules())
    weights: dict[str, QuantizedWeight] = {}
    for key in [k for k in tensors if k.endswith(".qweight")]:
        name = key.removesuffix(".qweight")
        module = modules.get(name)
        if not isinstance(module, nn.Linear):
            raise ValueError(f"checkpoint layer {name} is not a linear layer of {type(model).__name__}")
        parts = {
            p: tensors.pop(f"{name}.{p}") for p in ("qweight", "qzeros", "scales", "g_idx") if f"{name}.{p}" in tensors
        }
        q = unpack_weight(parts, cfg.bits, module.in_features, v1=v1)
        module.weight.data = q.dequantize(dtype)
        weights[name] = q
    missing, unexpected = model.load_state_dict(
        {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}, strict=False
    )
    quantized = {f"{n}.weight" for n in weights}
    missing = [k for k in missing if k not in quantized and not _is_tied(model, k)]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    return QuantizedModel(model.eval(), cfg, "loaded", weights)


def _is_tied(model: nn.Module, key: str) -> bool:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return (
        getattr(model.config, "tie_word_embeddings", False)
        and head is not None
        and key == next(n for n, m in model.named_modules() if m is head) + ".weight"
    )


# ----------------------------------------------------------------------------- the library side (parity)


def gptqmodel_available() -> bool:
    """Whether GPTQModel (and optimum, which transformers needs to load GPTQ checkpoints) can be imported."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("gptqmodel", "optimum"))


@contextlib.contextmanager
def _quiet(what: str) -> Iterator[None]:
    """Hold back GPTQModel's banners and per-layer progress (hundreds of lines); show them if `what` fails."""
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            yield
    except Exception as err:
        raise RuntimeError(f"{what} failed; its log ends with:\n{log.getvalue()[-3000:]}") from err


def _cap_gptqmodel_workers() -> None:
    """At most 4 GPTQModel CPU workers (it would start one per core), unless the user chose a number."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(1, min(os.cpu_count() or 1, 4))))


def quantize_with_gptqmodel(
    source: str | Path, calibration: torch.Tensor, cfg: QuantConfig, dest: str | Path, batch_size: int = 1
) -> Path:
    """Quantize the model in directory `source` (holding a tokenizer too) with GPTQModel, same settings as labkit."""
    _cap_gptqmodel_workers()
    with _quiet("GPTQModel quantization"):
        from gptqmodel import GPTQModel, QuantizeConfig

        qcfg = QuantizeConfig(
            bits=cfg.bits,
            group_size=cfg.group_size,
            sym=cfg.sym,
            desc_act=cfg.act_order,
            damp_percent=cfg.damp,
            act_group_aware=False,
        )
        model = GPTQModel.load(str(source), qcfg, device="cuda" if torch.cuda.is_available() else "cpu")
        calib = [{"input_ids": row[None], "attention_mask": torch.ones_like(row)[None]} for row in calibration]
        model.quantize(calib, batch_size=batch_size)
        with assets.atomic_directory(dest) as tmp:
            model.save(str(tmp))
    return Path(dest)


def load_with_transformers(path: str | Path, device: str = "cpu") -> nn.Module:
    """Load a GPTQ checkpoint the standard way: AutoModelForCausalLM.from_pretrained (GPTQModel's kernels)."""
    if not gptqmodel_available():
        raise ImportError(
            "loading GPTQ checkpoints through transformers needs GPTQModel and optimum: "
            "pip install 'labkit[gptq]' (see README)"
        )
    _cap_gptqmodel_workers()
    from transformers import AutoModelForCausalLM

    with _quiet(f"loading {path} through transformers"):
        return AutoModelForCausalLM.from_pretrained(str(path), device_map=device).eval()


def gptq_kernels(model: nn.Module) -> dict[str, int]:
    """Which GPTQModel kernel runs the model's quantized linears, counted by class and backend, e.g.
    {"MarlinLinear (gptq_marlin)": 210}: GPTQModel picks one per device at load time, silently."""
    from collections import Counter

    from gptqmodel.nn_modules.qlinear import BaseQuantLinear

    return dict(
        Counter(
            f"{type(m).__name__} ({m.SUPPORTS_BACKENDS[0].value})"
            for m in model.modules()
            if isinstance(m, BaseQuantLinear)
        )
    )
