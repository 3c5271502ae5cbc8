"""Structured pruning into a smaller dense model.

Whole MLP channels go (torch-pruning's dependency graph keeps gate, up and down projections
consistent) and whole attention heads (in labkit: torch-pruning cannot group a grouped-query
attention's heads), leaving a dense model with smaller matrices that transformers saves and reloads.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence

import torch
import torch_pruning as tp
from torch import nn

from labkit.models import count_parameters
from labkit.prune.masks import check_sparsity
from labkit.torchutil import eval_mode


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


IMPORTANCES = ("magnitude", "activation", "taylor")


def _check_importance(importance: str, calibration: Sequence[torch.Tensor] | None) -> None:
    if importance not in IMPORTANCES:
        raise ValueError(f"importance must be one of {IMPORTANCES}, got {importance!r}")
    if importance != "magnitude" and not calibration:
        raise ValueError(f"{importance} importance needs calibration batches: a list of input_ids tensors")


def _input_norms(model: nn.Module, linears: Sequence[nn.Linear], calibration: Sequence[torch.Tensor]) -> dict:
    """The L2 norm of each input column of `linears` over every calibration token (no gradients)."""
    sums = {m: torch.zeros(m.in_features, dtype=torch.float64, device=m.weight.device) for m in linears}

    def accumulate(module: nn.Module, args: tuple) -> None:
        sums[module] += args[0].detach().double().pow(2).flatten(0, -2).sum(0)

    handles = [m.register_forward_pre_hook(accumulate) for m in linears]
    device = next(model.parameters()).device
    try:
        with eval_mode(model), torch.inference_mode():
            for ids in calibration:
                model(input_ids=ids.to(device))
    finally:
        for handle in handles:
            handle.remove()
    return {m: s.sqrt().float() for m, s in sums.items()}


@contextlib.contextmanager
def _calibrated(model: nn.Module, importance: str, calibration: Sequence[torch.Tensor] | None) -> Iterator[dict]:
    """Run the calibration an importance needs: "taylor" fills .grad with the mean loss gradient (cleared
    afterwards); "activation" yields the input norms of every down_proj and o_proj column."""
    if importance == "magnitude":
        yield {}
        return
    if importance == "activation":
        layers = _llama_layers(model)
        yield _input_norms(model, [m for x in layers for m in (x.mlp.down_proj, x.self_attn.o_proj)], calibration)
        return
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    with eval_mode(model):  # gradients of the model as it serves: dropout off
        try:
            for ids in calibration:
                ids = ids.to(device)
                (model(input_ids=ids, labels=ids).loss / len(calibration)).backward()
            yield {}
        finally:
            model.zero_grad(set_to_none=True)


class _WrittenOutput(tp.importance.Importance):
    """Channel c scores ‖W_down[:, c]‖ · ‖X_c‖: the size of what it writes into the residual stream on
    calibration text (Wanda's |W|·‖X‖, summed over a channel), no gradients needed."""

    def __init__(self, input_norms: dict) -> None:
        self.input_norms = input_norms

    @torch.no_grad()
    def __call__(self, group: tp.dependency.Group) -> torch.Tensor:
        for i, (dep, idxs) in enumerate(group):
            norms = self.input_norms.get(dep.layer)
            if norms is not None and dep.pruning_fn == tp.prune_linear_in_channels:
                score = dep.layer.weight.detach().norm(dim=0)[idxs] * norms[idxs]
                root = torch.tensor(group[i].root_idxs, device=score.device)
                return torch.zeros(len(idxs), device=score.device).scatter_(0, root, score)
        raise RuntimeError("activation importance found no down_proj in a torch-pruning group")


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
    describes it. "magnitude" ranks a channel by the L2 norm of its weights; "activation" by
    ‖down_proj column‖ · ‖its input‖ over the `calibration` batches (what it writes, no gradients);
    "taylor" by |weight × gradient|, a first-order estimate of the loss change, from `calibration`.
    """
    check_sparsity(ratio)
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
    with _calibrated(model, importance, calibration) as norms, warnings.catch_warnings():
        scorer = {
            "magnitude": tp.importance.MagnitudeImportance(p=2),
            "activation": _WrittenOutput(norms),
            "taylor": tp.importance.TaylorImportance(),
        }[importance]
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


def _head_scores(attn: nn.Module, n_heads: int, d: int, importance: str, norms: dict) -> torch.Tensor:
    """One importance per query head, from its q_proj rows and o_proj columns (and o_proj's inputs)."""
    if importance == "activation":
        o = attn.o_proj.weight.detach().pow(2).sum(0) * norms[attn.o_proj].pow(2)
        return o.view(n_heads, d).sum(1)

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
    norm of its q_proj rows and o_proj columns ("magnitude"), Σ ‖o_proj column‖² · ‖its input‖² over
    the head's columns ("activation", from `calibration` batches) or the sum of |weight × gradient|
    over its rows and columns ("taylor", from `calibration`).
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
    with _calibrated(model, importance, calibration) as norms:
        scores = [_head_scores(x.self_attn, n_heads, d, importance, norms).view(n_groups, per_group) for x in layers]
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
