"""The measurement harness every lab uses: timing, peak memory, throughput, JSON lines (FLOPs are in flops.py).

Rules it enforces: warm up before timing; synchronize the device before every clock read;
report the median over repeats (and the spread); measure peak memory per region, not per process.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import json
import os
import platform
import re
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from labkit import precision
from labkit.torchutil import device_of

# ----------------------------------------------------------------------------- timing


def as_device(device: str | torch.device | None) -> torch.device:
    """A torch.device; None means CUDA when available, else CPU. Asking for CUDA where torch has none is
    a clear error here, not a driver message later."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = device_of(device)
    if problem := precision.cuda_problem(dev):
        raise ValueError(problem)
    return dev


def synchronize(device: str | torch.device | None = None) -> None:
    """Wait for queued device work, so a clock read afterwards sees it finished."""
    dev = as_device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


@dataclass
class Timing:
    """Seconds per call over `repeats` timed calls (after `warmup` untimed ones)."""

    times: list[float]
    warmup: int

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def max(self) -> float:
        return max(self.times)

    @property
    def repeats(self) -> int:
        return len(self.times)

    def summary(self) -> dict[str, float | int]:
        return {"median_s": self.median, "min_s": self.min, "max_s": self.max, "repeats": self.repeats}

    def __str__(self) -> str:
        spread = f"min {fmt_seconds(self.min)}, max {fmt_seconds(self.max)}"
        return f"{fmt_seconds(self.median)} median of {self.repeats} ({spread})"


def time_fn(
    fn: Callable[[], Any],
    *,
    warmup: int = 2,
    repeats: int = 5,
    device: str | torch.device | None = None,
    clock: Callable[[], float] = time.perf_counter,
    before: Callable[[], Any] | None = None,
    sync: Callable[[], Any] | None = None,
) -> Timing:
    """Call `fn` `warmup` times untimed, then time `repeats` calls, syncing the device around each.

    `before`, if given, runs untimed before every timed call (e.g. a barrier that lines up ranks);
    `sync` replaces `synchronize(device)` (a stream, or a simulated device in the lab 00 exercise).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable (the work to time), got {type(fn).__name__}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    wait = sync or (lambda: synchronize(device))
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        wait()
        start = clock()
        fn()
        wait()
        times.append(clock() - start)
    return Timing(times=times, warmup=warmup)


def time_interleaved(
    fns: dict[str, Callable[[], Any]],
    *,
    warmup: int = 2,
    repeats: int = 5,
    device: str | torch.device | None = None,
    clock: Callable[[], float] = time.perf_counter,
    progress: bool = False,
) -> dict[str, Timing]:
    """Time several functions side by side: each round times each once, so drift in machine load hits all alike.
    `progress` shows a bar over the calls (warm-up included) for timings that take long enough to need one."""
    if not fns or repeats < 1 or warmup < 0:
        raise ValueError(
            f"need functions to time, repeats >= 1 and warmup >= 0, got {len(fns)} functions, "
            f"repeats={repeats}, warmup={warmup}"
        )
    with tqdm(total=len(fns) * (warmup + repeats), desc="timing", leave=False, disable=not progress) as bar:
        for fn in fns.values():
            for _ in range(warmup):
                fn()
                bar.update()
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(repeats):
            for name, fn in fns.items():
                times[name] += time_fn(fn, warmup=0, repeats=1, device=device, clock=clock).times
                bar.update()
    return {name: Timing(times=t, warmup=warmup) for name, t in times.items()}


@dataclass
class Elapsed:
    """Seconds taken by a `stopwatch` block (filled in when the block ends)."""

    seconds: float = float("nan")


@contextlib.contextmanager
def stopwatch(
    device: str | torch.device | None = None, clock: Callable[[], float] = time.perf_counter
) -> Iterator[Elapsed]:
    """Time one long-running block (an evaluation, a training run), syncing the device at both ends."""
    result = Elapsed()
    synchronize(device)
    start = clock()
    yield result
    synchronize(device)
    result.seconds = clock() - start


def fmt_seconds(s: float) -> str:
    """Human-readable duration: 12.3 µs, 4.56 ms, 7.89 s."""
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def fmt_bytes(n: float) -> str:
    """Human-readable size in binary units: 1.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- memory


@dataclass
class PeakMemory:
    """Peak memory of a region. `kind` says what was measured, since CPU and GPU differ."""

    device: str
    kind: str = ""  # 'cuda_allocated' | 'rss' | 'rss_since_process_start'
    peak_bytes: int = 0
    start_bytes: int = 0

    @property
    def delta_bytes(self) -> int:
        """Peak above what was in use when the region started."""
        return self.peak_bytes - self.start_bytes

    def __str__(self) -> str:
        return f"peak {fmt_bytes(self.peak_bytes)} ({self.kind}, +{fmt_bytes(self.delta_bytes)} in region)"


def _proc_status_kib(key: str) -> int | None:
    try:
        match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) for this process; Linux only."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_memory() -> None:
    """Give freed memory back before a measurement: collect garbage, empty the CUDA cache, and on glibc
    trim the heap (freed pages stay resident otherwise, and the next region's peak hides in them)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if platform.system() == "Linux":
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass


_open_regions: list[PeakMemory] = []  # track_peak_memory regions now open, outermost first


def _peak_counter(dev: torch.device) -> tuple[str, int | None]:
    """(kind, bytes) of the resettable peak counter for `dev`: CUDA allocator, else the kernel's VmHWM."""
    if dev.type == "cuda":
        return "cuda_allocated", torch.cuda.max_memory_allocated(dev)
    hwm = _proc_status_kib("VmHWM")
    return "rss", None if hwm is None else hwm * 1024


def _reset_peak_counter(dev: torch.device) -> bool:
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        return True
    return _reset_peak_rss()


@contextlib.contextmanager
def track_peak_memory(device: str | torch.device | None = None) -> Iterator[PeakMemory]:
    """Measure the peak memory of the `with` block: CUDA allocator on GPU, resident set on CPU.

    Regions nest: the counter is shared, so before an inner region resets it, every enclosing region
    takes the peak so far, and after it ends they take its peak; an outer figure never loses one.
    """
    dev = as_device(device)
    result = PeakMemory(device=str(dev))
    start = memory_in_use(dev)  # synchronizes the device
    kind, peak = _peak_counter(dev)
    if peak is None or not _reset_peak_counter(dev):
        # No resettable counter (macOS, Windows): the process-lifetime peak is the best honest figure.
        scale = 1 if platform.system() == "Darwin" else 1024
        result.kind = "rss_since_process_start"
        result.start_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
        yield result
        result.peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
        return
    for outer in _open_regions:
        if outer.device == result.device:
            outer.peak_bytes = max(outer.peak_bytes, peak)
    result.kind, result.start_bytes = kind, start
    _open_regions.append(result)
    try:
        yield result
    finally:
        _open_regions.remove(result)
        synchronize(dev)
        result.peak_bytes = max(result.peak_bytes, _peak_counter(dev)[1] or 0)
        for outer in _open_regions:
            if outer.device == result.device:
                outer.peak_bytes = max(outer.peak_bytes, result.peak_bytes)


@dataclass
class SavedTensors:
    """What autograd saved for the backward inside a `saved_for_backward` block."""

    bytes: int = 0  # each storage once
    tensors: int = 0


@contextlib.contextmanager
def saved_for_backward(exclude: nn.Module | None = None) -> Iterator[SavedTensors]:
    """Count the tensors autograd saves for the backward inside the block, each storage once, leaving out
    `exclude`'s parameters: the activation memory a forward leaves for its backward. Exact on any device, where
    the resident set of a CPU process cannot tell reused memory from new."""
    skip = {p.untyped_storage().data_ptr() for p in exclude.parameters()} if exclude is not None else set()
    storages: dict[int, int] = {}
    result = SavedTensors()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        result.tensors += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield result
    result.bytes = sum(storages.values())


def memory_in_use(device: str | torch.device | None = None) -> int:
    """Bytes in use now: the CUDA allocator's on a GPU, the resident set on a CPU (Linux; 0 elsewhere)."""
    dev = as_device(device)
    if dev.type == "cuda":
        synchronize(dev)
        return torch.cuda.memory_allocated(dev)
    return (_proc_status_kib("VmRSS") or 0) * 1024


def decode_benchmark(
    load: Callable[[], nn.Module],
    prompt_ids: torch.Tensor,
    new_tokens: int,
    *,
    device: str | torch.device | None = None,
    warmup: int = 1,
    repeats: int = 5,
) -> dict[str, Any]:
    """Greedy decode speed and memory of one model, loaded inside the measurement and freed after it.

    weights_bytes is the memory the load added, generate_bytes the generation's peak above that: the
    model under test only, whatever else is resident, so models measured one after another compare.
    """
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    dev = as_device(device)
    release_memory()
    before = memory_in_use(dev)
    model = load()
    weights = memory_in_use(dev) - before
    prompt = prompt_ids.to(dev)

    generate = functools.partial(
        model.generate, prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
    )

    with track_peak_memory(dev) as peak, torch.inference_mode():
        timing = time_fn(generate, warmup=warmup, repeats=repeats, device=dev)
        produced = generate().shape[1] - prompt.shape[1]
    del generate, model
    release_memory()
    return {
        "tokens_per_s": prompt.shape[0] * produced / timing.median,
        "new_tokens": produced,
        "timing": timing,
        "weights_bytes": weights,
        "generate_bytes": peak.delta_bytes,
        "memory_kind": peak.kind,
    }


# ----------------------------------------------------------------------------- throughput


def tokens_per_second(tokens: int, seconds: float) -> float:
    """Throughput; seconds must be positive."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    return tokens / seconds


# ----------------------------------------------------------------------------- results as JSON lines


@dataclass
class RunInfo:
    """Where a measurement was taken, attached to every logged record."""

    device: str = field(default_factory=lambda: device_name())
    torch: str = torch.__version__
    host: str = platform.node()
    time: float = field(default_factory=time.time)


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's marketing name, from /proc/cpuinfo or platform."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str | torch.device | None = None) -> str:
    """'NVIDIA H100 80GB HBM3' on a GPU, else the CPU model and core count."""
    dev = as_device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"CPU: {cpu_model()} ({os.cpu_count()} logical cores)"


def log_result(path: str | Path, record: dict[str, Any]) -> dict[str, Any]:
    """Append one record, with run info, as a JSON line (a single write, so lines never interleave)."""
    full = {**asdict(RunInfo()), **record}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(full, default=str) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return full


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """All records of a JSON-lines results file (an incomplete last line is ignored)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1:  # a writer killed mid-line; earlier lines are whole
                break
            raise ValueError(f"{path}, line {i + 1}: not a JSON record") from None
    return records
