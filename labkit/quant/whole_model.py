"""A whole decoder quantized block by block: calibration activations flow through the blocks already
quantized, so each block corrects for the error of those before it (the sweep is `labkit.calibration`'s)."""

from __future__ import annotations

import copy
import math
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from labkit.calibration import TOKENS_PER_INPUT, calibrated_sweep, check_calibration
from labkit.quant.formats import QuantConfig, QuantizedWeight, bits_per_weight, quantize_rtn
from labkit.quant.gptq import gptq_quantize, relative_errors
from labkit.torchutil import check_bool, check_int, check_module, decoder_linears, eval_mode

METHODS = ("rtn", "gptq")


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

    def bits_per_weight(self) -> float:
        """Stored bits per quantized weight, as `weight_bytes` counts them packed (scales, zeros and g_idx included)."""
        sizes = weight_bytes(self)
        return 8 * sizes["quantized"] / sizes["weights"]


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
    is a [n, T] tensor of token ids (see `labkit.calibration.calibration_blocks`) with at least as many
    tokens as the widest layer has inputs, or its Hessian is rank-deficient — and many more in practice:
    with too few, GPTQ fits the calibration tokens and does worse than RTN on other text (lab 07 measures where).
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
    linears = _quantizable_linears(model, cfg)
    tokens = _calibration_tokens(model, calibration, linears) if method == "gptq" else 0

    if not inplace:
        model = copy.deepcopy(model)
    result = QuantizedModel(model, cfg, method, {}, calibration_tokens=tokens)
    start = time.perf_counter()
    with eval_mode(model):
        if method == "rtn":
            _rtn_layers(result, progress)
        else:
            _gptq_blocks(result, calibration, batch_size, progress)
    result.seconds = time.perf_counter() - start
    return result


def _quantizable_linears(model: nn.Module, cfg: QuantConfig) -> list[nn.Linear]:
    """The decoder's linears, checked before any work: cfg's groups fit each one and its weight is finite."""
    linears = decoder_linears(model)
    for name, m in linears.items():
        cfg.width(m.in_features)  # fail before any work if a group size does not fit
        if not torch.isfinite(m.weight).all():  # or RTN would stop at this layer, the ones before it quantized
            raise ValueError(f"the weight of {name} holds NaN or inf values: nothing was quantized")
    return list(linears.values())


def check_full_rank(tokens: int, widest: int) -> None:
    """Refuse fewer calibration tokens than the widest layer has inputs: its input Hessian would be singular."""
    if tokens < widest:
        raise ValueError(
            f"{tokens} calibration tokens are too few: a layer with {widest} inputs needs at "
            f"least {widest} for a full-rank Hessian (GPTQ used 128 x 2048)"
        )


def _calibration_tokens(model: nn.Module, calibration: torch.Tensor | None, linears: list[nn.Linear]) -> int:
    """How many calibration tokens GPTQ gets: an error below a full-rank Hessian for the widest layer, a warning
    below TOKENS_PER_INPUT per input."""
    check_calibration(model, calibration, "GPTQ")
    tokens = calibration.numel()
    widest = max(m.in_features for m in linears)
    check_full_rank(tokens, widest)
    if tokens < TOKENS_PER_INPUT * widest:
        warnings.warn(
            f"{tokens} calibration tokens for a layer with {widest} inputs: under "
            f"{TOKENS_PER_INPUT * widest} the Hessian is nearly singular, GPTQ fits the calibration "
            "text and its result changes with the CPU's rounding; pass more tokens",
            stacklevel=3,  # the line that called quantize_model
        )
    return tokens


def _rtn_layers(result: QuantizedModel, progress: bool) -> None:
    """Round every decoder linear of result.model to the nearest code, one at a time."""
    for name, m in tqdm(decoder_linears(result.model).items(), desc="RTN", disable=not progress, leave=False):
        t0 = time.perf_counter()
        q = quantize_rtn(m.weight, result.config)
        _store(result, name, m, q, None, None, time.perf_counter() - t0)


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
