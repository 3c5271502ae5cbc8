"""Number formats and the mixed-precision policy: what each mode computes in, and whether it needs a scaler."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from labkit.torchutil import device_of

MODES = ("fp32", "tf32", "bf16", "fp16")


MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7, torch.float64: 52}


def format_facts(dtype: torch.dtype) -> dict[str, float | int | str]:
    """Bits, range and precision of a floating-point format (lab 02's table)."""
    if dtype not in MANTISSA_BITS:
        raise ValueError(f"dtype must be one of torch.float32, float16, bfloat16, float64; got {dtype!r}")
    info = torch.finfo(dtype)
    mantissa = MANTISSA_BITS[dtype]
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
        """The forward-pass context: autocast to the policy's 16-bit type, if it has one."""
        if self.autocast_dtype is None:
            yield
        else:
            with torch.autocast(self.device_type, dtype=self.autocast_dtype):
                yield

    def matmul_precision(self) -> contextlib.AbstractContextManager[None]:
        """The whole-step context: TF32 for fp32 matmuls on or off. It must wrap the backward too, which
        runs outside autocast and does two thirds of the step's matmuls."""
        return tf32(self.tf32)

    def scaler(self, growth_interval: int = 2000) -> torch.amp.GradScaler:
        """A GradScaler, enabled only where the policy needs one (a disabled one is a no-op); it starts at 2^16
        and doubles the scale after `growth_interval` steps without an overflow, torch's default being 2000."""
        return torch.amp.GradScaler(self.device_type, growth_interval=growth_interval, enabled=self.use_scaler)


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """Let fp32 matmuls use TF32 tensor cores (or not) for the duration; restores the previous setting."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def cuda_problem(device: str | torch.device) -> str | None:
    """Why CUDA `device` cannot be used here (a CPU-only torch, no GPU visible), or None if it can."""
    dev = torch.device(device)
    if dev.type != "cuda" or torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"CUDA was asked for, but this torch ({torch.__version__}) is a CPU-only build"
    return (
        f"CUDA was asked for, but torch (built for CUDA {torch.version.cuda}) sees no GPU: "
        "check the driver and CUDA_VISIBLE_DEVICES"
    )


def native_bf16(device: str | torch.device) -> bool:
    """Whether this CUDA GPU computes bf16 in hardware (compute capability 8.0, Ampere, or newer).
    torch.cuda.is_bf16_supported() also counts emulation, which passes a V100 or T4 at fp32 speed."""
    return torch.cuda.get_device_capability(torch.device(device))[0] >= 8


def kept_fraction(values: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> float:
    """Share of the non-zero `values` that stay non-zero once multiplied by `scale` and cast to `dtype`:
    what a format (and a loss scale) keeps of real gradients instead of flushing them to zero."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a torch floating-point dtype such as torch.float16, got {dtype!r}")
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive number (a loss scale), got {scale!r}")
    total = int(torch.count_nonzero(values))  # counting, not selecting: no copies of a 100M-entry gradient
    if total == 0:
        raise ValueError("no non-zero values to count")
    return int(torch.count_nonzero((values * scale).to(dtype))) / total


def update_loss_scale(
    scale: float,
    good_steps: int,
    found_inf: bool,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> tuple[float, int]:
    """Dynamic loss scaling, one step: (new scale, new count of good steps), as torch's GradScaler does it.

    An overflow (inf/NaN gradients: the step is skipped) multiplies the scale by `backoff_factor` and
    restarts the count; `growth_interval` good steps in a row multiply it by `growth_factor`.
    """
    if not (growth_factor > 1 and 0 < backoff_factor < 1):
        raise ValueError(f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor}, {backoff_factor}")
    if not isinstance(growth_interval, int) or growth_interval < 1:
        raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
    if found_inf:
        return scale * backoff_factor, 0
    if good_steps + 1 == growth_interval:
        return scale * growth_factor, 0
    return scale, good_steps + 1


def policy(mode: str, device: str | torch.device) -> Policy:
    """The precision policy for `mode` on `device`, or a clear error suggesting what works there."""
    if mode not in MODES:
        raise ValueError(f"unknown precision {mode!r}; choose one of {MODES}")
    dev = device_of(device)
    cuda = dev.type == "cuda"
    if problem := cuda_problem(dev):
        raise ValueError(f"{problem}; use device 'cpu'")
    if mode == "tf32" and not (cuda and torch.cuda.get_device_capability(dev)[0] >= 8):
        raise ValueError("TF32 needs an NVIDIA GPU of compute capability 8.0 (Ampere) or newer; use 'fp32' here")
    if mode == "bf16" and cuda and not native_bf16(dev):
        raise ValueError(
            "this GPU has no native bf16 (compute capability < 8.0: torch would emulate it); "
            "use 'fp16' (with loss scaling) or 'fp32'"
        )
    return Policy(
        mode=mode,
        device_type=dev.type,
        autocast_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode),
        use_scaler=mode == "fp16",
        tf32=mode == "tf32",
    )
