"""Tolerances for comparing two computations that agree in exact arithmetic but not in floating point.

Two kernels that add the same k terms in different orders (another SIMD width, another thread count,
another CPU) may differ by up to 2·γ_k·Σ|terms|, γ_k = k·u / (1 − k·u), u the unit roundoff
(Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1). In fp32 (u ≈ 6e-8) that is ~1e-5
relative for k in the hundreds, well above `assert_close`'s fp32 default (1.3e-6), so the suite never
compares two different fp32 kernels at the default. It either bounds the difference with `reorder_bound`
(one reduction), or, where exactness is the point (our implementation against a library's), runs both
sides in float64 and compares with `FLOAT64`: there the same arithmetic agrees to ~1e-13 in these tiny
models, and a real mistake (a missing scale, a wrong bias, a swapped index) shows at 1e-3 or more.
"""

from __future__ import annotations

import torch

FLOAT64 = {"rtol": 1e-9, "atol": 1e-9}  # ~1e6 float64 roundoffs: all of these small models' reductions fit


def reorder_bound(k: int, abs_terms_sum: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Largest difference between two summation orders of k terms whose absolute values add to `abs_terms_sum`."""
    u = torch.finfo(dtype).eps / 2
    return 2 * (k * u / (1 - k * u)) * abs_terms_sum


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> None:
    """Elementwise |actual − expected| ≤ bound, naming the worst element's ratio when it fails."""
    excess = (actual - expected).abs() / bound.clamp(min=torch.finfo(bound.dtype).tiny)
    where = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
    assert excess.max() <= 1, f"difference {excess.max().item():.2f}x its floating-point bound at index {where}"
