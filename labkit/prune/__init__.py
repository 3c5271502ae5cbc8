"""Pruning (lab 06): magnitude masks (per layer, global, N:M), structured pruning into a smaller dense model,
sparsity counted from the real zeros, per-layer sensitivity, and prune-then-recover fine-tuning.
One module per idea:

- `masks`: which weights, keep-masks, applying them (held through fine-tuning), saving them, counting
  the zeros. The base: the others import it.
- `recover`: sensitivity scans and prune-and-recover (fine-tuning with labkit.train).
- `calibrated`: Wanda and SparseGPT from scratch, calibrated block by block as GPTQ is (on labkit.calibration's
  sweep and inverse-Hessian factor).
- `structured`: whole MLP channels (torch-pruning) and attention heads by key/value group.
- `kernels`: torch's 2:4 sparse kernels on an Ampere-or-newer GPU.

Re-exported here: the names the notebooks, benchmarks and other labkit modules call as `prune.X`.
"""

from labkit.prune.calibrated import calibrated_prune, sparsegpt_weight, wanda_mask
from labkit.prune.kernels import semi_structured_speedup, semi_structured_support, to_semi_structured
from labkit.prune.masks import (
    SCOPES,
    LayerSparsity,
    is_nm_sparse,
    magnitude_masks,
    magnitude_prune,
    nm_masks,
    nm_prune,
    overall_sparsity,
    prunable_weights,
    sparsity_report,
)
from labkit.prune.recover import groups_by, prune_and_recover, sensitivity
from labkit.prune.structured import IMPORTANCES, model_shapes, prune_attention_heads, prune_mlp_channels

__all__ = [
    "calibrated_prune",
    "IMPORTANCES",
    "SCOPES",
    "LayerSparsity",
    "groups_by",
    "is_nm_sparse",
    "magnitude_masks",
    "magnitude_prune",
    "model_shapes",
    "nm_masks",
    "nm_prune",
    "overall_sparsity",
    "prunable_weights",
    "prune_and_recover",
    "prune_attention_heads",
    "prune_mlp_channels",
    "semi_structured_speedup",
    "semi_structured_support",
    "sensitivity",
    "sparsegpt_weight",
    "sparsity_report",
    "to_semi_structured",
    "wanda_mask",
]
