"""LoRA: low-rank adapters from scratch (`LoRALinear`) and through PEFT, with the two kept in exact parity.

A frozen linear layer W gets a trainable update ΔW = (alpha / r) · B A, with A [r, in] and B [out, r]:
y = W x + (alpha / r) · B (A dropout(x)). B starts at zero, so training starts from the base model;
A starts like PEFT's (Kaiming-uniform). Only A and B are trained: r · (in + out) numbers per layer
instead of in · out. Merging folds ΔW into W, so the adapted model costs nothing extra at inference.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from labkit import bench, fileio, tasks, train
from labkit.models import DecoderShape, count_parameters
from labkit.quant.nf4 import NF4_BITS
from labkit.torchutil import check_int, check_number, environ, is_int, is_number, quiet, replace_module

ALL_LINEAR = "all-linear"


def is_linear(module: nn.Module) -> bool:
    """An nn.Linear, or a frozen linear stored another way that can `dequantize()` its weight
    (quant.PackedLinear or quant.NF4Linear: the 4-bit base of QLoRA)."""
    if isinstance(module, nn.Linear):
        return True
    return callable(getattr(module, "dequantize", None)) and all(
        hasattr(module, a) for a in ("in_features", "out_features", "bias")
    )


def _check_lora_args(r: int, alpha: float, dropout: float) -> None:
    """Refuse a rank, scale or dropout an adapter cannot have, naming the allowed values."""
    if not is_int(r) or r < 1:
        raise ValueError(f"rank r must be a positive int, got {r!r}")
    if not is_number(alpha) or alpha <= 0:
        raise ValueError(f"alpha must be a positive number, got {alpha!r}")
    if not is_number(dropout) or not 0 <= dropout < 1:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")


class LoRALinear(nn.Module):
    """A frozen linear plus a trainable low-rank update scaled by alpha / r (PEFT's layout and init)."""

    def __init__(self, base: nn.Module, r: int = 8, alpha: float = 16, dropout: float = 0.0) -> None:
        super().__init__()
        if not is_linear(base) or isinstance(base, LoRALinear):
            raise TypeError(f"LoRALinear wraps an nn.Linear or a packed 4-bit linear, not {type(base).__name__}")
        _check_lora_args(r, alpha, dropout)
        self.base = base
        self.base.requires_grad_(False)
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        weight = base.weight  # a packed base dequantizes it: the adapter trains in that (higher) precision
        factory = {"device": weight.device, "dtype": weight.dtype}
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
        """A plain nn.Linear whose weight is W + ΔW: the same outputs, no adapter overhead.
        (A packed base merges into a full-precision layer: rounding W + ΔW back to 4 bits would lose ΔW.)"""
        weight = self.base.weight
        out = nn.Linear(
            self.base.in_features,
            self.base.out_features,
            bias=self.base.bias is not None,
            device=weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            out.weight.copy_(weight + self.delta_weight().to(weight.dtype))
            if self.base.bias is not None:
                out.bias.copy_(self.base.bias)
        return out


def linear_names(model: nn.Module, include_lm_head: bool = False) -> list[str]:
    """Names of the model's linear layers (nn.Linear or packed), the LM head left out unless asked."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [
        n
        for n, m in model.named_modules()
        if is_linear(m) and not isinstance(m, LoRALinear) and (include_lm_head or m is not head)
    ]


def resolve_targets(model: nn.Module, targets: str | Sequence[str]) -> list[str]:
    """Module names matching `targets` ("all-linear", or name suffixes such as ["q_proj", "v_proj"]).

    A suffix that matches no linear layer is an error listing the ones that exist.
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


def add_lora(
    model: nn.Module,
    targets: str | Sequence[str] = ("q_proj", "v_proj"),
    r: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
) -> dict[str, LoRALinear]:
    """Freeze the model and wrap the target linears in LoRALinear, in place; returns the adapters by name.

    Everything is checked before the model is touched: a bad argument leaves it as it was."""
    _check_lora_args(r, alpha, dropout)
    present = [name for name, module in model.named_modules() if isinstance(module, LoRALinear)]
    if present:
        raise ValueError(
            f"the model already has {len(present)} LoRA adapter(s) (e.g. {present[0]}): "
            "merge_lora(model) first, or start from a fresh model"
        )
    chosen = resolve_targets(model, targets)
    model.requires_grad_(False)
    adapters = {}
    for name in chosen:
        adapters[name] = LoRALinear(model.get_submodule(name), r=r, alpha=alpha, dropout=dropout)
        replace_module(model, name, adapters[name])
    return adapters


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every LoRALinear by its merged nn.Linear, in place."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            replace_module(model, name, module.merged())
    return model


# ----------------------------------------------------------------------------- why low rank


def update_spectrum(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Singular values (descending) of a fine-tune's weight update ΔW = after − before."""
    if before.shape != after.shape or before.dim() != 2:
        raise ValueError(f"need two weights of one 2-D shape, got {tuple(before.shape)} and {tuple(after.shape)}")
    return torch.linalg.svdvals(after.detach().float() - before.detach().float())


def energy_rank(singular_values: torch.Tensor, share: float = 0.9) -> int:
    """The smallest rank whose singular values hold `share` of ‖ΔW‖² (the update's "effective rank")."""
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")
    energy = singular_values.double().square().cumsum(0)
    return int(torch.searchsorted(energy, share * energy[-1]).item()) + 1


@torch.no_grad()
def truncated_updates(model: nn.Module, before: dict[str, torch.Tensor], ranks: Sequence[int]) -> Iterator[int]:
    """Set the model to W₀ + SVD_r(W − W₀) for each r of `ranks` in turn (yielding r), then restore it.

    `before` maps parameter names to their 2-D weights before fine-tuning; only those are truncated.
    What a fine-tune keeps at rank r tells how much a LoRA of that rank could have learned. Each
    update is decomposed once, whatever the number of ranks.
    """
    if not ranks or any(not isinstance(r, int) or r < 1 for r in ranks):
        raise ValueError(f"ranks must be positive ints, got {ranks!r}")
    params = dict(model.named_parameters())
    unknown = [n for n in before if n not in params or params[n].shape != before[n].shape or before[n].dim() != 2]
    if unknown:
        raise ValueError(f"not 2-D parameters of this model with the same shape: {unknown[:5]}")
    trained = {n: params[n].detach().clone() for n in before}
    factors = {
        n: torch.linalg.svd(trained[n].float() - w0.float().to(trained[n].device), full_matrices=False)
        for n, w0 in before.items()
    }
    try:
        for r in ranks:
            for n, (u, s, vh) in factors.items():
                low = (u[:, :r] * s[:r]) @ vh[:r]
                params[n].copy_((before[n].float().to(low.device) + low).to(params[n].dtype))
            yield r
    finally:
        for n, w in trained.items():
            params[n].copy_(w)


# ----------------------------------------------------------------------------- memory and a measured run


def adapter_params(shape: DecoderShape, r: int, targets: str | Sequence[str] = ("q_proj", "v_proj")) -> int:
    """Trainable numbers of rank-r adapters on `targets` ("all-linear" or linear_shapes names) in every layer."""
    if not isinstance(shape, DecoderShape):
        raise TypeError(f"shape must be a models.DecoderShape, got {type(shape).__name__}")
    check_int("r", r, minimum=1)
    shapes = shape.linear_shapes()
    names = list(shapes) if targets == ALL_LINEAR else targets
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise TypeError(f"targets must be {ALL_LINEAR!r} or a sequence of names, got {targets!r}")
    if not names or any(t not in shapes for t in names):
        raise ValueError(f"targets must be {ALL_LINEAR!r} or a non-empty list of {list(shapes)}, got {targets!r}")
    return shape.num_layers * r * sum(sum(shapes[t]) for t in set(names))


def finetune_state_bytes(
    n_params: int, trainable: int, base_bytes: float, *, unquantized_params: int = 0, packed_bits: float = NF4_BITS
) -> dict[str, int | float]:
    """Weights + gradients + AdamW state by arithmetic: full fine-tune, LoRA and QLoRA of an n_params model."""
    # 16 bytes per trained number (weight, gradient, two AdamW moments; or bf16 weight and gradient + fp32 master),
    # `base_bytes` per frozen one; QLoRA packs all but `unquantized_params` (embedding, LM head, norms): 16 bits
    for name, count in (("n_params", n_params), ("trainable", trainable), ("unquantized_params", unquantized_params)):
        check_int(name, count, minimum=int(name == "n_params"))
    check_number("base_bytes", base_bytes)
    check_number("packed_bits", packed_bits)
    if max(trainable, unquantized_params) > n_params or base_bytes <= 0 or not 0 < packed_bits <= 32:
        raise ValueError(
            "need trainable and unquantized_params <= n_params, base_bytes > 0 and packed_bits in (0, 32]; got "
            f"{n_params=}, {trainable=}, {unquantized_params=}, {base_bytes=}, {packed_bits=}"
        )
    packed = packed_bits / 8 * (n_params - unquantized_params) + 2 * unquantized_params
    return {
        "full fine-tune": 16 * n_params,
        "LoRA": base_bytes * n_params + 16 * trainable,
        "QLoRA (4-bit base)": packed + 16 * trainable,
    }


def training_state_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes for training: the weights (packed ones as stored), gradients and AdamW's two moments of the
    trainable parameters. Activations come on top and grow with batch and sequence length."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    trainable = {p.data_ptr(): p for p in model.parameters() if p.requires_grad}
    weights = sum(t.numel() * t.element_size() for t in tensors.values())
    grads = sum(p.numel() * p.element_size() for p in trainable.values())
    return {"weights": weights, "gradients": grads, "optimizer": 2 * grads, "total": weights + 3 * grads}


@dataclass
class FinetuneResult:
    """One fine-tuning run on a task: what it trained, what it cost, what it scored."""

    name: str
    trainable: int
    state_bytes: dict[str, int]
    losses: list[float]
    step_seconds: float  # median over the steps after the first
    peak_memory: bench.PeakMemory
    eval_loss: float  # mean loss per answer token on the held-out examples
    accuracy: float  # exact match on the held-out examples
    predictions: list[str] = field(repr=False, default_factory=list)
    step_times: list[float] = field(repr=False, default_factory=list)  # seconds, each step after the first

    def row(self, base_parameters: int) -> dict[str, str]:
        """The result as one row of the lab's comparison table."""
        return {
            "run": self.name,
            "trainable": f"{self.trainable:,}",
            "share": f"{100 * self.trainable / base_parameters:.2f} %",
            "state": bench.fmt_bytes(self.state_bytes["total"]),
            "peak": bench.fmt_bytes(self.peak_memory.peak_bytes),
            "step": bench.fmt_seconds(self.step_seconds),
            "eval loss": f"{self.eval_loss:.3f}",
            "exact match": f"{100 * self.accuracy:.1f} %",
        }


def finetune_and_score(
    name: str,
    model: nn.Module,
    tokenizer,
    train_examples: Sequence[tasks.Example],
    eval_examples: Sequence[tasks.Example],
    cfg: train.TrainConfig,
    batch_size: int,
    max_length: int,
    max_new_tokens: int = 16,
) -> FinetuneResult:
    """Fine-tune `model` (whatever is trainable in it: adapters, or everything) on the task, then score it.

    Peak memory covers the training loop only (resident set on CPU, allocator on CUDA), measured after
    freed memory is handed back, so runs made one after another in one process can be compared.
    """
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"{name}: the model has no trainable parameters (add adapters or unfreeze it)")
    batches = tasks.sft_batches(tokenizer, train_examples, batch_size, max_length, seed=cfg.seed)
    device = next(model.parameters()).device
    state = training_state_bytes(model)
    trainable = count_parameters(model, trainable_only=True)
    bench.release_memory()
    with bench.track_peak_memory(device) as peak:
        history = train.fit(model, batches, cfg)
    seconds = [h["seconds"] for h in history[1:]] or [history[0]["seconds"]]
    eval_loss = tasks.answer_loss(model, tokenizer, eval_examples, batch_size, max_length)
    scored = tasks.exact_match(model, tokenizer, eval_examples, max_new_tokens)
    return FinetuneResult(
        name,
        trainable,
        state,
        [h["loss"] for h in history],
        statistics.median(seconds),
        peak,
        eval_loss,
        scored["accuracy"],
        scored["predictions"],
        seconds,
    )


# ----------------------------------------------------------------------------- PEFT


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    """Silence what PEFT prints that says nothing about the adapters: importing peft imports GPTQModel when it
    is installed (a banner of a dozen lines, and environment variables such as HF_HOME set for good, undone
    here), and peft 0.21 calls a transformers-5 deprecated method.

    peft is imported inside the functions that use it, under this guard, for that reason."""
    with environ(), quiet("PEFT", ignore_warnings=(".*is_gradient_checkpointing.*",)):
        yield


def apply_peft(
    model: nn.Module,
    targets: str | Sequence[str] = ("q_proj", "v_proj"),
    r: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
) -> nn.Module:
    """The same adapters through PEFT (`get_peft_model` with a LoraConfig); targets are checked the same way."""
    resolve_targets(model, targets)
    with _quiet_peft():
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=r,
            lora_alpha=alpha,
            lora_dropout=dropout,
            bias="none",
            task_type="CAUSAL_LM",
            target_modules=targets if targets == ALL_LINEAR else list(targets),
        )
        return get_peft_model(model, config)


def _peft_pairs(peft_model: nn.Module, model: nn.Module) -> list[tuple[LoRALinear, nn.Module]]:
    """(our LoRALinear, PEFT's LoRA layer) for every adapted layer; the two models must adapt the same ones."""
    ours = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    pairs = []
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and isinstance(module.lora_A, nn.ModuleDict):
            key = name.removeprefix("base_model.model.")
            if key not in ours:
                raise ValueError(f"PEFT adapts {key}, which has no LoRALinear here")
            pairs.append((ours[key], module))
    if len(pairs) != len(ours):
        raise ValueError(f"PEFT adapts {len(pairs)} layers, this model has {len(ours)} LoRALinear layers")
    return pairs


@torch.no_grad()
def copy_from_peft(peft_model: nn.Module, model: nn.Module) -> None:
    """Copy PEFT's adapter weights into the LoRALinear layers of `model` (same base, same targets)."""
    for ours, theirs in _peft_pairs(peft_model, model):
        ours.lora_A.copy_(theirs.lora_A["default"].weight)
        ours.lora_B.copy_(theirs.lora_B["default"].weight)


@torch.no_grad()
def copy_to_peft(model: nn.Module, peft_model: nn.Module) -> None:
    """Copy our trained adapters into a PEFT model, to save them in PEFT's format (`save_adapter`)."""
    for ours, theirs in _peft_pairs(peft_model, model):
        theirs.lora_A["default"].weight.copy_(ours.lora_A)
        theirs.lora_B["default"].weight.copy_(ours.lora_B)


@torch.no_grad()
def adapter_difference(peft_model: nn.Module, model: nn.Module) -> float:
    """Largest absolute difference between PEFT's adapter weights and ours, layer by layer (0.0: identical)."""
    return max(
        max(
            (ours.lora_A - theirs.lora_A["default"].weight).abs().max().item(),
            (ours.lora_B - theirs.lora_B["default"].weight).abs().max().item(),
        )
        for ours, theirs in _peft_pairs(peft_model, model)
    )


def save_adapter(peft_model: nn.Module, dest: str | Path) -> Path:
    """Save a PEFT adapter (adapter_config.json + safetensors) atomically; PeftModel.from_pretrained loads it."""
    with fileio.atomic_directory(dest) as tmp:
        peft_model.save_pretrained(tmp, safe_serialization=True)
    return Path(dest)


def load_adapter(base: nn.Module, path: str | Path) -> nn.Module:
    """Attach a saved PEFT adapter to a fresh base model."""
    if not (Path(path) / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{path} holds no adapter_config.json: not a PEFT adapter directory")
    with _quiet_peft():
        from peft import PeftModel

        return PeftModel.from_pretrained(base, str(path))
