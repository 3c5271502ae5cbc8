"""Weight quantization: round-to-nearest and GPTQ from scratch, saved as standard GPTQ checkpoints.

A quantized weight stores, per output row and per group of `group_size` input columns, a scale and a
zero point; each weight becomes an integer code q in [0, 2^bits - 1] standing for scale * (q - zero).

- `formats`: the formats (QuantConfig, QuantizedWeight), the grid, `quantize_rtn` (every weight to its
  nearest grid point; no data needed) and the stored bits per weight.
- `gptq`: `gptq_quantize` (Frantar et al., 2022). Quantize one input column at a time and spread its
  rounding error over the columns not yet quantized, in proportion to the inverse Hessian
  H = 2 X Xᵀ / n of the layer's calibration inputs, which minimizes ‖WX − ŴX‖² column by column.
- `nf4`: `quantize_nf4` / `quantize_model_nf4`, QLoRA's 4-bit NormalFloat with double quantization, from scratch
  in bitsandbytes' layout: 16 values at normal quantiles, one absmax per 64 weights, no calibration data.
- `awq`: `awq_model`, activation-aware per-channel scales (the idea of AWQ) searched on calibration data and
  folded into the operation before each layer, so that RTN (or GPTQ) afterwards rounds the salient weights finer.
- `model`: `quantize_model`, the whole decoder, block by block: calibration activations flow through the
  blocks already quantized, so each block corrects for the error of those before it. The sweep, the calibration
  windows, the input Hessians and the inverse-Hessian factor are `labkit.calibration`'s, shared with labkit.prune;
  `calibration_blocks`, `input_hessian`, `inverse_hessian_factor` and `TOKENS_PER_INPUT` are re-exported here.
- `packed`: `PackedLinear` / `pack_model` (GPTQ or RTN codes) and `NF4Linear` / `pack_model_nf4`, the codes kept
  packed in memory and dequantized on the fly, in the forward and the backward: a 4-bit base to train LoRA
  adapters on (QLoRA, lab 08).
- `checkpoint`: `save_gptq` / `load_gptq`, the classic "gptq" checkpoint (int32-packed qweight/qzeros,
  fp16 scales, g_idx, `quantization_config` in config.json) that transformers (through GPTQModel) and
  GPTQModel load; `load_gptq` also reads checkpoints that GPTQModel wrote.
- `interop`: GPTQModel and transformers on the library side, for parity.
- `cache`: `quantize_model_cached`, a whole-model quantization done once and reused (labs 07 and 08 share it).
- `landscape`: `ptq_landscape`, the model through every method above near 4 bits (and RTN at 8), scored alike.

The names below are those the labs, benchmarks and other labkit modules call as `quant.X`; everything else
is imported from its module (`from labkit.quant.gptq import ...`).
"""

from labkit.calibration import TOKENS_PER_INPUT, calibration_blocks, input_hessian, inverse_hessian_factor
from labkit.quant.awq import awq_model
from labkit.quant.cache import quantize_model_cached
from labkit.quant.formats import QuantConfig, bits_per_weight, grid, quantize_rtn
from labkit.quant.gptq import gptq_quantize, hessian_error, quantize_column
from labkit.quant.gptq_format import load_gptq, pack_rows, save_gptq
from labkit.quant.interop import (
    gptq_kernels,
    gptqmodel_available,
    import_bitsandbytes,
    load_with_transformers,
    quantize_with_gptqmodel,
)
from labkit.quant.landscape import ptq_landscape
from labkit.quant.nf4 import NF4_BITS, quantize_model_nf4, quantize_nf4
from labkit.quant.packed import NF4Linear, PackedLinear, pack_model, pack_model_nf4, store_embeddings
from labkit.quant.whole_model import METHODS, quantize_model, weight_bytes

__all__ = [
    "METHODS",
    "NF4_BITS",
    "NF4Linear",
    "TOKENS_PER_INPUT",
    "PackedLinear",
    "awq_model",
    "QuantConfig",
    "bits_per_weight",
    "calibration_blocks",
    "gptq_kernels",
    "gptq_quantize",
    "gptqmodel_available",
    "grid",
    "hessian_error",
    "import_bitsandbytes",
    "input_hessian",
    "inverse_hessian_factor",
    "load_gptq",
    "load_with_transformers",
    "pack_model",
    "pack_model_nf4",
    "pack_rows",
    "ptq_landscape",
    "quantize_column",
    "quantize_model",
    "quantize_model_cached",
    "quantize_model_nf4",
    "quantize_nf4",
    "quantize_rtn",
    "quantize_with_gptqmodel",
    "save_gptq",
    "store_embeddings",
    "weight_bytes",
]
