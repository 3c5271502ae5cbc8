"""Number formats and the mixed-precision policy: what each mode computes in, and whether it needs a scaler."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

MODES = ("fp32", "tf32", "bf16", "fp16")


def format_facts(dtype: torch.dtype) -> dict[str, float | int | str]:
    """Bits, range and precision of a floating-point format (lab 02's table)."""
    info = torch.finfo(dtype)
    mantissa = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7, torch.float64: 52}[dtype]
    return {
        "format": str(dtype).removeprefix("torch."),
        "bits": info.bits,
        "exponent bits": info.bits - 1 - mantissa,
        "mantissa bits": mantissa,
        "max": info.max,
        "smallest normal": info.tiny,
        "smallest subnormal": info.smallest_normal * 2.0**-mantissa,
        "epsilon": info.eps,
    }


@dataclass(frozen=True)
class Policy:
    """How a training step runs: parameters stay fp32; the forward pass may autocast to a 16-bit type."""

    mode: str
    device_type: str
    autocast_dtype: torch.dtype | None  # None: no autocast
    use_scaler: bool  # fp16 gradients underflow without loss scaling
    tf32: bool  # let fp32 matmuls use TF32 tensor cores

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The forward-pass context for this policy (TF32 switched for the duration)."""
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        try:
            if self.autocast_dtype is None:
                yield
            else:
                with torch.autocast(self.device_type, dtype=self.autocast_dtype):
                    yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old

    def scaler(self) -> torch.amp.GradScaler:
        """A GradScaler, enabled only where the policy needs one (a disabled one is a no-op)."""
        return torch.amp.GradScaler(self.device_type, enabled=self.use_scaler)


def kept_fraction(values: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> float:
    """Share of the non-zero `values` that stay non-zero once multiplied by `scale` and cast to `dtype`:
    what a format (and a loss scale) keeps of real gradients instead of flushing them to zero."""
    nonzero = values[values != 0]
    if nonzero.numel() == 0:
        raise ValueError("no non-zero values to count")
    return ((nonzero * scale).to(dtype) != 0).float().mean().item()


def update_loss_scale(scale: float, good_steps: int, found_inf: bool, growth_factor: float = 2.0,
                      backoff_factor: float = 0.5, growth_interval: int = 2000) -> tuple[float, int]:
    """Dynamic loss scaling, one step: (new scale, new count of good steps), as torch's GradScaler does it.

    An overflow (inf/NaN gradients: the step is skipped) multiplies the scale by `backoff_factor` and
    restarts the count; `growth_interval` good steps in a row multiply it by `growth_factor`.
    """
    if found_inf:
        return scale * backoff_factor, 0
    if good_steps + 1 == growth_interval:
        return scale * growth_factor, 0
    return scale, good_steps + 1


def policy(mode: str, device: str | torch.device) -> Policy:
    """The precision policy for `mode` on `device`, or a clear error suggesting what works there."""
    if mode not in MODES:
        raise ValueError(f"unknown precision {mode!r}; choose one of {MODES}")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if mode == "fp16" and not cuda:
        raise ValueError("fp16 mixed precision with loss scaling is a GPU mode; on a CPU use 'bf16' (same range as fp32, "
                         "no loss scaler needed) or 'fp32'")
    if mode == "tf32" and not (cuda and torch.cuda.get_device_capability(dev)[0] >= 8):
        raise ValueError("TF32 needs an NVIDIA GPU of compute capability 8.0 (Ampere) or newer; use 'fp32' here")
    if mode == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        raise ValueError("this GPU has no native bf16; use 'fp16' (with loss scaling) or 'fp32'")
    return Policy(
        mode=mode,
        device_type=dev.type,
        autocast_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode),
        use_scaler=mode == "fp16",
        tf32=mode == "tf32",
    )
