"""Lab 08's exercise checks: the LoRA forward and merge."""

from __future__ import annotations

from collections.abc import Callable

import torch

from labcourse.checks.core import CheckFailed, call_answer, goes_on_with, report_passed
from labkit import lora


def _adapted(
    weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, alpha: float, r: int
) -> lora.LoRALinear:
    """labkit's LoRALinear holding these tensors: the reference behind both exercises."""
    base = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer = lora.LoRALinear(base, r=r, alpha=alpha)
    with torch.no_grad():
        for param, value in ((base.weight, weight), (base.bias, bias), (layer.lora_A, a), (layer.lora_B, b)):
            if param is not None:
                param.copy_(value)
    return layer


def _lora_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    alpha: float,
    r: int,
) -> torch.Tensor:
    """labkit's answer to exercise 08.1, in the exercise's signature."""
    return _adapted(weight, bias, lora_A, lora_B, alpha, r)(x).detach()


def _merge_lora(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, alpha: float, r: int) -> torch.Tensor:
    """labkit's answer to exercise 08.2, in the exercise's signature."""
    return _adapted(weight, None, lora_A, lora_B, alpha, r).merged().weight.detach()


@goes_on_with(_lora_forward, "lora.LoRALinear")
def check_lora_forward(fn: Callable[..., torch.Tensor]) -> Callable:
    """Lab 08: fn(x, weight, bias, lora_A, lora_B, alpha, r) = x Wᵀ + b + (alpha / r) · x Aᵀ Bᵀ."""
    exercise = "exercise 08.1 (the LoRA forward)"
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 8, 5, 2), (2, 4, 16, 12, 4), (1, 6, 6, 1)]  # (*batch, in, out, r)
    for *batch, d_in, d_out, r in shapes:
        base = torch.nn.Linear(d_in, d_out)
        layer = lora.LoRALinear(base, r=r, alpha=2.0 * r + 1)  # alpha / r != 1, so a missing scale shows
        with torch.no_grad():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g))
        x = torch.randn(*batch, d_in, generator=g)
        expected = layer(x).detach()
        got = call_answer(
            exercise,
            fn,
            x,
            base.weight.detach(),
            base.bias.detach(),
            layer.lora_A.detach(),
            layer.lora_B.detach(),
            layer.alpha,
            r,
        )
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            raise CheckFailed(
                f"{exercise}: for x of shape {tuple(x.shape)} the output has shape "
                f"{tuple(expected.shape)}, got {getattr(got, 'shape', type(got).__name__)}"
            )
        if not torch.allclose(got, expected, rtol=1e-5, atol=1e-5):
            without_scale = (x @ base.weight.T + base.bias + x @ layer.lora_A.T @ layer.lora_B.T).detach()
            hint = (
                "the update must be scaled by alpha / r"
                if torch.allclose(got, without_scale, atol=1e-5)
                else "A is [r, in] and B is [out, r]: the update is x @ A.T @ B.T (A first), plus the base x @ W.T + b"
            )
            raise CheckFailed(
                f"{exercise}: wrong output for x {tuple(x.shape)}, in={d_in}, out={d_out}, r={r} "
                f"(largest difference {(got - expected).abs().max():.3g}); hint: {hint}"
            )
    return report_passed(exercise, len(shapes))


@goes_on_with(_merge_lora, "lora.LoRALinear.merged")
def check_lora_merge(fn: Callable[..., torch.Tensor]) -> Callable:
    """Lab 08: fn(weight, lora_A, lora_B, alpha, r) is the merged weight W + (alpha / r) · B A."""
    exercise = "exercise 08.2 (merging an adapter)"
    g = torch.Generator().manual_seed(1)
    for d_in, d_out, r in [(8, 5, 2), (16, 12, 4), (6, 6, 1)]:
        layer = lora.LoRALinear(torch.nn.Linear(d_in, d_out), r=r, alpha=2.0 * r + 1)
        with torch.no_grad():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g))
        weight, a, b = layer.base.weight.detach(), layer.lora_A.detach(), layer.lora_B.detach()
        expected = layer.merged().weight.detach()
        got = call_answer(exercise, fn, weight.clone(), a, b, layer.alpha, r)
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            raise CheckFailed(
                f"{exercise}: the merged weight has the base weight's shape {tuple(expected.shape)}, "
                f"got {getattr(got, 'shape', type(got).__name__)}"
            )
        if not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
            hint = (
                "scale the update by alpha / r"
                if torch.allclose(got, weight + b @ a, atol=1e-6)
                else "ΔW = (alpha / r) · B @ A, of shape [out, in]; add it to W"
            )
            raise CheckFailed(
                f"{exercise}: in={d_in}, out={d_out}, r={r}: wrong merged weight (largest difference "
                f"{(got - expected).abs().max():.3g}); hint: {hint}"
            )
    return report_passed(exercise, 3)
