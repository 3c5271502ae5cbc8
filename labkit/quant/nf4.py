"""NF4 from scratch (Dettmers et al., 2023, QLoRA): 4-bit NormalFloat codes, block-wise absmax scaling and
double quantization of the scales, in the byte layout of bitsandbytes.

- The grid: 16 values at quantiles of N(0, 1), scaled to [-1, 1], with an exact zero. Weights of a trained
  layer are roughly normal, so equal-probability bins waste fewer codes than RTN's equal-width ones.
- Block-wise absmax: the flattened weight is cut into blocks of 64; each block is divided by its largest
  |w|, and every value goes to its nearest grid point. No calibration data, no Hessian: it is RTN on a
  better grid, with a scale per 64 weights (32 bits each: 0.5 bits per weight).
- Double quantization: the fp32 scales, minus their mean, are themselves quantized to 8 bits in blocks
  of 256 on bitsandbytes' "dynamic" map, which brings the scales' cost to 8/64 + 32/(64·256) = 0.127 bits
  per weight: 4.127 bits per weight in all.
"""

from __future__ import annotations

import copy
import functools
import math
import time
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from labkit.torchutil import check_bool, check_int, check_module, decoder_linears, is_int

# The outermost quantile used for the grid's ends: midway between 1 - 1/(2·15) and 1 - 1/(2·16) (the two
# sides have 7 and 8 steps), written to 7 digits as the QLoRA code has it. The grid is computed from this
# number exactly as bitsandbytes did (float32 quantile positions, float32 normalization), so that both
# libraries hold the same 16 floats.
NF4_OFFSET = 0.9677083
BLOCKSIZE = 64
SCALE_BLOCKSIZE = 256  # scales per block of the double quantization
# Bits per weight with double quantization: the 4-bit code, an 8-bit scale code per BLOCKSIZE weights and an fp32
# scale per SCALE_BLOCKSIZE of those (the one fp32 offset per tensor aside): 4 + 8/64 + 32/(64·256) ≈ 4.127
NF4_BITS = 4 + 8 / BLOCKSIZE + 32 / (BLOCKSIZE * SCALE_BLOCKSIZE)


@functools.cache
def _nf4_grid() -> torch.Tensor:
    return nf4_grid()


@functools.cache
def _dynamic_grid() -> torch.Tensor:
    return dynamic_grid()


@functools.cache
def _byte_values() -> torch.Tensor:
    """[256, 2]: the two NF4 values each packed byte holds, high nibble first."""
    grid = _nf4_grid()
    return torch.stack([grid.repeat_interleave(16), grid.repeat(16)], dim=1)


def nf4_grid() -> torch.Tensor:
    """The 16 NF4 values, sorted: 7 negative and 8 positive quantiles of N(0, 1) and an exact zero, scaled to ±1."""
    positive = torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 9)[:-1].double())
    negative = -torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 8)[:-1].double())
    values = torch.cat([negative, torch.zeros(1, dtype=torch.float64), positive]).float().sort().values
    return values / values.max()


def dynamic_grid() -> torch.Tensor:
    """bitsandbytes' signed 8-bit "dynamic" map (Dettmers, 2016): 256 sorted values in [-1, 1], dense near zero.

    Each of 7 decades 10⁻⁶ … 10⁰ holds 2^i evenly spaced values (the midpoints of 2^i equal steps from 0.1 to
    1, times the decade), on both sides of zero; with 0 and 1 that makes 2·127 + 2 = 256 codes, whose spacing
    grows with magnitude: a relative, not absolute, precision — what scales spanning decades need.
    """
    parts = []
    for i in range(7):
        edges = torch.linspace(0.1, 1.0, 2**i + 1)
        parts.append((edges[:-1] + edges[1:]) / 2 * torch.tensor(10.0 ** (i - 6)))
    magnitudes = torch.cat(parts)
    return torch.cat([-magnitudes, magnitudes, torch.tensor([0.0, 1.0])]).sort().values


def _blocks(flat: torch.Tensor, blocksize: int) -> torch.Tensor:
    """The flat tensor as [blocks, blocksize] rows, the last one padded with zeros (which change no absmax)."""
    pad = -flat.numel() % blocksize
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, blocksize)


def quantize_blockwise(x: torch.Tensor, blocksize: int = SCALE_BLOCKSIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit codes on the dynamic map for a 1-D float tensor: each block divided by its absmax, each value to
    its nearest code (ties to the lower one). Returns (codes uint8 [n], absmax float32 [blocks])."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if x.numel() == 0:
        raise ValueError("x must hold at least one value, got an empty tensor")
    check_int("blocksize", blocksize, minimum=1)
    flat = x.detach().float().reshape(-1)
    blocks = _blocks(flat, blocksize)
    absmax = blocks.abs().amax(dim=1)
    normed = (blocks / absmax.clamp(min=torch.finfo(torch.float32).tiny)[:, None]).reshape(-1)[: flat.numel()]
    grid = _dynamic_grid()
    upper = torch.bucketize(normed, grid).clamp(1, len(grid) - 1)  # first code >= x
    lower = upper - 1
    nearer_upper = (grid[upper] - normed).abs() < (normed - grid[lower]).abs()
    return torch.where(nearer_upper, upper, lower).to(torch.uint8), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, blocksize: int = SCALE_BLOCKSIZE) -> torch.Tensor:
    """The values 8-bit dynamic codes stand for: grid value times its block's absmax."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(
            f"codes must be a uint8 tensor (quantize_blockwise's codes), got {getattr(codes, 'dtype', codes)!r}"
        )
    check_int("blocksize", blocksize, minimum=1)
    blocks = math.ceil(codes.numel() / blocksize)
    if not isinstance(absmax, torch.Tensor) or absmax.shape != (blocks,):
        raise ValueError(
            f"absmax must be a tensor of {blocks} block scale(s) for {codes.numel()} codes in blocks of {blocksize}, "
            f"got {getattr(absmax, 'shape', absmax)!r}"
        )
    values = _dynamic_grid().to(codes.device)[codes.long()]
    return (_blocks(values, blocksize) * absmax[:, None]).reshape(-1)[: codes.numel()]


@dataclass
class NF4Weight:
    """One weight in NF4: two 4-bit codes per byte (the first in the high nibble), and a scale per block —
    fp32, or 8-bit codes with an fp32 scale per 256 blocks and a common offset when double quantized."""

    packed: torch.Tensor  # uint8 [ceil(numel / 2)]
    absmax: torch.Tensor  # float32 [blocks], or uint8 [blocks] when double quantized
    shape: tuple[int, ...]
    blocksize: int = BLOCKSIZE
    absmax_scale: torch.Tensor | None = None  # float32 [ceil(blocks / 256)]: double quantization only
    offset: float = 0.0  # the mean scale, subtracted before double quantization

    @property
    def double_quant(self) -> bool:
        return self.absmax_scale is not None

    def codes(self) -> torch.Tensor:
        """The 4-bit codes, one per weight, in the flattened weight's order."""
        pairs = torch.stack([self.packed >> 4, self.packed & 0x0F], dim=1).reshape(-1)
        return pairs[: math.prod(self.shape)]

    def scales(self) -> torch.Tensor:
        """Each block's absmax in float32 (decoded from its 8-bit code when double quantized)."""
        if not self.double_quant:
            return self.absmax
        return dequantize_blockwise(self.absmax, self.absmax_scale) + self.offset

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the codes stand for: grid value times its block's scale, reshaped."""
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a torch floating-point dtype, got {dtype!r}")
        # one lookup per byte yields both its values: half the gathers of one per code, and no unpacking
        values = torch.nn.functional.embedding(self.packed.int(), _byte_values().to(self.packed.device))
        return values.view(-1, self.blocksize).mul_(self.scales()[:, None]).view(self.shape).to(dtype)

    @property
    def nbytes(self) -> int:
        """Stored bytes: the packed codes, the scales, and (double quantized) their scales and the offset."""
        extra = self.absmax_scale.numel() * 4 + 4 if self.double_quant else 0
        return self.packed.numel() + self.absmax.numel() * self.absmax.element_size() + extra


def quantize_nf4(
    weight: torch.Tensor,
    blocksize: int = BLOCKSIZE,
    double_quant: bool = True,
    scale_blocksize: int = SCALE_BLOCKSIZE,
) -> NF4Weight:
    """NF4 codes for a weight: each block of `blocksize` consecutive values (flattened, row-major) is divided
    by its absmax and rounded to the nearest of the 16 NF4 values; with `double_quant`, the block scales are
    quantized to 8 bits too. The codes, scales and layout are bitsandbytes' `quantize_4bit(quant_type="nf4")`."""
    if not isinstance(weight, torch.Tensor) or weight.numel() == 0 or not weight.is_floating_point():
        raise ValueError(f"expected a non-empty float tensor, got {getattr(weight, 'shape', weight)!r}")
    if not is_int(blocksize) or blocksize < 2 or blocksize % 2:
        raise ValueError(f"blocksize must be an even int >= 2, got {blocksize!r}")
    if not is_int(scale_blocksize) or scale_blocksize < 1:
        raise ValueError(f"scale_blocksize must be a positive int, got {scale_blocksize!r}")
    if not isinstance(double_quant, bool):
        raise ValueError(f"double_quant must be True or False, got {double_quant!r}")
    if weight.numel() % blocksize:
        raise ValueError(f"{weight.numel()} weights do not fill whole blocks of {blocksize}: pick a divisor")
    flat = weight.detach().float().cpu().reshape(-1)
    if not torch.isfinite(flat).all():
        raise ValueError("the weight holds NaN or inf values; quantizing them would hide the problem")
    blocks = flat.view(-1, blocksize)
    absmax = blocks.abs().amax(dim=1)
    normed = (blocks * (1.0 / absmax.clamp(min=1e-38))[:, None]).clamp(-1, 1).reshape(-1)
    grid = _nf4_grid()
    codes = torch.bucketize(normed, (grid[:-1] + grid[1:]) / 2).to(torch.uint8)  # nearest; ties to the lower
    packed = (codes[0::2] << 4) | codes[1::2]
    shape = tuple(weight.shape)
    if not double_quant:
        return NF4Weight(packed, absmax, shape, blocksize)
    offset = absmax.mean()
    scale_codes, scale_absmax = quantize_blockwise(absmax - offset, scale_blocksize)
    return NF4Weight(packed, scale_codes, shape, blocksize, scale_absmax, float(offset))


@dataclass
class NF4Model:
    """A model whose decoder linears hold NF4-dequantized weights, with the codes and the time it took."""

    model: nn.Module
    weights: dict[str, NF4Weight]
    seconds: float

    def bits_per_weight(self) -> float:
        """Stored bits per quantized weight, scales included."""
        return 8 * sum(w.nbytes for w in self.weights.values()) / sum(math.prod(w.shape) for w in self.weights.values())


@torch.no_grad()
def quantize_model_nf4(
    model: nn.Module,
    blocksize: int = BLOCKSIZE,
    double_quant: bool = True,
    *,
    inplace: bool = False,
    progress: bool = True,
) -> NF4Model:
    """NF4 for every nn.Linear inside the decoder blocks (embeddings and LM head stay, as in `quantize_model`);
    each weight is replaced by what its codes stand for (all codes are made before any weight is replaced, so a
    refused weight leaves an `inplace` model as it was). Needs no calibration data."""
    check_module(model)
    check_bool("inplace", inplace)
    check_bool("progress", progress)
    if not inplace:
        model = copy.deepcopy(model)
    linears = decoder_linears(model)
    start = time.perf_counter()
    bar = tqdm(linears.items(), desc="NF4", disable=not progress, leave=False)
    weights = {name: quantize_nf4(m.weight, blocksize, double_quant) for name, m in bar}
    for name, q in weights.items():
        m = linears[name]
        m.weight.data = q.dequantize(m.weight.dtype).to(m.weight.device)
    return NF4Model(model, weights, time.perf_counter() - start)
