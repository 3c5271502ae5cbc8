"""Pruning: magnitude masks (per layer, global, N:M), structured pruning into a smaller dense model,
sparsity counted from the real zeros, per-layer sensitivity, and prune-then-recover fine-tuning.

Unstructured and N:M pruning zero weights in place and return a `Pruning` that holds the keep-masks;
while it is active, a gradient hook multiplies each pruned weight's gradient by its mask, so
fine-tuning (AdamW included: zero gradient, zero moments, decoupled decay of zero) leaves the zeros
at zero. `remove()` makes the pruning permanent: the zeros stay, the masks stop being enforced.

Structured pruning removes whole MLP channels (torch-pruning's dependency graph keeps gate, up and
down projections consistent) and whole attention heads (in labkit: torch-pruning cannot group a
grouped-query attention's heads), leaving a dense model with smaller matrices that transformers
saves and reloads.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch_pruning as tp
from safetensors.torch import load_file, save
from torch import nn
from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

from labkit import assets, bench
from labkit.models import count_parameters
from labkit.torchutil import eval_mode
from labkit.train import DataStream, TrainConfig, fit

SCOPES = ("layer", "global")


# ----------------------------------------------------------------------------- which weights


def prunable_weights(
    model: nn.Module,
    *,
    modules: Sequence[str] | None = None,
    include_embeddings: bool = False,
    include_lm_head: bool = False,
) -> dict[str, nn.Parameter]:
    """Weights that magnitude pruning acts on, by module name: every nn.Linear but the LM head by default.

    `modules` names the modules explicitly instead. Tied weights (SmolLM2's LM head is its embedding
    matrix) appear once, under the first name, so pruning one prunes both.
    """
    named = dict(model.named_modules())
    if modules is not None:
        missing = [m for m in modules if m not in named]
        if missing:
            sample = ", ".join(n for n, m in named.items() if isinstance(m, nn.Linear))
            raise ValueError(f"no module named {missing[:3]} in the model; prunable ones: {sample[:300]}...")
        wrong = [
            f"{m} ({type(named[m]).__name__})" for m in modules if not isinstance(named[m], (nn.Linear, nn.Embedding))
        ]
        if wrong:
            raise TypeError(f"only nn.Linear and nn.Embedding weights can be magnitude-pruned, not {wrong[:3]}")
        chosen = [(m, named[m]) for m in modules]
    else:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        chosen = [
            (n, m)
            for n, m in named.items()
            if (isinstance(m, nn.Linear) and (m is not head or include_lm_head))
            or (isinstance(m, nn.Embedding) and include_embeddings)
        ]
    weights: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for name, module in chosen:
        if id(module.weight) not in seen:
            seen.add(id(module.weight))
            weights[name] = module.weight
    if not weights:
        raise ValueError(f"{type(model).__name__} has no nn.Linear weights to prune with this selection")
    return weights


# ----------------------------------------------------------------------------- masks


def _check_sparsity(sparsity: float) -> None:
    if not isinstance(sparsity, (int, float)) or not 0 <= sparsity < 1:
        raise ValueError(f"sparsity must be in [0, 1) (the share of weights set to zero), got {sparsity!r}")


def _drop_smallest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Keep-mask of a flat tensor that drops exactly its k smallest scores (as torch.nn.utils.prune does)."""
    keep = torch.ones(scores.numel(), dtype=torch.bool, device=scores.device)
    if k:
        keep[torch.topk(scores, k, largest=False, sorted=False).indices] = False
    return keep


def magnitude_masks(
    weights: dict[str, torch.Tensor], sparsity: float, *, scope: str = "layer"
) -> dict[str, torch.Tensor]:
    """Boolean keep-masks that zero the smallest |w|: round(sparsity·n) in each matrix, or across all of them.

    "layer" gives every matrix the same sparsity; "global" ranks all weights together, so matrices
    with small weights lose more.
    """
    _check_sparsity(sparsity)
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    with torch.no_grad():
        if scope == "layer":
            return {
                name: _drop_smallest(w.abs().flatten(), round(sparsity * w.numel())).view_as(w)
                for name, w in weights.items()
            }
        scores = torch.cat([w.detach().abs().flatten() for w in weights.values()])
        keep = _drop_smallest(scores, round(sparsity * scores.numel()))
        del scores
        return {
            name: part.view_as(w)
            for (name, w), part in zip(weights.items(), keep.split([w.numel() for w in weights.values()]))
        }


def nm_masks(weights: dict[str, torch.Tensor], n: int = 2, m: int = 4) -> dict[str, torch.Tensor]:
    """Keep-masks with the n largest |w| of every m consecutive inputs of each row (2:4: NVIDIA's sparse pattern)."""
    if not (isinstance(n, int) and isinstance(m, int)) or not 0 < n <= m:
        raise ValueError(f"N:M pruning keeps n of every m weights: need 0 < n <= m, got n={n}, m={m}")
    masks = {}
    with torch.no_grad():
        for name, w in weights.items():
            if w.ndim != 2 or w.shape[1] % m:
                raise ValueError(f"{name}: {m} must divide the input width for {n}:{m} groups, shape {tuple(w.shape)}")
            groups = w.abs().reshape(w.shape[0], -1, m)
            keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.topk(n, dim=-1).indices, True)
            masks[name] = keep.view_as(w)
    return masks


def is_nm_sparse(weight: torch.Tensor, n: int = 2, m: int = 4) -> bool:
    """True when every group of m consecutive inputs in every row holds at most n non-zeros."""
    return bool(((weight.reshape(weight.shape[0], -1, m) != 0).sum(-1) <= n).all())


# ----------------------------------------------------------------------------- applying masks


@dataclass
class Pruning:
    """Keep-masks applied to a model: the pruned weights are zero, and stay zero while this is active."""

    masks: dict[str, torch.Tensor]
    _hooks: list[Any] = field(default_factory=list, repr=False)

    @property
    def active(self) -> bool:
        return bool(self._hooks)

    def remove(self) -> dict[str, torch.Tensor]:
        """Make the pruning permanent: the zeros stay in the weights, gradients are no longer masked."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return self.masks


def apply_masks(model: nn.Module, masks: dict[str, torch.Tensor], *, permanent: bool = False) -> Pruning:
    """Zero the weights where `masks` is False; unless permanent, mask their gradients from now on.

    Every name and shape is checked before any weight changes.
    """
    named = dict(model.named_modules())
    for name, mask in masks.items():
        if name not in named or not hasattr(named[name], "weight"):
            raise ValueError(f"mask for {name!r}, but the model has no module with a weight of that name")
        if tuple(mask.shape) != tuple(named[name].weight.shape):
            raise ValueError(
                f"mask for {name!r} has shape {tuple(mask.shape)}, the weight {tuple(named[name].weight.shape)}"
            )
    pruning = Pruning({})
    with torch.no_grad():
        for name, mask in masks.items():
            weight = named[name].weight
            keep = mask.to(device=weight.device, dtype=torch.bool)
            weight.mul_(keep)
            pruning.masks[name] = keep
            if not permanent:
                pruning._hooks.append(weight.register_hook(lambda g, keep=keep: g * keep))
    return pruning


def magnitude_prune(
    model: nn.Module, sparsity: float, *, scope: str = "layer", permanent: bool = False, **selection: Any
) -> Pruning:
    """Zero the smallest-magnitude weights per layer or globally (`selection`: see prunable_weights)."""
    return apply_masks(
        model, magnitude_masks(prunable_weights(model, **selection), sparsity, scope=scope), permanent=permanent
    )


def nm_prune(model: nn.Module, n: int = 2, m: int = 4, *, permanent: bool = False, **selection: Any) -> Pruning:
    """Keep the n largest of every m consecutive weights in each row of the selected matrices."""
    return apply_masks(model, nm_masks(prunable_weights(model, **selection), n, m), permanent=permanent)


def save_masks(masks: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Write keep-masks as safetensors (uint8), atomically."""
    data = save(
        {name: mask.to(torch.uint8).contiguous().cpu() for name, mask in masks.items()},
        metadata={"format": "labkit.prune keep-masks"},
    )
    return assets.atomic_write_bytes(path, data)


def load_masks(path: str | Path) -> dict[str, torch.Tensor]:
    """Read keep-masks written by save_masks (boolean tensors on the CPU)."""
    return {name: t.bool() for name, t in load_file(str(path)).items()}


# ----------------------------------------------------------------------------- counting


@dataclass(frozen=True)
class LayerSparsity:
    """Zeros counted in one weight matrix."""

    name: str
    shape: tuple[int, ...]
    zeros: int

    @property
    def params(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def sparsity(self) -> float:
        return self.zeros / self.params


def sparsity_report(model: nn.Module, **selection: Any) -> list[LayerSparsity]:
    """Zeros actually present in each prunable weight (not what a mask says)."""
    return [
        LayerSparsity(name, tuple(w.shape), int((w == 0).sum()))
        for name, w in prunable_weights(model, **selection).items()
    ]


def overall_sparsity(report: list[LayerSparsity]) -> float:
    """Share of zeros over all weights of a report."""
    return sum(r.zeros for r in report) / sum(r.params for r in report)


# ----------------------------------------------------------------------------- sensitivity


def groups_by(names: Iterable[str], by: str) -> dict[str, list[str]]:
    """Group module names by decoder layer ("layer 7") or by kind ("q_proj"), for sensitivity scans."""
    if by not in ("layer", "kind"):
        raise ValueError(f"group by 'layer' or 'kind', got {by!r}")
    groups: dict[str, list[str]] = {}
    for name in names:
        found = re.search(r"\.(\d+)\.", name)
        key = (f"layer {found.group(1)}" if found else name) if by == "layer" else name.rsplit(".", 1)[-1]
        groups.setdefault(key, []).append(name)
    return groups


def sensitivity(
    model: nn.Module,
    score: Callable[[nn.Module], float],
    groups: dict[str, list[str]],
    sparsity: float,
) -> dict[str, float]:
    """score(model) after pruning each group alone to `sparsity` per layer; the weights are restored after each."""
    _check_sparsity(sparsity)
    weights = {name: w for names in groups.values() for name, w in prunable_weights(model, modules=names).items()}
    results = {}
    for group, names in groups.items():
        chosen = {n: weights[n] for n in names if n in weights}
        saved = {n: w.detach().clone() for n, w in chosen.items()}
        try:
            apply_masks(model, magnitude_masks(chosen, sparsity), permanent=True)
            results[group] = score(model)
        finally:
            with torch.no_grad():
                for n, w in chosen.items():
                    w.copy_(saved[n])
    return results


# ----------------------------------------------------------------------------- recovery


def prune_and_recover(
    model: nn.Module,
    loader: Iterable,
    sparsities: Sequence[float],
    train: TrainConfig,
    *,
    score: Callable[[nn.Module], float],
    scope: str = "global",
    **selection: Any,
) -> list[dict[str, Any]]:
    """Gradual magnitude pruning: for each sparsity in turn, prune, score, fine-tune with the masks held, score.

    `train` configures each round's fine-tune; the rounds draw successive batches from one stream
    over `loader`, epoch after epoch. Returns one record per round (sparsity counted from the zeros).
    """
    if list(sparsities) != sorted(sparsities):
        raise ValueError(f"sparsities must not decrease from round to round, got {list(sparsities)}")
    if train.checkpoint_dir:
        raise ValueError("prune_and_recover runs several short fits: leave train.checkpoint_dir unset")
    for s in sparsities:
        _check_sparsity(s)
    stream = DataStream(loader)
    batches = iter(stream.__next__, None)  # endless: each round continues where the last stopped
    rounds = []
    for s in sparsities:
        pruning = magnitude_prune(model, s, scope=scope, **selection)
        pruned = score(model)
        try:
            history = fit(model, batches, train)
        finally:
            pruning.remove()
        model.eval()
        rounds.append(
            {
                "target": s,
                "sparsity": overall_sparsity(sparsity_report(model, **selection)),
                "pruned": pruned,
                "recovered": score(model),
                "history": history,
            }
        )
    return rounds


# ----------------------------------------------------------------------------- structured


def _llama_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a Llama-shaped model, the only shape structured pruning knows how to edit."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    config = getattr(model, "config", None)
    if (
        layers is None
        or not all(hasattr(config, k) for k in ("intermediate_size", "num_attention_heads"))
        or not all(hasattr(layer, "mlp") and hasattr(layer.mlp, "gate_proj") for layer in layers)
    ):
        raise TypeError(
            f"structured pruning expects a Llama-style transformers model (model.layers[i].mlp."
            f"gate_proj/up_proj/down_proj, self_attn.q/k/v/o_proj), got {type(model).__name__}"
        )
    return layers


def model_shapes(model: nn.Module) -> dict[str, int]:
    """The sizes structured pruning changes, read from the modules themselves, and the parameter count."""
    layers = _llama_layers(model)
    attn = layers[0].self_attn
    return {
        "layers": len(layers),
        "hidden": model.config.hidden_size,
        "mlp_channels": layers[0].mlp.gate_proj.out_features,
        "heads": attn.q_proj.out_features // attn.head_dim,
        "kv_heads": attn.k_proj.out_features // attn.head_dim,
        "head_dim": attn.head_dim,
        "params": count_parameters(model),
    }


IMPORTANCES = ("magnitude", "taylor")


def _check_importance(importance: str, calibration: Sequence[torch.Tensor] | None) -> None:
    if importance not in IMPORTANCES:
        raise ValueError(f"importance must be one of {IMPORTANCES}, got {importance!r}")
    if importance == "taylor" and not calibration:
        raise ValueError("taylor importance needs calibration batches: a list of input_ids tensors")


@contextlib.contextmanager
def _importance_grads(model: nn.Module, importance: str, calibration: Sequence[torch.Tensor] | None) -> Iterator[None]:
    """For "taylor", fill .grad with the mean loss gradient over the calibration batches, cleared afterwards."""
    if importance == "magnitude":
        yield
        return
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    with eval_mode(model):  # gradients of the model as it serves: dropout off
        try:
            for ids in calibration:
                ids = ids.to(device)
                (model(input_ids=ids, labels=ids).loss / len(calibration)).backward()
            yield
        finally:
            model.zero_grad(set_to_none=True)


def prune_mlp_channels(
    model: nn.Module,
    ratio: float,
    *,
    importance: str = "magnitude",
    calibration: Sequence[torch.Tensor] | None = None,
    round_to: int = 8,
) -> dict[str, int]:
    """Remove the same share of MLP channels from every decoder layer, least important first (torch-pruning).

    The dependency graph prunes gate_proj and up_proj rows with the matching down_proj columns;
    every layer keeps the same width (rounded to `round_to`) so that config.intermediate_size
    describes it. "magnitude" ranks a channel by the L2 norm of its weights; "taylor" by
    |weight × gradient|, a first-order estimate of the loss change, from `calibration` batches.
    """
    _check_sparsity(ratio)
    _check_importance(importance, calibration)
    layers = _llama_layers(model)
    if ratio == 0:
        return model_shapes(model)
    ignored = [model.get_output_embeddings()] + [
        m
        for layer in layers
        for m in (
            layer.self_attn.q_proj,
            layer.self_attn.k_proj,
            layer.self_attn.v_proj,
            layer.self_attn.o_proj,
            layer.mlp.down_proj,
        )
    ]
    device = next(model.parameters()).device
    example = torch.randint(0, model.config.vocab_size, (1, 8), device=device)
    scorer = tp.importance.MagnitudeImportance(p=2) if importance == "magnitude" else tp.importance.TaylorImportance()
    with _importance_grads(model, importance, calibration), warnings.catch_warnings():
        # torch-pruning lists the norm gains as "unwrapped" parameters; the ignored layers keep them whole
        warnings.filterwarnings("ignore", message="Unwrapped parameters detected")
        pruner = tp.pruner.MetaPruner(
            model,
            example,
            importance=scorer,
            pruning_ratio=ratio,
            ignored_layers=ignored,
            round_to=round_to,
            output_transform=lambda out: out.logits,
        )
        for group in pruner.step(interactive=True):
            group.prune()
    widths = {layer.mlp.gate_proj.out_features for layer in layers}
    if len(widths) != 1:
        raise RuntimeError(f"torch-pruning left unequal MLP widths {sorted(widths)}; the config cannot hold them")
    model.config.intermediate_size = widths.pop()
    for layer in layers:
        if hasattr(layer.mlp, "intermediate_size"):
            layer.mlp.intermediate_size = model.config.intermediate_size
    return model_shapes(model)


def _sliced_linear(linear: nn.Linear, index: torch.Tensor, dim: int) -> nn.Linear:
    """A copy of `linear` keeping only the output rows (dim 0) or input columns (dim 1) in `index`."""
    weight = linear.weight.detach().index_select(dim, index)
    out = nn.Linear(
        weight.shape[1], weight.shape[0], bias=linear.bias is not None, device=weight.device, dtype=weight.dtype
    )
    with torch.no_grad():
        out.weight.copy_(weight)
        if linear.bias is not None:
            out.bias.copy_(linear.bias if dim == 1 else linear.bias.index_select(0, index))
    return out


def _head_scores(attn: nn.Module, n_heads: int, d: int, importance: str) -> torch.Tensor:
    """One importance per query head, from its q_proj rows and o_proj columns."""

    def per_weight(w: torch.Tensor) -> torch.Tensor:
        return w.detach().pow(2) if importance == "magnitude" else (w.detach() * w.grad).abs()

    q = per_weight(attn.q_proj.weight).view(n_heads, d, -1)
    o = per_weight(attn.o_proj.weight).view(-1, n_heads, d)
    return q.sum((1, 2)) + o.sum((0, 2))


def prune_attention_heads(
    model: nn.Module,
    heads: int,
    *,
    importance: str = "magnitude",
    calibration: Sequence[torch.Tensor] | None = None,
) -> dict[str, int]:
    """Remove `heads` query heads from every layer, the same number from each key/value group, smallest first.

    Grouped-query attention shares each key/value head among consecutive query heads, so a pruned
    model stays valid only if every group loses the same number: `heads` must be a multiple of the
    number of groups and leave each group at least one head. A head's importance is the squared L2
    norm of its q_proj rows and o_proj columns ("magnitude") or the sum of |weight × gradient| over
    them ("taylor", from `calibration` batches).
    """
    layers = _llama_layers(model)
    attn0 = layers[0].self_attn
    n_heads, d = attn0.q_proj.out_features // attn0.head_dim, attn0.head_dim
    n_groups = attn0.k_proj.out_features // d
    per_group = n_heads // n_groups
    if not isinstance(heads, int) or heads < 0 or heads % n_groups or heads // n_groups >= per_group:
        raise ValueError(
            f"cannot remove {heads!r} of {n_heads} query heads: they share {n_groups} key/value heads, "
            f"{per_group} query heads each, so remove a multiple of {n_groups} (at most "
            f"{n_heads - n_groups}, which leaves one query head per group)"
        )
    _check_importance(importance, calibration)
    if heads == 0:
        return model_shapes(model)
    drop = heads // n_groups
    with _importance_grads(model, importance, calibration):
        scores = [_head_scores(layer.self_attn, n_heads, d, importance).view(n_groups, per_group) for layer in layers]
    for layer, score in zip(layers, scores):
        attn = layer.self_attn
        keep = score.topk(per_group - drop, dim=1).indices.sort(dim=1).values  # order within a group kept
        heads_kept = (keep + torch.arange(n_groups, device=keep.device)[:, None] * per_group).flatten()
        rows = (heads_kept[:, None] * d + torch.arange(d, device=keep.device)).flatten()
        attn.q_proj = _sliced_linear(attn.q_proj, rows, 0)
        attn.o_proj = _sliced_linear(attn.o_proj, rows, 1)
        attn.num_key_value_groups = per_group - drop
    model.config.num_attention_heads = n_heads - heads
    model.config.head_dim = d  # no longer hidden_size // num_attention_heads
    return model_shapes(model)


# ----------------------------------------------------------------------------- 2:4 kernels (GPU)


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
