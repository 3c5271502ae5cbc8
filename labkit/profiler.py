"""Where a step's time goes: torch.profiler over a few steps, a trace file, the top operators and a phase breakdown.

`profile_steps` runs a step function under `torch.profiler` with a wait / warm-up / active schedule (the first
steps allocate memory and pick kernels; only the active ones are recorded) and writes one Chrome-trace JSON,
which Perfetto (ui.perfetto.dev, or a local copy), chrome://tracing and TensorBoard's PyTorch profiler plugin
(torch-tb-profiler, the `monitor` extra; archived upstream, still working) all open. The file is named
`<worker>.pt.trace.json` inside a run folder, the layout that plugin reads.

labkit's trainer marks its phases with `phase("data" | "forward" | "backward" | "optimizer")`; the breakdown
reads those marks back from the trace itself, plus every collective (gloo / NCCL) as communication, and calls
the rest of the step "other". On a GPU it also reads the device's timeline: the share of the step in which any
kernel ran, which is what nvidia-smi's "GPU-Util" reports, and not how much of the chip did work.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, record_function

from labkit import bench
from labkit.torchutil import as_path, check_bool, check_int

PHASES = ("data", "forward", "backward", "optimizer")
PREFIX = "labkit/"
MATMUL = r"^aten::(mm|addmm|bmm|baddbmm)$"  # the operators that do a matrix product's work (linear calls them)
COMMUNICATION = re.compile(r"nccl|gloo|c10d|all_?reduce|reduce_?scatter|all_?gather|broadcast", re.I)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a phase of a training step in any running trace (a few microseconds; nothing without a profiler)."""
    if name not in PHASES:  # `breakdown` reads these four back; another name would vanish from it unseen
        raise ValueError(f"phase must be one of {PHASES}, got {name!r}")
    with record_function(PREFIX + name):
        yield


@dataclass
class Trace:
    """What `profile_steps` recorded: the trace file and the figures read from it, per active step."""

    path: Path
    steps: int
    device: str
    operators: list[dict[str, Any]]  # one row per operator name, per step, slowest first (device self time if any)
    breakdown: dict[str, float]  # seconds per step: each phase, communication, other, step
    device_busy: float | None = None  # share of the step with a kernel running (CUDA only)
    events: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def top(self, n: int = 10, by: str = "self_s") -> list[dict[str, Any]]:
        """The `n` operators with the most `by` ('self_s', 'total_s', 'calls' or 'self_memory_bytes')."""
        check_int("n", n, minimum=1)
        if not self.operators or by not in self.operators[0]:
            raise ValueError(f"by must be one of {list(self.operators[0]) if self.operators else []}, got {by!r}")
        return sorted(self.operators, key=lambda row: -row[by])[:n]

    def share(self, pattern: str) -> float:
        """Share of all operators' self time spent in operators whose name matches `pattern` (a regex)."""
        regex = _regex(pattern)
        total = sum(row["self_s"] for row in self.operators)
        picked = sum(row["self_s"] for row in self.operators if regex.search(row["name"]))
        return picked / total if total else 0.0

    def count(self, pattern: str) -> float:
        """Calls per step of the operators whose name matches `pattern` (e.g. 'aten::_local_scalar_dense')."""
        regex = _regex(pattern)
        return sum(row["calls"] for row in self.operators if regex.search(row["name"]))


def _regex(pattern: str) -> re.Pattern[str]:
    """`pattern` compiled, or a TypeError / ValueError that names it (re.error is neither)."""
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a regex string (e.g. profiler.MATMUL), got {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as err:
        raise ValueError(f"pattern {pattern!r} is not a valid regex: {err}") from None


def _step_spans(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """The ProfilerStep# ranges of a trace's events, refused (by name) unless a list of event dicts with some."""
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise TypeError("events must be a list of Chrome-trace event dicts (a trace file's 'traceEvents')")
    steps = _spans(events, lambda e: e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#"))
    if not steps:
        raise ValueError("no ProfilerStep# events: was the trace recorded with a schedule and prof.step()?")
    return steps


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: nested or overlapping events count once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _spans(events: list[dict[str, Any]], keep: Callable[[dict[str, Any]], bool]) -> list[tuple[float, float]]:
    return [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and "dur" in e and keep(e)]


def breakdown(events: list[dict[str, Any]], side: str = "cpu") -> dict[str, float]:
    """Seconds per step in each phase, in communication and in the rest, read from Chrome-trace events.

    side="cpu" reads the host's timeline (what the Python process waited for); side="device" the GPU's, where
    CUDA marks the same annotations as "gpu_user_annotation" and kernels as "kernel"."""
    if side not in ("cpu", "device"):
        raise ValueError(f"side must be 'cpu' or 'device', got {side!r}")
    mark = "user_annotation" if side == "cpu" else "gpu_user_annotation"
    steps = _step_spans(events)
    n = len(steps)
    in_phase = {p: _spans(events, lambda e, p=p: e.get("cat") == mark and e["name"] == PREFIX + p) for p in PHASES}
    result = {p: _covered(spans) for p, spans in in_phase.items()}
    ops = ("cpu_op", "user_annotation") if side == "cpu" else ("kernel",)
    collective = _spans(events, lambda e: e.get("cat") in ops and COMMUNICATION.search(e["name"]))
    result["communication"] = _covered(collective)
    marked = _covered([span for spans in in_phase.values() for span in spans])
    result["step"] = _covered(steps)
    result["other"] = max(0.0, result["step"] - marked)
    return {k: v / n / 1e6 for k, v in result.items()}  # trace times are microseconds


def step_breakdowns(events: list[dict[str, Any]], side: str = "cpu") -> list[dict[str, float]]:
    """`breakdown` of each profiled step on its own: the spread over steps that a claim about a share needs."""
    return [breakdown([e for e in events if "ts" in e and a <= e["ts"] < b], side) for a, b in _step_spans(events)]


def device_busy(events: list[dict[str, Any]]) -> float | None:
    """Share of the profiled steps' time in which at least one GPU kernel ran (None: no kernels in the trace)."""
    steps = _step_spans(events)
    kernels = _spans(events, lambda e: e.get("cat") == "kernel")
    if not kernels:
        return None
    start, end = min(a for a, _ in steps), max(b for _, b in steps)
    inside = [(max(a, start), min(b, end)) for a, b in kernels if b > start and a < end]
    return _covered(inside) / (end - start)


@contextlib.contextmanager
def _without_kineto_lines() -> Iterator[None]:
    """Hold back what torch 2.13 writes to the process's stderr around every profile, which a notebook shows as stray
    output: kineto's two lines ("USDT: ... profiler_start") and the allocator's note that memory allocated before the
    profile has no deallocation event in it. Anything else written there is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(True)
            rest = [
                line for line in lines if "USDT:" not in line and "allocated before the profiling started" not in line
            ]
            if rest:
                sys.stderr.write("".join(rest))


def _operator_rows(prof: torch.profiler.profile, steps: int) -> list[dict[str, Any]]:
    """key_averages as plain rows per step, without the step and phase annotations (they are not operators)."""
    rows = []
    for ev in prof.key_averages():
        if ev.key.startswith(("ProfilerStep", PREFIX)):
            continue
        self_device = getattr(ev, "self_device_time_total", 0) or 0
        rows.append(
            {
                "name": ev.key,
                "calls": ev.count / steps,
                "self_s": (self_device or ev.self_cpu_time_total) / 1e6 / steps,
                "total_s": (getattr(ev, "device_time_total", 0) or ev.cpu_time_total) / 1e6 / steps,
                "self_cpu_s": ev.self_cpu_time_total / 1e6 / steps,
                "self_device_s": self_device / 1e6 / steps,
                "self_memory_bytes": max(ev.self_cpu_memory_usage, getattr(ev, "self_device_memory_usage", 0) or 0),
            }
        )
    return sorted(rows, key=lambda row: -row["self_s"])


def profile_steps(
    step: Callable[[], Any],
    out_dir: str | Path,
    *,
    active: int = 3,
    warmup: int = 1,
    wait: int = 1,
    device: str | torch.device | None = None,
    record_shapes: bool = True,
    profile_memory: bool = True,
    with_stack: bool = False,
) -> Trace:
    """Call `step()` wait + warmup + active times under torch.profiler; record the active ones.

    Writes `<out_dir>/<host>_<pid>.pt.trace.json` (whole or not at all) and returns the operators and the
    phase breakdown per active step. CUDA activity is recorded when `device` is a GPU."""
    for name, value in (("active", active), ("warmup", warmup), ("wait", wait)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "active" else 0):
            raise ValueError(f"{name} must be an int >= {1 if name == 'active' else 0}, got {value!r}")
    if not callable(step):
        raise TypeError(f"step must be callable (a function that runs one training step), got {step!r}")
    for name, flag in (
        ("record_shapes", record_shapes),
        ("profile_memory", profile_memory),
        ("with_stack", with_stack),
    ):
        check_bool(name, flag)
    dev = bench.as_device(device)
    out = as_path("out_dir", out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"out_dir {out} is a file: give a folder for the trace")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{socket.gethostname()}_{os.getpid()}.pt.trace.json"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])

    def save(prof: torch.profiler.profile) -> None:
        tmp = path.with_name(path.name + ".tmp")
        prof.export_chrome_trace(str(tmp))
        tmp.replace(path)

    schedule = torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1)
    with (
        _without_kineto_lines(),
        torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=save,
            record_shapes=record_shapes,
            profile_memory=profile_memory,
            with_stack=with_stack,
        ) as prof,
    ):
        for _ in range(wait + warmup + active):
            step()
            bench.synchronize(dev)  # the step's kernels end inside its ProfilerStep range
            prof.step()
    events = json.loads(path.read_text(encoding="utf-8"))["traceEvents"]
    return Trace(
        path=path,
        steps=active,
        device=bench.device_name(dev),
        operators=_operator_rows(prof, active),
        breakdown=breakdown(events),
        device_busy=device_busy(events),
        events=events,
    )
