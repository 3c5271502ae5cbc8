"""The calibration engine that GPTQ, AWQ-style scaling, Wanda and SparseGPT share: windows of calibration text,
the block-by-block sweep of a decoder on them, the Hessian H = 2 X Xᵀ / n of each linear layer's inputs, and the
factor of its damped inverse.

The sweep walks the decoder one block at a time. The calibration activations entering a block are those the
blocks already solved produce; within a block, the linear layers that read the same input (q/k/v; o; gate/up;
down) form a group, solved together on one Hessian before the layers after them see their inputs. A *solve*
(GPTQ's rounding, AWQ's scales, Wanda's or SparseGPT's masks) is a function of the group's names, modules and H;
labkit.quant and labkit.prune pass theirs to `calibrated_sweep`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from labkit.data import pack_blocks
from labkit.evaluate import token_stream
from labkit.torchutil import check_int, check_module, check_token_ids, decoder_layers, is_int, module_name, vocab_size

# Calibration tokens per input of the widest layer below which GPTQ fits noise. Measured on SmolLM2's
# layers.0.mlp.down_proj (1536 inputs): with 2048 tokens its Hessian has 489 eigenvalues under 1e-3 of
# its mean diagonal and GPTQ's held-out error is RTN's (5.0e-3 vs 5.1e-3); the whole model's 4-bit g64
# perplexity then ranged from 26.4 to 31.0 with the CPU and thread count (22 % of the codes changed
# between 1 and 2 threads). With 8192 tokens none is that small and the held-out error halves (2.9e-3);
# with the Hessian summed and factored in float64 too, 1 and 2 threads give identical codes.
TOKENS_PER_INPUT = 4


def calibration_blocks(tokenizer, texts: Sequence[str], n_blocks: int, block_size: int, seed: int = 0) -> torch.Tensor:
    """`n_blocks` random non-overlapping windows of `block_size` tokens from the EOS-joined texts: [n, block_size]."""
    if isinstance(texts, str):
        raise TypeError("texts must be a list of texts, got one str: pass [text]")
    for name, value in (("n_blocks", n_blocks), ("block_size", block_size), ("seed", seed)):
        if not is_int(value):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if n_blocks < 1 or block_size < 2:
        raise ValueError(f"need n_blocks >= 1 and block_size >= 2, got {n_blocks}, {block_size}")
    blocks = pack_blocks(np.asarray(token_stream(tokenizer, list(texts))), block_size)
    if len(blocks) < n_blocks:
        raise ValueError(
            f"the texts hold {len(blocks)} blocks of {block_size} tokens, fewer than the "
            f"{n_blocks} asked for: pass more texts"
        )
    chosen = np.random.default_rng(seed).choice(len(blocks), size=n_blocks, replace=False)
    return torch.from_numpy(blocks[np.sort(chosen)].copy())


def check_calibration(model: nn.Module, calibration: Any, who: str) -> None:
    """Calibration must be token ids of `model`'s vocabulary as a non-empty [n_blocks, block_size] long tensor."""
    if not isinstance(calibration, torch.Tensor) or calibration.dim() != 2 or calibration.dtype != torch.long:
        raise ValueError(
            f"{who} needs calibration token ids as a [n_blocks, block_size] long tensor "
            "(labkit.calibration.calibration_blocks makes one)"
        )
    if calibration.numel() == 0:
        raise ValueError(
            f"{who} needs at least one calibration block of at least one token, got shape {tuple(calibration.shape)}"
        )
    check_token_ids(calibration, vocab_size(model), "calibration ids")


class _Stop(Exception):
    """Raised by a hook once it has what it came for, to cut a forward pass short."""


def _block_output(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def _first_block_inputs(
    model: nn.Module, layers: nn.ModuleList, calibration: torch.Tensor, batch_size: int
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """Hidden states and keyword arguments (masks, positions, rotary tables) entering block 0, per batch."""
    inputs, kwargs_list = [], []

    def grab(module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        inputs.append(hidden)
        kwargs_list.append({k: v for k, v in kwargs.items() if k != "hidden_states"})
        raise _Stop

    handle = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        _forward_until_stopped(model, calibration, batch_size)
    finally:
        handle.remove()
    return inputs, kwargs_list


def _forward_until_stopped(model: nn.Module, calibration: torch.Tensor, batch_size: int) -> None:
    """Run the calibration windows through the model; a hook raising _Stop ends each pass early."""
    device = next(model.parameters()).device
    for batch in calibration.split(batch_size):
        try:
            model(input_ids=batch.to(device), use_cache=False)
        except _Stop:
            pass


@torch.no_grad()
def _sequential_groups(block: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> list[list[str]]:
    """The block's linear layers in execution order, grouped by shared input (q/k/v; o; gate/up; down)."""
    seen: list[tuple[str, torch.Tensor]] = []
    hooks = [
        m.register_forward_hook(lambda m, a, o, name=name: seen.append((name, a[0])))
        for name, m in block.named_modules()
        if isinstance(m, nn.Linear)
    ]
    try:
        block(hidden, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    groups: list[list[str]] = []
    for i, (name, x) in enumerate(seen):
        if i and x is seen[i - 1][1]:
            groups[-1].append(name)
        else:
            groups.append([name])
    return groups


class _HessianHook:
    """Accumulates H = 2 X Xᵀ / n over the inputs of one linear layer, then stops the forward pass.

    The sum runs in float64 and H is returned in float32: an fp32 sum depends on the GEMM kernel the
    CPU's BLAS picks for its SIMD width, and GPTQ turns such differences into other codes (see
    `inverse_hessian_factor`). The sums take ~25 s instead of ~14 s per SmolLM2 run at 8192 tokens on 2 cores.
    """

    def __init__(self, module: nn.Linear) -> None:
        self.sum = torch.zeros(module.in_features, module.in_features, device=module.weight.device, dtype=torch.float64)
        self.count = 0
        self.handle = module.register_forward_pre_hook(self)

    def __call__(self, module: nn.Linear, args: tuple) -> None:
        x = args[0].reshape(-1, module.in_features).to(torch.float64)
        self.sum.addmm_(x.T, x)
        self.count += x.shape[0]
        raise _Stop  # the layers after this one are not needed

    def result(self) -> tuple[torch.Tensor, int]:
        self.handle.remove()
        return (self.sum * (2.0 / max(self.count, 1))).float(), self.count


@torch.no_grad()
def _input_hessian(
    block: nn.Module, module: nn.Linear, inputs: list[torch.Tensor], kwargs_list: list[dict[str, Any]]
) -> tuple[torch.Tensor, int]:
    """H = 2 X Xᵀ / n over every calibration token entering `module`; forwards stop right after it."""
    hook = _HessianHook(module)
    try:
        for hidden, kwargs in zip(inputs, kwargs_list):
            try:
                block(hidden, **kwargs)
            except _Stop:
                pass
    finally:
        hessian = hook.result()
    return hessian


@torch.no_grad()
def input_hessian(model: nn.Module, module_name: str, calibration: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """H = 2 X Xᵀ / n of the inputs X that one linear layer of the (unquantized) model sees on `calibration`."""
    check_module(model)
    module = dict(model.named_modules()).get(module_name)
    if not isinstance(module, nn.Linear):
        raise ValueError(f"{module_name!r} is not an nn.Linear of {type(model).__name__}")
    check_calibration(model, calibration, "input_hessian")
    check_int("batch_size", batch_size, minimum=1)
    hook = _HessianHook(module)
    try:
        _forward_until_stopped(model, calibration, batch_size)
    finally:
        hessian, count = hook.result()
    if count == 0:
        raise ValueError(f"{module_name!r} saw no input: the model's forward does not reach it")
    return hessian


def inverse_hessian_factor(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of the damped inverse Hessian; its rows drive GPTQ's error updates.

    Factored in float64 (a few ms even for 1536 inputs): with a condition number near 1e4, an fp32
    factorization depends on how the LAPACK routine split its sums, and GPTQ's error feedback turns that
    into other codes (on SmolLM2, 1 vs 2 threads changed 22 % of them; in float64, none). The factor
    comes back in the Hessian's dtype.
    """
    h = hessian.to(torch.float64, copy=True)  # damped in place below: never the caller's tensor
    h.diagonal().add_(damp * h.diagonal().mean())
    factor, info = torch.linalg.cholesky_ex(h)
    if info.item() != 0:
        raise ValueError(
            f"the Hessian is not positive definite after damping ({damp:.3g} of its mean diagonal); "
            "use more calibration tokens or a larger damp (0.01-0.1)"
        )
    return torch.linalg.cholesky(torch.cholesky_inverse(factor), upper=True).to(hessian.dtype)


Solve = Callable[[list[str], list[nn.Linear], torch.Tensor], None]


@torch.no_grad()
def calibrated_sweep(
    model: nn.Module,
    calibration: torch.Tensor,
    solve: Solve,
    *,
    batch_size: int = 8,
    desc: str = "calibrating",
    progress: bool = True,
) -> None:
    """Walk the decoder block by block on `calibration` ([n, T] token ids), calling solve(names, modules, H)
    once per group of linears that read the same input (q/k/v; o; gate/up; down), with their names in the
    model and H = 2 X Xᵀ / n of that input. `solve` may change the weights: the next group's inputs, and the next
    block's, are computed with the changed ones, so each layer corrects for the layers solved before it.
    GPTQ (`labkit.quant.quantize_model`), AWQ-style scaling (`labkit.quant.awq_model`), SparseGPT and Wanda
    (labkit.prune) are such solves."""
    check_module(model)
    check_calibration(model, calibration, "the calibrated sweep")
    if not callable(solve):
        raise TypeError(f"solve must be callable as solve(names, modules, hessian), got {solve!r}")
    check_int("batch_size", batch_size, minimum=1)
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    inputs, kwargs_list = _first_block_inputs(model, layers, calibration, batch_size)
    bar = tqdm(
        total=sum(1 for b in layers for m in b.modules() if isinstance(m, nn.Linear)),
        desc=desc,
        disable=not progress,
        leave=False,
    )
    try:
        for i, block in enumerate(layers):
            named = dict(block.named_modules())
            for group in _sequential_groups(block, inputs[0], kwargs_list[0]):
                hessian, _ = _input_hessian(block, named[group[0]], inputs, kwargs_list)
                bar.set_postfix_str(f"{i}.{'+'.join(n.rsplit('.', 1)[-1] for n in group)}")
                solve([f"{prefix}.{i}.{n}" for n in group], [named[n] for n in group], hessian)
                bar.update(len(group))
            inputs = [_block_output(block(x, **kw)) for x, kw in zip(inputs, kwargs_list)]
    finally:
        bar.close()
