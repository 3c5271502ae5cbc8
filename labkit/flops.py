"""FLOPs and what the device can do: model FLOPs per token, MFU against data-sheet peaks, matmul and copy sweeps.

Model FLOPs come from the shapes (and match torch's FlopCounterMode); the device's achieved
rates come from bench's timing rules, so they compare with the training runs of every lab.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from labkit import precision
from labkit.bench import as_device, fmt_seconds, time_fn

# ----------------------------------------------------------------------------- FLOPs and MFU


def matmul_flops(m: int, n: int, k: int) -> int:
    """FLOPs of an (m×k) @ (k×n) matrix product: one multiply and one add per term."""
    if min(m, n, k) < 0:
        raise ValueError(f"matrix sizes must be >= 0, got m={m}, n={n}, k={k}")
    return 2 * m * n * k


def transformer_flops_per_token(
    n_params: int, n_layers: int, d_attn: int, seq_len: int, training: bool = True
) -> float:
    """Model FLOPs per token: 6N + 12·L·d·T for a training step (fwd+bwd), a third of it forward only.

    N counts the weights every token is multiplied by: all linear layers, the LM head included even
    when it shares the embedding's storage (the embedding lookup itself costs nothing); see
    matmul_parameters. The second term is attention's score and value products over d = heads ×
    head size (the model width for GPT-2 and Llama), which parameter counts miss.
    """
    if min(n_params, n_layers, d_attn) < 0 or seq_len < 1:
        raise ValueError(
            f"need n_params, n_layers, d_attn >= 0 and seq_len >= 1, got {n_params}, {n_layers}, {d_attn}, {seq_len}"
        )
    train = 6 * n_params + 12 * n_layers * d_attn * seq_len
    return train if training else train / 3


def matmul_parameters(model: nn.Module) -> int:
    """Weights a token is multiplied by: every linear layer's (transformers' Conv1D for GPT-2), the LM
    head's counted even when tied to the embedding, whose lookup is not a multiplication."""
    from transformers.pytorch_utils import Conv1D  # here, not at the top: importing transformers takes seconds

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Linear, Conv1D)))


def model_flops_per_token(model: nn.Module, seq_len: int, training: bool = True) -> float:
    """transformer_flops_per_token for a transformers causal LM, read from its modules and config."""
    cfg = model.config
    d_attn = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return transformer_flops_per_token(matmul_parameters(model), cfg.num_hidden_layers, d_attn, seq_len, training)


def step_memory_items(model: nn.Module, batch_size: int, seq_len: int) -> dict[str, int]:
    """Bytes of what an fp32 AdamW training step holds besides the layers' activations: weights, gradients,
    the two moments, and one fp32 copy of the logits [batch, seq, vocab]. With a large vocabulary and a small
    model the logits are the largest item, and the loss's softmax and its gradient make more copies."""
    if not (batch_size >= 1 and seq_len >= 1):
        raise ValueError(f"need batch_size >= 1 and seq_len >= 1, got {batch_size}, {seq_len}")
    params = list(model.parameters())  # a tied weight is yielded once
    n, trainable = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    vocab = model.get_output_embeddings().weight.shape[0]
    return {
        "weights": 4 * n,
        "gradients": 4 * trainable,
        "AdamW moments": 8 * trainable,
        "logits (one fp32 copy)": 4 * batch_size * seq_len * vocab,
    }


def lm_head_share(model: nn.Module) -> float:
    """The output layer's share of the weights every token is multiplied by (matmul_parameters): its share of
    the 6N FLOPs of a training step."""
    return model.get_output_embeddings().weight.numel() / matmul_parameters(model)


# Dense peak throughput (FLOP/s) from vendor data sheets (without sparsity). SXM parts; PCIe
# and NVL cards are lower, so a name match is approximate: the table says which part it assumes.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100": {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},  # H100 SXM
    "H200": {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "L40S": {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362e12, "fp16": 362e12},
    "A10": {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12},
    "V100": {"fp32": 15.7e12, "fp16": 125e12},
    "T4": {"fp32": 8.1e12, "fp16": 65e12},
}


def device_peak_flops(dtype: str, device: str | torch.device | None = None) -> float | None:
    """Vendor dense peak FLOP/s for this GPU and dtype name, or None when unknown (any CPU)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    dev = as_device(device)
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if re.search(rf"\b{key}\b", name):
            return PEAK_FLOPS[key].get(dtype)
    return None


MAX_CPU_CLOCK_HZ = 6.5e9  # above every shipping CPU's boost clock (the fastest desktop parts reach ~6.2 GHz)


def cpu_fp32_ceiling(cores: int, features: dict[str, bool]) -> float | None:
    """A physical ceiling on fp32 FLOP/s for `cores` x86 cores (`features` as `env.cpu_features()` reports them):
    each core retires at most two fused multiply-adds per cycle on its widest vectors (16 fp32 lanes with
    AVX-512, 8 with AVX2, 4 with SSE), at no more than MAX_CPU_CLOCK_HZ. Not a peak to reach: a measurement
    above it means the clock was read wrong. None where the features are unknown (not Linux on x86: Apple's
    matrix units, for one, go past any such count)."""
    if not isinstance(cores, int) or cores < 1:
        raise ValueError(f"cores must be a positive int, got {cores!r}")
    if not features:
        return None
    lanes = 16 if features.get("avx512f") else 8 if features.get("avx2") else 4
    return cores * MAX_CPU_CLOCK_HZ * 2 * 2 * lanes  # 2 FMA units x 2 FLOPs per FMA x lanes


def mfu(achieved_flops_per_s: float, peak_flops_per_s: float | None) -> float | None:
    """Model FLOPs utilization: achieved / peak, or None when the peak is unknown."""
    if achieved_flops_per_s < 0 or (peak_flops_per_s is not None and peak_flops_per_s < 0):
        raise ValueError(f"FLOP rates must be >= 0, got {achieved_flops_per_s} and {peak_flops_per_s}")
    return None if not peak_flops_per_s else achieved_flops_per_s / peak_flops_per_s


# ----------------------------------------------------------------------------- device microbenchmarks

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_support(device: str | torch.device | None = None) -> dict[str, str | None]:
    """For each matmul dtype: None if it runs natively here, else why it is skipped."""
    dev = as_device(device)
    if dev.type != "cuda":
        return {
            "fp32": None,
            "tf32": "TF32 is a tensor-core mode of NVIDIA GPUs (Ampere and newer); a CPU has none",
            "bf16": None,
            "fp16": None,
        }
    major, _ = torch.cuda.get_device_capability(dev)
    return {
        "fp32": None,
        "tf32": None if major >= 8 else "TF32 needs compute capability 8.0 (Ampere) or newer",
        "bf16": None if precision.native_bf16(dev) else "this GPU has no native bf16 (compute capability < 8.0)",
        "fp16": None,
    }


def matmul_throughput(
    size: int, dtype: str, *, device: str | torch.device | None = None, warmup: int = 2, repeats: int = 5
) -> dict[str, Any]:
    """Time one square (size×size) matmul in `dtype` ('fp32', 'tf32', 'bf16', 'fp16'); return FLOP/s."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {list(DTYPES)}")
    if size < 1:
        raise ValueError(f"size must be positive, got {size}")
    dev = as_device(device)
    a = torch.randn(size, size, device=dev, dtype=DTYPES[dtype])
    b = torch.randn(size, size, device=dev, dtype=DTYPES[dtype])
    with precision.tf32(dtype == "tf32"):
        timing = time_fn(lambda: a @ b, warmup=warmup, repeats=repeats, device=dev)
    flops = matmul_flops(size, size, size) / timing.median
    peak = device_peak_flops(dtype, dev)
    return {
        "size": size,
        "dtype": dtype,
        "device": str(dev),
        **timing.summary(),
        "flops_per_s": flops,
        "peak_flops_per_s": peak,
        "fraction_of_peak": mfu(flops, peak),
    }


def next_size_fits(seconds: float, size: int, next_size: int, budget_s: float) -> bool:
    """Whether a size×size matmul that took `seconds` predicts (time ∝ n³) that the next size fits the budget."""
    return seconds * (next_size / size) ** 3 <= budget_s


def matmul_sweep(
    sizes: list[int],
    dtypes: list[str],
    *,
    device: str | torch.device | None = None,
    warmup: int = 2,
    repeats: int = 5,
    budget_s: float = 1.0,
) -> tuple[list[dict[str, Any]], list[str]]:
    """`matmul_throughput` over sizes (ascending) per dtype. A dtype stops growing when one product of
    the next size would take more than `budget_s` (predicted from n³): a format this device only
    emulates (fp16 on most CPUs) would otherwise run for many minutes. Returns (rows, what was skipped)."""
    rows, skipped, ordered = [], [], sorted(sizes)
    for dtype in dtypes:
        for size, bigger in zip(ordered, ordered[1:] + [None]):
            rows.append(matmul_throughput(size, dtype, device=device, warmup=warmup, repeats=repeats))
            if bigger is not None and not next_size_fits(rows[-1]["median_s"], size, bigger, budget_s):
                skipped.append(
                    f"{dtype} n >= {bigger}: one n = {size} product took "
                    f"{fmt_seconds(rows[-1]['median_s'])}, so n = {bigger} would exceed {budget_s:g} s "
                    "(no native support for this format here?)"
                )
                break
    return rows, skipped


def copy_bandwidth(
    megabytes: int,
    *,
    pinned: bool,
    direction: str = "h2d",
    device: str | torch.device = "cuda",
    warmup: int = 2,
    repeats: int = 5,
) -> dict[str, Any]:
    """Host<->device copy bandwidth (bytes/s) for one buffer size; needs a CUDA device."""
    if direction not in ("h2d", "d2h"):
        raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")
    dev = as_device(device)
    if dev.type != "cuda":
        raise RuntimeError("copy bandwidth is a host<->GPU measurement and needs a CUDA device")
    n = megabytes * 2**20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
    gpu = torch.empty(n, dtype=torch.uint8, device=dev)
    copy = (
        (lambda: gpu.copy_(host, non_blocking=pinned))
        if direction == "h2d"
        else (lambda: host.copy_(gpu, non_blocking=pinned))
    )
    timing = time_fn(copy, warmup=warmup, repeats=repeats, device=dev)
    return {
        "megabytes": megabytes,
        "pinned": pinned,
        "direction": direction,
        **timing.summary(),
        "bytes_per_s": n / timing.median,
    }


def memory_bandwidth(
    megabytes: int = 256, *, device: str | torch.device | None = None, warmup: int = 2, repeats: int = 5
) -> dict[str, Any]:
    """The device's own memory bandwidth (bytes/s): a copy of `megabytes` within it reads and writes each byte once.
    It sets the floor of a decode step, which reads every weight for one token: weight bytes / bandwidth."""
    if not (isinstance(megabytes, int) and not isinstance(megabytes, bool) and megabytes >= 1):
        raise ValueError(f"megabytes must be an int >= 1, got {megabytes!r}")
    dev = as_device(device)
    n = megabytes * 2**20
    src, dst = torch.ones(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
    timing = time_fn(lambda: dst.copy_(src), warmup=warmup, repeats=repeats, device=dev)
    return {"megabytes": megabytes, **timing.summary(), "bytes_per_s": 2 * n / timing.median}
