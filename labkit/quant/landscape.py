"""The post-training quantization landscape: one model through every method labkit holds, near one budget of
bits, each point scored by the same function — 8-bit RTN per channel, 4-bit RTN, NF4 with double quantization,
activation-aware scales (AWQ-style) + 4-bit RTN and GPTQ. Lab 07 draws it; benchmarks/quant_landscape.py saves it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from labkit.calibration import check_calibration
from labkit.quant.awq import GRID, awq_model, check_scalable
from labkit.quant.cache import quantize_model_cached
from labkit.quant.formats import QuantConfig
from labkit.quant.nf4 import BLOCKSIZE as NF4_BLOCKSIZE
from labkit.quant.nf4 import quantize_model_nf4
from labkit.quant.whole_model import check_full_rank, quantize_model
from labkit.torchutil import check_bool, check_int, check_module, decoder_linears


@dataclass
class LandscapePoint:
    """One method: stored bits per weight of the decoder linears, its score, the seconds it took to quantize."""

    method: str
    bits: float
    score: float
    seconds: float
    alphas: tuple[float, ...] = ()  # AWQ-style: the exponent chosen per layer group
    reused: bool = False  # GPTQ with `cache=True`: loaded from labkit's cache, `seconds` are the original run's


def ptq_landscape(
    model: nn.Module,
    calibration: torch.Tensor,
    score: Callable[[nn.Module], float],
    *,
    group_size: int = 64,
    act_order: bool = True,
    awq_blocks: int | None = None,
    awq_grid: int = GRID,
    cache: bool = False,
    progress: bool = True,
) -> Iterator[LandscapePoint]:
    """Quantize `model` (left unchanged) with each method in turn; the points come one by one, each as it is scored.

    `calibration` ([n, T] token ids) feeds GPTQ, and its first `awq_blocks` windows (all by default) the
    AWQ-style scale search; RTN and NF4 use no data. With `cache`, GPTQ goes through `quantize_model_cached`.
    With `progress`, the two calibrated methods (minutes each on a CPU) show a bar layer by layer.
    """
    check_module(model)
    check_calibration(model, calibration, "the quantization landscape")
    if not callable(score):
        raise TypeError(f"score must be a function of a model, got {type(score).__name__}")
    four_bit = QuantConfig(bits=4, group_size=group_size)
    linears = decoder_linears(model)
    widths = [linear.in_features for linear in linears.values()]
    if not widths:
        raise ValueError(f"no nn.Linear inside the decoder blocks of {type(model).__name__}: nothing to quantize")
    for width in widths:
        four_bit.width(width)  # a group size that does not fit fails here, before any method runs
    check_full_rank(calibration.numel(), max(widths))
    for name, linear in linears.items():
        if linear.weight.numel() % NF4_BLOCKSIZE:
            raise ValueError(f"{name}: {linear.weight.numel()} weights do not fill NF4's blocks of {NF4_BLOCKSIZE}")
    check_scalable(model, four_bit)  # AWQ-style scaling needs Llama-style blocks: refused here, not after three methods
    check_bool("act_order", act_order)
    check_bool("cache", cache)
    check_bool("progress", progress)
    awq_blocks = calibration.shape[0] if awq_blocks is None else awq_blocks
    check_int("awq_blocks", awq_blocks, minimum=1)
    if awq_blocks > calibration.shape[0]:
        raise ValueError(f"awq_blocks={awq_blocks}, but the calibration holds {calibration.shape[0]} windows")
    check_int("awq_grid", awq_grid, minimum=1)
    gptq_cfg = QuantConfig(bits=4, group_size=group_size, act_order=act_order)
    return _points(model, calibration[:awq_blocks], calibration, score, four_bit, gptq_cfg, awq_grid, cache, progress)


def _points(
    model: nn.Module,
    awq_calibration: torch.Tensor,
    calibration: torch.Tensor,
    score: Callable[[nn.Module], float],
    four_bit: QuantConfig,
    gptq_cfg: QuantConfig,
    awq_grid: int,
    cache: bool,
    progress: bool,
) -> Iterator[LandscapePoint]:
    q8 = quantize_model(model, QuantConfig(bits=8, group_size=-1), method="rtn", progress=False)
    yield LandscapePoint("RTN 8-bit per channel", q8.bits_per_weight(), score(q8.model), q8.seconds)
    del q8
    q4 = quantize_model(model, four_bit, method="rtn", progress=False)
    yield LandscapePoint(f"RTN {four_bit.label()}", q4.bits_per_weight(), score(q4.model), q4.seconds)
    del q4
    nf4 = quantize_model_nf4(model, progress=False)
    yield LandscapePoint("NF4 + double quant", nf4.bits_per_weight(), score(nf4.model), nf4.seconds)
    del nf4
    scaled = awq_model(model, awq_calibration, four_bit, grid=awq_grid, progress=progress)
    awq = quantize_model(scaled.model, four_bit, method="rtn", inplace=True, progress=False)
    yield LandscapePoint(
        f"AWQ-style + RTN {four_bit.label()}",
        awq.bits_per_weight(),
        score(awq.model),
        scaled.seconds + awq.seconds,
        alphas=tuple(r.alpha for r in scaled.records),
    )
    del scaled, awq
    if cache:
        gptq, reused = quantize_model_cached(model, gptq_cfg, calibration, progress=progress)
    else:
        gptq, reused = quantize_model(model, gptq_cfg, calibration, progress=progress), False
    yield LandscapePoint(
        f"GPTQ {gptq_cfg.label()}", gptq.bits_per_weight(), score(gptq.model), gptq.seconds, reused=reused
    )
