"""Pipeline parallelism: cut a Llama into stages, run GPipe or 1F1B with torch.distributed.pipelining,
record when every stage computes which micro-batch, and measure the bubble against (p−1)/(m+p−1)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

SCHEDULES = ("gpipe", "1f1b")


def bubble_formula(stages: int, microbatches: int) -> float:
    """Idle share of a GPipe/1F1B pipeline with equal stage costs: (p − 1) / (m + p − 1)."""
    if stages < 1 or microbatches < 1:
        raise ValueError(f"need stages >= 1 and microbatches >= 1, got {stages}, {microbatches}")
    return (stages - 1) / (microbatches + stages - 1)


def schedule_order(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The (kind, micro-batch) sequence one stage runs: GPipe all F then all B; 1F1B (as torch's
    Schedule1F1B) min(m, p − stage) warm-up forwards, then alternating B/F, then the remaining Bs."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not 0 <= stage < stages or microbatches < 1:
        raise ValueError(f"need 0 <= stage < stages and microbatches >= 1, got {stage}, {stages}, {microbatches}")
    if schedule == "gpipe":
        return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
    warmup = min(microbatches, stages - stage)
    order = [("F", i) for i in range(warmup)]
    for i in range(microbatches):
        order.append(("B", i))
        if warmup + i < microbatches:
            order.append(("F", warmup + i))
    return order


def executed_order(events: list[dict[str, Any]], rank: int) -> list[tuple[str, int]]:
    """The (kind, micro-batch) sequence a rank actually ran, from `StageTimeline.events`."""
    return [(e["kind"], e["microbatch"]) for e in sorted(events, key=lambda e: e["start"]) if e["rank"] == rank]


def layer_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal blocks of decoder layers, one per stage."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    bounds = [round(i * num_layers / num_stages) for i in range(num_stages + 1)]
    return list(zip(bounds, bounds[1:]))


class LlamaStage(nn.Module):
    """Decoder layers [start, end) of a transformers Llama; the first stage embeds, the last one predicts.

    It takes and returns one tensor (token ids in, hidden states between stages, logits out), as
    torch.distributed.pipelining needs, and recomputes the rotary position embeddings itself.
    Attention is causal through SDPA (no mask), so sequences must be unpadded, packed blocks.
    """

    def __init__(self, model: nn.Module, stage: int, num_stages: int):
        super().__init__()
        if getattr(model.config, "tie_word_embeddings", False) and num_stages > 1:
            raise ValueError(
                "tied input/output embeddings would live on two stages; use an untied model "
                "(real pipelines all-reduce the tied gradient between first and last stage)"
            )
        start, end = layer_ranges(model.config.num_hidden_layers, num_stages)[stage]
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.embed = model.model.embed_tokens if self.first else None
        self.layers = nn.ModuleList(model.model.layers[start:end])
        self.rotary = model.model.rotary_emb
        self.norm = model.model.norm if self.last else None
        self.head = model.lm_head if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.first else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0).expand(h.shape[0], -1)
        rotary = self.rotary(h, position_ids=positions)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        return self.head(self.norm(h)) if self.last else h


class StageTimeline:
    """Times every forward and backward of one PipelineStage on a clock the ranks of a machine share.

    On a CPU the work is done when a call returns, so time.perf_counter (machine-wide and monotonic on
    Linux) brackets it. On CUDA a call returns once its kernels are queued: CUDA events recorded on the
    stream time the kernels themselves, and one reference event recorded right after a synchronization
    in `start` places them on the perf_counter axis. No synchronization inside the step, which would
    change the schedule being measured.
    """

    def __init__(self, stage: Any, rank: int, device: torch.device):
        self.rank, self.cuda = rank, torch.device(device).type == "cuda"
        self._raw: list[dict[str, Any]] = []
        self._origin: tuple[float, Any] | None = None
        stage.forward_one_chunk = self._timed("F", stage.forward_one_chunk)
        stage.backward_one_chunk = self._timed("B", stage.backward_one_chunk)

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _timed(self, kind: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def run(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            start = self._mark()
            out = method(chunk_id, *args, **kwargs)
            self._raw.append(
                {"rank": self.rank, "kind": kind, "microbatch": chunk_id, "start": start, "end": self._mark()}
            )
            return out

        return run

    def start(self) -> None:
        """Forget earlier steps and fix the time origin (call before the step to record)."""
        self._raw.clear()
        if self.cuda:
            torch.cuda.synchronize()
            self._origin = (time.perf_counter(), self._mark())

    def events(self) -> list[dict[str, Any]]:
        """The recorded events with start/end in perf_counter seconds (waits for the device first)."""
        if not self.cuda:
            return [dict(e) for e in self._raw]
        if self._origin is None:
            raise RuntimeError("call start() before the step, so CUDA times have an origin")
        torch.cuda.synchronize()
        t0, ref = self._origin
        return [
            {**e, "start": t0 + ref.elapsed_time(e["start"]) / 1e3, "end": t0 + ref.elapsed_time(e["end"]) / 1e3}
            for e in self._raw
        ]


def bubble_fraction(events: list[dict[str, Any]]) -> float:
    """Measured idle share: 1 − (busy time summed over ranks) / (ranks × span from first start to last end)."""
    if not events:
        raise ValueError("no events recorded")
    ranks = {e["rank"] for e in events}
    span = max(e["end"] for e in events) - min(e["start"] for e in events)
    busy = sum(e["end"] - e["start"] for e in events)
    return 1 - busy / (len(ranks) * span)


def max_in_flight(events: list[dict[str, Any]], rank: int) -> int:
    """Most micro-batches whose forward had finished and backward had not, on one rank: what it must keep."""
    marks = sorted(
        [(e["end"], 1) for e in events if e["rank"] == rank and e["kind"] == "F"]
        + [(e["end"], -1) for e in events if e["rank"] == rank and e["kind"] == "B"]
    )
    held = peak = 0
    for _, change in marks:
        held += change
        peak = max(peak, held)
    return peak


def saved_activation_bytes(module: nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes autograd saves for backward during one forward of `module` (storage counted once)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)  # weights are not activations


def plot_timeline(events: list[dict[str, Any]], title: str = "Pipeline timeline"):
    """A Gantt chart per rank: forward (blue) and backward (orange) boxes labelled with the micro-batch."""
    # matplotlib (also under labkit.plots) is imported here, not at the top: every torchrun rank imports this
    # module to build its stage, none of them plots, and matplotlib would add about 0.3 s to each rank's start
    import matplotlib.pyplot as plt

    from labkit.plots import use_style

    use_style()
    t0 = min(e["start"] for e in events)
    ranks = sorted({e["rank"] for e in events})
    fig, ax = plt.subplots(figsize=(8, 0.8 + 0.6 * len(ranks)))
    for e in events:
        color = "C0" if e["kind"] == "F" else "C1"
        left, width = (e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3
        ax.barh(e["rank"], width, left=left, color=color, edgecolor="white")
        ax.text(
            left + width / 2,
            e["rank"],
            f"{e['kind']}{e['microbatch']}",
            ha="center",
            va="center",
            fontsize=7,
            color="white",
        )
    ax.set_yticks(ranks, [f"stage {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set(xlabel="milliseconds", title=title)
    ax.grid(axis="y", visible=False)
    fig.tight_layout()
    return fig
