"""A whole decoder quantized block by block: calibration activations flow through the blocks already
quantized, so each block corrects for the error of those before it."""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from labkit.data import pack_blocks
from labkit.evaluate import token_stream
from labkit.quant.formats import QuantConfig, QuantizedWeight, bits_per_weight, quantize_rtn
from labkit.quant.gptq import gptq_quantize, relative_errors
from labkit.torchutil import (
    check_bool,
    check_int,
    check_module,
    check_token_ids,
    decoder_layers,
    eval_mode,
    is_int,
    module_name,
    vocab_size,
)

METHODS = ("rtn", "gptq")
# Calibration tokens per input of the widest layer below which GPTQ fits noise. Measured on SmolLM2's
# layers.0.mlp.down_proj (1536 inputs): with 2048 tokens its Hessian has 489 eigenvalues under 1e-3 of
# its mean diagonal and GPTQ's held-out error is RTN's (5.0e-3 vs 5.1e-3); the whole model's 4-bit g64
# perplexity then ranged from 26.4 to 31.0 with the CPU and thread count (22 % of the codes changed
# between 1 and 2 threads). With 8192 tokens none is that small and the held-out error halves (2.9e-3);
# with the Hessian summed and factored in float64 too, 1 and 2 threads give identical codes.
TOKENS_PER_INPUT = 4


def calibration_blocks(tokenizer, texts: Sequence[str], n_blocks: int, block_size: int, seed: int = 0) -> torch.Tensor:
    """`n_blocks` random non-overlapping windows of `block_size` tokens from the EOS-joined texts: [n, block_size]."""
    if isinstance(texts, str):
        raise TypeError("texts must be a list of texts, got one str: pass [text]")
    for name, value in (("n_blocks", n_blocks), ("block_size", block_size), ("seed", seed)):
        if not is_int(value):
            raise TypeError(f"{name} must be an int, got {value!r}")
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


def check_calibration(model: nn.Module, calibration: Any, who: str) -> None:
    """Calibration must be token ids of `model`'s vocabulary as a non-empty [n_blocks, block_size] long tensor."""
    if not isinstance(calibration, torch.Tensor) or calibration.dim() != 2 or calibration.dtype != torch.long:
        raise ValueError(
            f"{who} needs calibration token ids as a [n_blocks, block_size] long tensor "
            "(labkit.quant.calibration_blocks makes one)"
        )
    if calibration.numel() == 0:
        raise ValueError(
            f"{who} needs at least one calibration block of at least one token, got shape {tuple(calibration.shape)}"
        )
    check_token_ids(calibration, vocab_size(model), "calibration ids")


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
    `gptq.inverse_hessian_factor`). The sums take ~25 s instead of ~14 s per SmolLM2 run at 8192 tokens on 2 cores.
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
    check_module(model)
    module = dict(model.named_modules()).get(module_name)
    if not isinstance(module, nn.Linear):
        raise ValueError(f"{module_name!r} is not an nn.Linear of {type(model).__name__}")
    check_calibration(model, calibration, "input_hessian")
    check_int("batch_size", batch_size, minimum=1)
    hook = _HessianHook(module)
    try:
        _forward_until_stopped(model, calibration, batch_size)
    finally:
        hessian, count = hook.result()
    if count == 0:
        raise ValueError(f"{module_name!r} saw no input: the model's forward does not reach it")
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
    check_module(model)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(cfg, QuantConfig):
        raise TypeError(f"cfg must be a QuantConfig, got {type(cfg).__name__}")
    check_int("batch_size", batch_size, minimum=1)
    check_bool("inplace", inplace)
    check_bool("progress", progress)
    layers = decoder_layers(model)
    linears = [m for block in layers for m in block.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(
            f"no nn.Linear inside the decoder blocks of {type(model).__name__} "
            "(GPT-2's Conv1D layers are not supported)"
        )
    for m in linears:
        cfg.width(m.in_features)  # fail before any work if a group size does not fit
        if not torch.isfinite(m.weight).all():  # or RTN would stop at this layer, the ones before it quantized
            raise ValueError(f"the weight of {module_name(model, m)} holds NaN or inf values: nothing was quantized")
    tokens = 0
    if method == "gptq":
        check_calibration(model, calibration, "GPTQ")
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
    prefix = module_name(model, layers)
    result = QuantizedModel(model, cfg, method, {}, calibration_tokens=tokens)
    start = time.perf_counter()
    with eval_mode(model):
        if method == "rtn":
            for i, block in enumerate(tqdm(layers, desc="RTN", disable=not progress, leave=False)):
                for name, m in block.named_modules():
                    if isinstance(m, nn.Linear):
                        t0 = time.perf_counter()
                        q = quantize_rtn(m.weight, cfg)
                        _store(result, f"{prefix}.{i}.{name}", m, q, None, None, time.perf_counter() - t0)
        else:
            _gptq_blocks(result, calibration, batch_size, progress)
    result.seconds = time.perf_counter() - start
    return result


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
    error = relative_errors(original, hessian) if hessian is not None else lambda _: float("nan")
    err = error(deq)
    rtn_err = error(rtn.dequantize().to(original.device)) if rtn is not None else None
    module.weight.data = deq.to(original.dtype)
    result.weights[name] = q
    result.layers.append(LayerRecord(name, tuple(original.shape), err, rtn_err, seconds))


Solve = Callable[[list[str], list[nn.Linear], torch.Tensor], None]


@torch.no_grad()
def calibrated_sweep(
    model: nn.Module,
    calibration: torch.Tensor,
    solve: Solve,
    *,
    batch_size: int = 8,
    desc: str = "calibrating",
    progress: bool = True,
) -> None:
    """Walk the decoder block by block on `calibration` ([n, T] token ids), calling solve(names, modules, H)
    once per group of linears that read the same input (q/k/v; o; gate/up; down), with their names in the
    model and H = 2 X Xᵀ / n of that input. `solve` may change the weights: the next group's inputs, and the next
    block's, are computed with the changed ones, so each layer corrects for the layers solved before it.
    GPTQ (`quantize_model`), SparseGPT and Wanda (labkit.prune) are such solves."""
    check_module(model)
    check_calibration(model, calibration, "the calibrated sweep")
    if not callable(solve):
        raise TypeError(f"solve must be callable as solve(names, modules, hessian), got {solve!r}")
    check_int("batch_size", batch_size, minimum=1)
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    inputs, kwargs_list = _first_block_inputs(model, layers, calibration, batch_size)
    bar = tqdm(
        total=sum(1 for b in layers for m in b.modules() if isinstance(m, nn.Linear)),
        desc=desc,
        disable=not progress,
        leave=False,
    )
    try:
        for i, block in enumerate(layers):
            named = dict(block.named_modules())
            for group in _sequential_groups(block, inputs[0], kwargs_list[0]):
                hessian, _ = _input_hessian(block, named[group[0]], inputs, kwargs_list)
                bar.set_postfix_str(f"{i}.{'+'.join(n.rsplit('.', 1)[-1] for n in group)}")
                solve([f"{prefix}.{i}.{n}" for n in group], [named[n] for n in group], hessian)
                bar.update(len(group))
            inputs = [_block_output(block(x, **kw)) for x, kw in zip(inputs, kwargs_list)]
    finally:
        bar.close()


def _gptq_blocks(result: QuantizedModel, calibration: torch.Tensor, batch_size: int, progress: bool) -> None:
    cfg = result.config

    def solve(names: list[str], modules: list[nn.Linear], hessian: torch.Tensor) -> None:
        # The layers of a group read the same input: one Hessian serves all, and since GPTQ treats
        # every output row alone given H, one pass over their stacked rows quantizes them all.
        t0 = time.perf_counter()
        stacked = gptq_quantize(torch.cat([m.weight for m in modules]), hessian, cfg)
        share = (time.perf_counter() - t0) / stacked.codes.shape[0]  # seconds per row
        start = 0
        for name, m in zip(names, modules):
            rows = m.weight.shape[0]
            q, rtn = stacked.rows(start, start + rows), quantize_rtn(m.weight, cfg)
            _store(result, name, m, q, hessian, rtn, share * rows)
            start += rows

    calibrated_sweep(result.model, calibration, solve, batch_size=batch_size, desc="GPTQ", progress=progress)


def weight_bytes(qm: QuantizedModel) -> dict[str, int]:
    """Bytes of the quantized layers as stored packed, against the same layers in fp16 and fp32."""
    if not isinstance(qm, QuantizedModel):
        raise TypeError(f"qm must be a QuantizedModel (quantize_model's result), got {type(qm).__name__}")
    packed = sum(
        math.ceil(bits_per_weight(qm.config, q.codes.shape[1], q.codes.shape[0]) * q.codes.numel() / 8)
        for q in qm.weights.values()
    )
    numel = sum(q.codes.numel() for q in qm.weights.values())
    return {"quantized": packed, "fp16": 2 * numel, "fp32": 4 * numel, "weights": numel}
