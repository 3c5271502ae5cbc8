"""Activation-aware scaling before round-to-nearest, the idea of AWQ (Lin et al., 2024): a few input channels
carry much larger activations than the rest, and their weights matter more. Multiply those weight columns
by s > 1 before rounding (so their relative rounding error shrinks) and divide the layer's input by s (so
the product is unchanged): Ŵ = Q(W·diag(s))·diag(s)⁻¹. The scale is s_j = rms(x_j)^α, with α searched on a
grid to minimize the layer's output error on calibration inputs; α = 0 is plain RTN, so the search never
does worse than RTN on the calibration data.

The 1/s is folded into the operation before the layer — the RMSNorm's weight for q/k/v and gate/up, the rows
of up_proj for down_proj — so the model stays a plain fp model, exactly equivalent, that any RTN or GPTQ
quantizer then rounds. (AWQ also searches a clipping range per group; this keeps to the scaling.)
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from labkit.calibration import calibrated_sweep, check_calibration
from labkit.quant.formats import QuantConfig, quantize_rtn
from labkit.quant.gptq import relative_errors
from labkit.torchutil import check_bool, check_int, check_module, decoder_layers, eval_mode, is_int

GRID = 20  # α ∈ {0, 1/20, …, 19/20}, as in AWQ
# Llama-style blocks: the layers that read one input, and the operation whose output that input is. o_proj's
# input comes out of attention, not straight from v_proj (with grouped-query attention the shapes differ
# too), so, as in AWQ's own code for such models, o_proj is not scaled.
PREDECESSORS = {
    "self_attn.q_proj": "input_layernorm",
    "mlp.gate_proj": "post_attention_layernorm",
    "mlp.down_proj": "mlp.up_proj",
}


def _check_grid(grid: int) -> None:
    if not is_int(grid) or grid < 1:
        raise ValueError(f"grid must be a positive int, got {grid!r}")


def _check_cfg(cfg: QuantConfig) -> None:
    if not isinstance(cfg, QuantConfig):
        raise TypeError(f"cfg must be a QuantConfig, got {type(cfg).__name__}")


def _check_layer(weight: torch.Tensor, hessian: torch.Tensor) -> None:
    """A 2-D weight [out, in] and the square Hessian [in, in] of its inputs."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor [out, in], got {getattr(weight, 'shape', weight)!r}")
    _check_hessian(hessian)
    if hessian.shape[0] != weight.shape[1]:
        raise ValueError(f"hessian must be [{weight.shape[1]}, {weight.shape[1]}], got {tuple(hessian.shape)}")


def _check_hessian(hessian: torch.Tensor) -> None:
    if not isinstance(hessian, torch.Tensor) or hessian.dim() != 2 or hessian.shape[0] != hessian.shape[1]:
        raise ValueError(f"hessian must be a square 2-D tensor [in, in], got {getattr(hessian, 'shape', hessian)!r}")


def activation_scale(hessian: torch.Tensor) -> torch.Tensor:
    """Each input channel's root-mean-square activation, from H = 2 X Xᵀ / n: sqrt(H_jj / 2)."""
    _check_hessian(hessian)
    return (hessian.diagonal().double() / 2).clamp(min=0).sqrt().float()


def scaled_rtn(weight: torch.Tensor, scale: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    """Q(W·diag(s))·diag(s)⁻¹: what the layer computes once s is folded into its input and W·s is rounded."""
    _check_cfg(cfg)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor [out, in], got {getattr(weight, 'shape', weight)!r}")
    if not isinstance(scale, torch.Tensor) or scale.shape != weight.shape[1:]:
        raise ValueError(
            f"scale must be a tensor of {weight.shape[1]} input-channel scales, got {getattr(scale, 'shape', scale)!r}"
        )
    return quantize_rtn(weight * scale, cfg).dequantize() / scale


def search_scale(
    weight: torch.Tensor, hessian: torch.Tensor, cfg: QuantConfig, grid: int = GRID
) -> tuple[torch.Tensor, float, list[float]]:
    """The per-input-channel scale s = rms(x)^α (normalized so that max·min = 1) whose scaled RTN has the least
    output error tr(ΔW H ΔWᵀ) on the calibration inputs; returns (s, α, the error at every α tried)."""
    _check_cfg(cfg)
    _check_layer(weight, hessian)
    _check_grid(grid)
    w = weight.detach().float()
    act = activation_scale(hessian).clamp(min=1e-8)
    error = relative_errors(w, hessian)
    best, errors = None, []
    for step in range(grid):
        alpha = step / grid
        s = act**alpha
        s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1 (on a log scale)
        err = error(scaled_rtn(w, s, cfg))
        errors.append(err)
        if best is None or err < best[2]:
            best = (s, alpha, err)
    return best[0], best[1], errors


@dataclass
class ScaleRecord:
    """One group of layers sharing an input: its α, its output error and plain RTN's (α = 0) on calibration."""

    names: list[str]
    alpha: float
    error: float
    rtn_error: float


@dataclass
class AWQResult:
    """The model with scales folded in (still full precision: quantize it next), and one record per group."""

    model: nn.Module
    records: list[ScaleRecord] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0


def check_scalable(model: nn.Module, cfg: QuantConfig) -> None:
    """Refuse, before any scale is folded, a model with no layer to scale, a layer without the operation its scale
    folds into, or a layer width the quantizer's groups do not divide."""
    found = 0
    for i, block in enumerate(decoder_layers(model)):
        named = dict(block.named_modules())
        for layer, previous in PREDECESSORS.items():
            if not isinstance(named.get(layer), nn.Linear):
                continue
            found += 1
            if getattr(named.get(previous), "weight", None) is None:
                raise ValueError(f"block {i} has {layer} but no {previous} with a weight to fold its scale into")
            cfg.width(named[layer].in_features)  # a group size that does not fit fails here, not after a fold
    if not found:
        raise ValueError(
            f"nothing to scale in {type(model).__name__}: AWQ-style scaling looks for Llama-style linears "
            f"({', '.join(PREDECESSORS)}) inside the decoder blocks"
        )


@torch.no_grad()
def _fold(modules: list[nn.Linear], previous: nn.Module, scale: torch.Tensor) -> None:
    """Columns of the layers times s, the output of the operation before them divided by s: the same function."""
    for m in modules:
        m.weight.mul_(scale.to(m.weight)[None, :])
    previous.weight.div_(scale.to(previous.weight).view(-1, *[1] * (previous.weight.dim() - 1)))
    if getattr(previous, "bias", None) is not None:
        previous.bias.div_(scale.to(previous.bias))


def awq_model(
    model: nn.Module,
    calibration: torch.Tensor,
    cfg: QuantConfig,
    *,
    grid: int = GRID,
    batch_size: int = 8,
    inplace: bool = False,
    progress: bool = True,
) -> AWQResult:
    """Search and fold activation-aware scales into every decoder block, group by group on `calibration` ([n, T]
    token ids), for the quantizer `cfg` describes. The returned model computes what the source model computes;
    quantize it with `quantize_model(..., method="rtn")` (or GPTQ). The source model is copied unless `inplace`."""
    check_module(model)
    _check_cfg(cfg)
    check_calibration(model, calibration, "AWQ-style scaling")
    _check_grid(grid)
    check_int("batch_size", batch_size, minimum=1)
    check_bool("inplace", inplace)
    check_bool("progress", progress)
    check_scalable(model, cfg)
    if not inplace:
        model = copy.deepcopy(model)
    result = AWQResult(model)

    def solve(names: list[str], modules: list[nn.Linear], hessian: torch.Tensor) -> None:
        relative = next((r for r in PREDECESSORS if names[0].endswith(f".{r}")), None)
        if relative is None:
            result.skipped.extend(names)
            return
        previous = model.get_submodule(names[0][: -len(relative)] + PREDECESSORS[relative])
        stacked = torch.cat([m.weight for m in modules])
        scale, alpha, errors = search_scale(stacked, hessian, cfg, grid)
        _fold(modules, previous, scale)
        result.records.append(ScaleRecord(names, alpha, min(errors), errors[0]))

    start = time.perf_counter()
    with eval_mode(model):
        calibrated_sweep(model, calibration, solve, batch_size=batch_size, desc="AWQ scales", progress=progress)
    result.seconds = time.perf_counter() - start
    return result
