"""What one rank holds to train a model: the arithmetic of ZeRO (Rajbhandari et al., 2020) for DDP, ZeRO-1/2/3
(FSDP), activation checkpointing and CPU offload — the predictions lab 09 measures against.

Per parameter, training with AdamW holds the weight as computed with (p bytes), its gradient (g), in mixed
precision an fp32 master copy (m) and two fp32 moments (8). Over N data-parallel ranks:

    DDP      (p + g + m + 8) Ψ          every rank holds everything
    ZeRO-1   (p + g) Ψ + (m + 8) Ψ / N  optimizer state sharded
    ZeRO-2   p Ψ + (g + m + 8) Ψ / N    gradients too (reduce-scattered, not all-reduced)
    ZeRO-3   (p + g + m + 8) Ψ / N      parameters too (FSDP): each unit all-gathered just before it is used

Activations come on top and do not shrink with N (each rank runs its own batch); activation checkpointing
keeps only each block's input and recomputes the rest during the backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import nn

from labkit.torchutil import check_bool, check_module, device_of, is_int

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


@dataclass(frozen=True)
class DtypePolicy:
    """Bytes per parameter: the weight computed with, its gradient, an fp32 master copy, the optimizer state."""

    param: int = 4
    grad: int = 4
    master: int = 0  # 4 in mixed precision (bf16/fp16 weights, fp32 master), 0 in plain fp32
    optimizer: int = 8  # AdamW's two fp32 moments

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not is_int(value) or value < 0:
                raise ValueError(f"{f.name} must be a non-negative number of bytes, got {value!r}")


FP32 = DtypePolicy()
MIXED = DtypePolicy(param=2, grad=2, master=4, optimizer=8)  # bf16 compute, fp32 master and moments


@dataclass(frozen=True)
class RankBytes:
    """Bytes one rank holds on its device for training, by kind; what is offloaded sits in host memory."""

    parameters: int
    gradients: int
    optimizer: int  # moments and, in mixed precision, the fp32 master weights
    activations: int = 0
    offloaded: int = 0  # host memory (CPU offload), not counted in `total`

    @property
    def state(self) -> int:
        """Parameters, gradients and optimizer state: what ZeRO shards."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.activations


def state_bytes(
    n_params: int, strategy: str, world: int, policy: DtypePolicy = FP32, *, offload: bool = False
) -> RankBytes:
    """Per-rank bytes of parameters, gradients and optimizer state for `n_params` parameters over `world` ranks.

    Shards are ceil(Ψ / N): a rank holds at most that many. With `offload` (ZeRO-3 only, as FSDP's
    CPUOffloadPolicy), the sharded parameters, gradients and optimizer state live in host memory; the device
    holds only the units gathered for compute, which `gathered_bytes` adds.
    """
    _check_count("n_params", n_params)
    _check_count("world", world, minimum=1)
    _check_policy(policy)
    check_bool("offload", offload)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if offload and strategy != "zero3":
        raise ValueError("offload applies to zero3 (FSDP's CPUOffloadPolicy), not to " + strategy)
    shard = math.ceil(n_params / world)
    sharded = STRATEGIES.index(strategy)  # 0: nothing, 1: optimizer, 2: + gradients, 3: + parameters
    params = (shard if sharded >= 3 else n_params) * policy.param
    grads = (shard if sharded >= 2 else n_params) * policy.grad
    optimizer = (shard if sharded >= 1 else n_params) * (policy.master + policy.optimizer)
    if offload:
        return RankBytes(0, 0, 0, offloaded=params + grads + optimizer)
    return RankBytes(params, grads, optimizer)


def gathered_bytes(unit_params: int, policy: DtypePolicy = FP32, prefetch: int = 1) -> int:
    """ZeRO-3's transient: the full parameters and gradients of the unit being computed (and of the `prefetch`
    next ones being gathered), on top of the shards; with per-block units, a few blocks' worth."""
    _check_count("unit_params", unit_params)
    _check_count("prefetch", prefetch)
    _check_policy(policy)
    return unit_params * (policy.param * (1 + prefetch) + policy.grad)


def activation_bytes(
    per_token_per_block: int,
    tokens: int,
    blocks: int,
    *,
    checkpointing: bool = False,
    block_input_per_token: int = 0,
    outside_blocks_per_token: int = 0,
) -> int:
    """Bytes saved for the backward over `tokens` tokens (batch × sequence) of one rank.

    Without checkpointing every block keeps what autograd saves (`per_token_per_block`, measured with
    `bench.saved_for_backward`); with it, each block keeps only its input (`block_input_per_token`: hidden size ×
    bytes) and one block's activations exist at a time, while it is recomputed. `outside_blocks_per_token`
    covers the embedding, final norm and logits, which no block checkpoint removes.
    """
    for name, value in (
        ("per_token_per_block", per_token_per_block),
        ("tokens", tokens),
        ("blocks", blocks),
        ("block_input_per_token", block_input_per_token),
        ("outside_blocks_per_token", outside_blocks_per_token),
    ):
        _check_count(name, value)
    check_bool("checkpointing", checkpointing)
    if checkpointing:
        inside = blocks * block_input_per_token + per_token_per_block
    else:
        inside = blocks * per_token_per_block
    return tokens * (inside + outside_blocks_per_token)


def largest_model(
    budget_bytes: int, strategy: str, world: int, policy: DtypePolicy = FP32, *, reserved_bytes: int = 0
) -> int:
    """The most parameters whose training state fits `budget_bytes` per rank after `reserved_bytes` (activations,
    gathered units, the framework): the extrapolation table of lab 09."""
    _check_count("budget_bytes", budget_bytes)
    _check_count("reserved_bytes", reserved_bytes)
    room = budget_bytes - reserved_bytes
    per_param = state_bytes(world, strategy, world, policy).state / world  # bytes per parameter per rank
    if per_param == 0:
        raise ValueError("the policy holds no bytes per parameter: any model fits")
    n = max(0, int(room // per_param))
    while n and state_bytes(n, strategy, world, policy).state > room:  # shards round up: at most `world` steps
        n -= 1
    return n


def _check_count(name: str, value: int, minimum: int = 0) -> None:
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_policy(policy: DtypePolicy) -> None:
    if not isinstance(policy, DtypePolicy):
        raise TypeError(f"policy must be a DtypePolicy (FP32, MIXED or your own), got {policy!r}")


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor (FSDP2) counts its shard on this rank


def _local_bytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _moments(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """An optimizer's per-parameter state tensors (AdamW: the two moments), step counts left out."""
    return [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor) and t.dim()]


def moment_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of an optimizer's per-parameter state on this rank (AdamW: the two moments), step counts left out."""
    _check_optimizer(optimizer)
    return sum(_local_bytes(t) for t in _moments(optimizer))


def held_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, device: str | torch.device | None = None
) -> RankBytes:
    """What this rank holds for training, measured tensor by tensor (a tied weight once, a shard as its local part):
    the figure to set against `state_bytes`. Given the accelerator the rank computes on as `device`, tensors held
    elsewhere (FSDP's CPU offload) count as `offloaded`."""
    check_module(model)
    if optimizer is not None:
        _check_optimizer(optimizer)
    here = device_of(device).type if device is not None else None
    params = list(model.parameters())  # each tensor once: a tied weight is one parameter
    kinds = {
        "parameters": params,
        "gradients": [p.grad for p in params if p.grad is not None],
        "optimizer": _moments(optimizer) if optimizer is not None else [],
    }

    def away(t: torch.Tensor) -> bool:
        return here not in (None, "cpu") and _local(t).device.type != here

    return RankBytes(
        **{kind: sum(_local_bytes(t) for t in tensors if not away(t)) for kind, tensors in kinds.items()},
        offloaded=sum(_local_bytes(t) for tensors in kinds.values() for t in tensors if away(t)),
    )
