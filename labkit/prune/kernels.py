"""2:4 sparse kernels (GPU): where torch's semi-structured kernels run, swapping a 2:4-pruned model's
weights for them, and one linear layer timed dense vs sparse."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

from labkit import bench
from labkit.prune.masks import is_nm_sparse, nm_masks, prunable_weights


def semi_structured_support(device: str | torch.device | None = None) -> str | None:
    """None if torch's 2:4 sparse kernels run on `device`, else the reason they do not."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return f"2:4 sparse kernels run on NVIDIA GPUs only (compute capability 8.0+); this is {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"2:4 sparse kernels need compute capability 8.0 (Ampere) or newer; this GPU has {major}.{minor}"
    return None


def semi_structured_backend() -> str:
    """Which 2:4 kernels run: 'cusparselt' when this torch has NVIDIA's cuSPARSELt (what
    to_sparse_semi_structured assumes), else 'cutlass', torch's own kernels, instead of a failure."""
    return "cusparselt" if torch.backends.cusparselt.is_available() else "cutlass"


def _semi_structured(weight: torch.Tensor) -> torch.Tensor:
    kind = {"cusparselt": SparseSemiStructuredTensorCUSPARSELT, "cutlass": SparseSemiStructuredTensorCUTLASS}
    return kind[semi_structured_backend()].from_dense(weight)


def to_semi_structured(model: nn.Module, **selection: Any) -> int:
    """Swap every selected 2:4-sparse fp16/bf16 weight for a torch.sparse semi-structured tensor (inference, GPU)."""
    reason = semi_structured_support(next(model.parameters()).device)
    if reason:
        raise RuntimeError(reason)
    weights = prunable_weights(model, **selection)
    wrong = [n for n, w in weights.items() if w.dtype not in (torch.float16, torch.bfloat16) or not is_nm_sparse(w)]
    if wrong:
        raise ValueError(
            f"{len(wrong)} weights are not 2:4-sparse fp16/bf16 (e.g. {wrong[:2]}): "
            "cast the model with .half() and run nm_prune(model, 2, 4) first"
        )
    modules = dict(model.named_modules())
    for name, w in weights.items():
        modules[name].weight = nn.Parameter(_semi_structured(w.detach()), requires_grad=False)
    return len(weights)


def semi_structured_speedup(
    out_features: int,
    in_features: int,
    tokens: int,
    *,
    dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cuda",
    warmup: int = 5,
    repeats: int = 20,
) -> dict[str, float]:
    """Time one 2:4-pruned linear layer dense and as a torch.sparse semi-structured tensor (medians)."""
    reason = semi_structured_support(device)
    if reason:
        raise RuntimeError(reason)
    g = torch.Generator(device).manual_seed(0)
    weight = torch.randn(out_features, in_features, device=device, dtype=dtype, generator=g)
    weight *= nm_masks({"w": weight})["w"]
    x = torch.randn(tokens, in_features, device=device, dtype=dtype, generator=g)
    sparse = _semi_structured(weight)
    error = (torch.nn.functional.linear(x, sparse) - torch.nn.functional.linear(x, weight)).abs().max().item()
    t = bench.time_interleaved(
        {
            "dense": lambda: torch.nn.functional.linear(x, weight),
            "sparse": lambda: torch.nn.functional.linear(x, sparse),
        },
        warmup=warmup,
        repeats=repeats,
        device=device,
    )
    return {
        "dense_s": t["dense"].median,
        "sparse_s": t["sparse"].median,
        "speedup": t["dense"].median / t["sparse"].median,
        "max_abs_error": error,
        "backend": semi_structured_backend(),
    }
