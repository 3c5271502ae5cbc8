"""LoRA: low-rank adapters from scratch (`LoRALinear`) and through PEFT, with the two kept in exact parity.

A frozen linear layer W gets a trainable update ΔW = (alpha / r) · B A, with A [r, in] and B [out, r]:
y = W x + (alpha / r) · B (A dropout(x)). B starts at zero, so training starts from the base model;
A starts like PEFT's (Kaiming-uniform). Only A and B are trained: r · (in + out) numbers per layer
instead of in · out. Merging folds ΔW into W, so the adapted model costs nothing extra at inference.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from labkit import assets

ALL_LINEAR = "all-linear"


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update scaled by alpha / r (PEFT's layout and init)."""

    def __init__(self, base: nn.Linear, r: int = 8, alpha: float = 16, dropout: float = 0.0) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRALinear wraps an nn.Linear, not {type(base).__name__}")
        if not isinstance(r, int) or r < 1:
            raise ValueError(f"rank r must be a positive int, got {r!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.base = base
        self.base.requires_grad_(False)
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, **factory))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # what nn.Linear and PEFT use for A
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (self.dropout(x) @ self.lora_A.T @ self.lora_B.T) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """The update the adapter adds to the base weight: (alpha / r) · B A."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def merged(self) -> nn.Linear:
        """A plain nn.Linear whose weight is W + ΔW: the same outputs, no adapter overhead."""
        out = nn.Linear(self.base.in_features, self.base.out_features, bias=self.base.bias is not None,
                        device=self.base.weight.device, dtype=self.base.weight.dtype)
        with torch.no_grad():
            out.weight.copy_(self.base.weight + self.delta_weight().to(self.base.weight.dtype))
            if self.base.bias is not None:
                out.bias.copy_(self.base.bias)
        return out


def linear_names(model: nn.Module, include_lm_head: bool = False) -> list[str]:
    """Names of the model's nn.Linear modules (the LM head left out unless asked)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and not isinstance(m, LoRALinear) and (include_lm_head or m is not head)]


def resolve_targets(model: nn.Module, targets: str | Sequence[str]) -> list[str]:
    """Module names matching `targets` ("all-linear", or name suffixes such as ["q_proj", "v_proj"]).

    A suffix that matches no nn.Linear is an error listing the ones that exist.
    """
    names = linear_names(model)
    if targets == ALL_LINEAR:
        return names
    if isinstance(targets, str) or not targets:
        raise ValueError(f"targets must be {ALL_LINEAR!r} or a non-empty list of module names, got {targets!r}")
    available = sorted({n.rsplit(".", 1)[-1] for n in names})
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise ValueError(f"no linear layer named {missing} in {type(model).__name__}; available: {available}")
    return [n for n in names if any(n == t or n.endswith("." + t) for t in targets)]


def add_lora(model: nn.Module, targets: str | Sequence[str] = ("q_proj", "v_proj"), r: int = 8,
             alpha: float = 16, dropout: float = 0.0) -> dict[str, LoRALinear]:
    """Freeze the model and wrap the target linears in LoRALinear, in place; returns the adapters by name."""
    chosen = resolve_targets(model, targets)
    model.requires_grad_(False)
    adapters = {}
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        adapters[name] = LoRALinear(getattr(parent, child), r=r, alpha=alpha, dropout=dropout)
        setattr(parent, child, adapters[name])
    return adapters


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every LoRALinear by its merged nn.Linear, in place."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, module.merged())
    return model


# ----------------------------------------------------------------------------- PEFT


def apply_peft(model: nn.Module, targets: str | Sequence[str] = ("q_proj", "v_proj"), r: int = 8,
               alpha: float = 16, dropout: float = 0.0) -> nn.Module:
    """The same adapters through PEFT (`get_peft_model` with a LoraConfig); targets are checked the same way."""
    from peft import LoraConfig, get_peft_model

    resolve_targets(model, targets)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, bias="none", task_type="CAUSAL_LM",
                        target_modules=targets if targets == ALL_LINEAR else list(targets))
    return get_peft_model(model, config)


def copy_from_peft(peft_model: nn.Module, model: nn.Module) -> None:
    """Copy PEFT's adapter weights into the LoRALinear layers of `model` (same base, same targets)."""
    ours = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    found = 0
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and isinstance(getattr(module, "lora_A"), nn.ModuleDict):
            key = name.removeprefix("base_model.model.")
            if key not in ours:
                raise ValueError(f"PEFT adapts {key}, which has no LoRALinear here")
            with torch.no_grad():
                ours[key].lora_A.copy_(module.lora_A["default"].weight)
                ours[key].lora_B.copy_(module.lora_B["default"].weight)
            found += 1
    if found != len(ours):
        raise ValueError(f"PEFT adapts {found} layers, this model has {len(ours)} LoRALinear layers")


def save_adapter(peft_model: nn.Module, dest: str | Path) -> Path:
    """Save a PEFT adapter (adapter_config.json + safetensors) atomically; PeftModel.from_pretrained loads it."""
    with assets.atomic_directory(dest) as tmp:
        peft_model.save_pretrained(tmp, safe_serialization=True)
    return Path(dest)


def load_adapter(base: nn.Module, path: str | Path) -> nn.Module:
    """Attach a saved PEFT adapter to a fresh base model."""
    from peft import PeftModel

    if not (Path(path) / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{path} holds no adapter_config.json: not a PEFT adapter directory")
    return PeftModel.from_pretrained(base, str(path))
