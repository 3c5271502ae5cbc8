"""What the hardware is doing while a run goes: a background sampler, energy per token, and TensorBoard logs.

`Sampler` reads, every `interval` seconds on a thread of its own: the GPU's utilization, memory, power, SM clock
and temperature through NVML (`nvidia-ml-py`) when there is an NVIDIA GPU; the CPU's utilization, this process's
resident memory and disk I/O through psutil; and the CPU package's energy counter (RAPL) where the kernel exposes
it. What it cannot read on this machine it names in `unavailable`, with the reason; it never raises for a
missing GPU, driver or counter.

A caveat the lab measures: NVML's "GPU utilization" is the share of the sample period in which *any* kernel ran,
not the share of the chip that worked. One tiny kernel after another reads 100 %; MFU tells the truth.

`TensorBoardLog` writes a run's scalars as TensorBoard event files (`labkit.train.fit` does when
`TrainConfig.tensorboard_dir` is set); `read_scalars` reads them back.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import torch

from labkit import bench, flops
from labkit.torchutil import as_path, check_int, check_number, is_int, is_number

RAPL = Path("/sys/class/powercap/intel-rapl:0/energy_uj")  # the CPU package; AMD's kernels use the same name


def _load_nvml() -> Any:
    """The pynvml module of nvidia-ml-py, or None where it is not installed."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


class Sampler:
    """Samples the hardware on a background thread; use as a context manager, or start() and stop()."""

    def __init__(
        self,
        interval: float = 0.5,
        device: str | torch.device | None = None,
        *,
        nvml: Any = "auto",
        rapl: Path | None = RAPL,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not isinstance(interval, (int, float)) or isinstance(interval, bool) or not 0.001 <= interval <= 3600:
            raise ValueError(f"interval must be between 0.001 and 3600 seconds, got {interval!r}")
        if rapl is not None:
            rapl = as_path("rapl", rapl)
        if not callable(clock):
            raise TypeError(f"clock must be callable (time.monotonic, say), got {clock!r}")
        self.interval = float(interval)
        self.device = bench.as_device(device)
        self.samples: list[dict[str, float]] = []
        self.unavailable: dict[str, str] = {}
        self._clock, self._rapl = clock, rapl
        self._t0, self.started_at = clock(), time.time()  # reset by start(); sample times count from there
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._process = psutil.Process()
        self._gpu = self._open_gpu(_load_nvml() if nvml == "auto" else nvml)

    def _open_gpu(self, nvml: Any) -> Any:
        """An NVML handle for self.device, or None with the reason recorded."""
        if self.device.type != "cuda":
            self.unavailable["gpu"] = f"no NVIDIA GPU in use (device {self.device.type})"
            return None
        if nvml is None:
            self.unavailable["gpu"] = "nvidia-ml-py is not installed (pip install 'labkit[monitor]')"
            return None
        try:
            nvml.nvmlInit()
            uuid = getattr(torch.cuda.get_device_properties(self.device), "uuid", None)
            if uuid is not None:  # NVML counts every GPU; CUDA_VISIBLE_DEVICES renumbers them for torch
                return nvml, nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            return nvml, nvml.nvmlDeviceGetHandleByIndex(self.device.index or 0)
        except Exception as err:  # NVMLError: no driver library, no permission, a MIG slice, ...
            self.unavailable["gpu"] = f"NVML: {err}"
            return None

    def _read_gpu(self, out: dict[str, float]) -> None:
        nvml, handle = self._gpu

        def utilization() -> tuple[float, float]:  # one NVML call gives both
            rates = nvml.nvmlDeviceGetUtilizationRates(handle)
            return rates.gpu, rates.memory

        readers = {  # the names each call fills, and the call
            ("gpu_util", "gpu_mem_util"): utilization,
            ("gpu_memory_bytes",): lambda: (nvml.nvmlDeviceGetMemoryInfo(handle).used,),
            ("power_w",): lambda: (nvml.nvmlDeviceGetPowerUsage(handle) / 1000,),
            ("sm_clock_mhz",): lambda: (nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),),
            ("temperature_c",): lambda: (nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),),
            ("gpu_energy_j",): lambda: (nvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000,),
        }
        for names, read in readers.items():
            if names[0] not in self.unavailable:
                try:
                    out.update(zip(names, map(float, read())))
                except Exception as err:  # this GPU or driver does not report it
                    self.unavailable.update(dict.fromkeys(names, f"NVML: {err}"))

    def _read_host(self, out: dict[str, float]) -> None:
        out["cpu_percent"] = psutil.cpu_percent(None)  # the whole machine, 100 = every core busy
        out["process_cpu_percent"] = self._process.cpu_percent(None)  # this process, 100 = one core
        out["rss_bytes"] = float(self._process.memory_info().rss)
        if "io" not in self.unavailable:
            try:
                io = self._process.io_counters()
                out["read_bytes"], out["write_bytes"] = float(io.read_bytes), float(io.write_bytes)
            except (AttributeError, psutil.Error) as err:  # macOS has no per-process I/O counters
                self.unavailable["io"] = f"per-process disk I/O: {err or type(err).__name__}"
        if "cpu_energy_j" not in self.unavailable:
            try:
                out["cpu_energy_j"] = int(self._rapl.read_text()) / 1e6  # type: ignore[union-attr]
            except (AttributeError, OSError, ValueError) as err:
                why = "no RAPL energy counter given" if self._rapl is None else f"{self._rapl}: {err.strerror or err}"
                self.unavailable["cpu_energy_j"] = f"CPU package energy (RAPL) not readable: {why}"

    def sample(self) -> dict[str, float]:
        """Take one sample now (the thread calls this every `interval` seconds) and keep it."""
        out = {"t": self._clock() - self._t0}
        self._read_host(out)
        if self._gpu is not None:
            self._read_gpu(out)
        self.samples.append(out)
        return out

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> Sampler:
        """Start sampling (a first sample now, then one every `interval` seconds)."""
        if self._thread is not None:
            raise RuntimeError("this sampler is already running; make a new one for a new run")
        self._t0, self.started_at = self._clock(), time.time()
        psutil.cpu_percent(None)  # both CPU counters report the time since their previous call: start them now
        self._process.cpu_percent(None)
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="labkit-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Sampler:
        """Stop the thread and take a last sample; safe to call twice."""
        if self._thread is not None and self._thread.is_alive():
            self._stop.set()
            self._thread.join()
            self.sample()
        if self._gpu is not None:
            try:
                self._gpu[0].nvmlShutdown()
            except Exception:  # already shut down, or the driver went away: nothing left to release
                pass
            self._gpu = None
        return self

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def series(self, name: str, since: float = 0.0) -> tuple[list[float], list[float]]:
        """(times, values) of one measure, from `since` seconds after the start; empty where it was not read."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a measure's name (e.g. 'power_w'), got {name!r}")
        check_number("since", since)
        picked = [(s["t"], s[name]) for s in list(self.samples) if name in s and s["t"] >= since]
        return [t for t, _ in picked], [v for _, v in picked]

    def mean(self, name: str, since: float = 0.0) -> float | None:
        """Mean of one measure over the samples from `since` on; None where there is none."""
        values = self.series(name, since)[1]
        return sum(values) / len(values) if values else None

    def energy_joules(self) -> dict[str, float]:
        """Joules used between the first and last sample, per source: the GPU's own energy counter where it has
        one, else its power integrated over time; the CPU package's RAPL counter (which wraps; a wrap is skipped)."""
        out = {}
        t, gpu = self.series("gpu_energy_j")
        if len(gpu) >= 2:
            out["gpu"] = gpu[-1] - gpu[0]
        else:
            t, watts = self.series("power_w")
            if len(watts) >= 2:
                out["gpu"] = integrate(t, watts)
        _, cpu = self.series("cpu_energy_j")
        if len(cpu) >= 2:
            out["cpu"] = sum(max(0.0, b - a) for a, b in zip(cpu, cpu[1:]))
        return out


def integrate(times: list[float], values: list[float]) -> float:
    """Trapezoid-rule integral of a sampled series (watts over seconds: joules)."""
    for name, series in (("times", times), ("values", values)):
        if isinstance(series, (str, bytes)) or not hasattr(series, "__len__"):
            raise TypeError(f"{name} must be a list of numbers, got {series!r}")
        if not all(is_number(v) for v in series):
            raise ValueError(f"{name} must hold finite numbers, got {list(series)!r}")
    if len(times) != len(values) or any(b < a for a, b in zip(times, times[1:])):
        raise ValueError("need as many times as values, in increasing order")
    return sum((times[i + 1] - times[i]) * (values[i] + values[i + 1]) / 2 for i in range(len(times) - 1))


def energy_per_token(joules: float, tokens: int) -> float:
    """Joules per token processed; the figure to compare runs, precisions and machines by."""
    check_number("joules", joules)
    if not is_int(tokens):
        raise TypeError(f"tokens must be an int, got {tokens!r}")
    if tokens <= 0 or joules < 0:
        raise ValueError(f"need tokens > 0 and joules >= 0, got {tokens} tokens and {joules} J")
    return joules / tokens


def busy_but_idle(
    device: str | torch.device | None = None, size: int = 64, seconds: float = 1.0, peak_size: int = 2048
) -> dict[str, Any]:
    """Small matmuls back to back for `seconds`: how busy the hardware reads against the share of its matmul peak
    the work reaches. On a GPU: NVML's GPU-Util against the data sheet's peak; on a CPU: this process's CPU %
    (100 = one core) against a large matmul measured here (`peak_size`)."""
    check_int("size", size, minimum=1)
    check_int("peak_size", peak_size, minimum=1)
    check_number("seconds", seconds)
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    dev = bench.as_device(device)
    dtype = "bf16" if dev.type == "cuda" and flops.dtype_support(dev)["bf16"] is None else "fp32"
    a = torch.randn(size, size, device=dev, dtype=flops.DTYPES[dtype])
    done = 0
    with Sampler(interval=min(0.1, seconds / 5), device=dev) as sampler, bench.stopwatch(dev) as took:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for _ in range(100):
                a @ a
            done += 100
    if dev.type == "cuda":
        util, kind = sampler.mean("gpu_util", since=0.1), "NVML GPU-Util, %"
        peak, peak_kind = flops.device_peak_flops(dtype, dev), f"data-sheet dense {dtype} peak"
    else:
        util, kind = sampler.mean("process_cpu_percent", since=0.1), "this process's CPU %, 100 = one core"
        peak, peak_kind = (
            flops.matmul_throughput(peak_size, dtype, device=dev)["flops_per_s"],
            f"{dtype} {peak_size}² matmul here",
        )
    achieved = done * flops.matmul_flops(size, size, size) / took.seconds
    return {
        "size": size,
        "dtype": dtype,
        "utilization": util,
        "utilization_kind": kind if util is not None else sampler.unavailable.get("gpu", "not read"),
        "flops_per_s": achieved,
        "peak_flops_per_s": peak,
        "peak_kind": peak_kind,
        "fraction_of_peak": flops.mfu(achieved, peak),
    }


# ----------------------------------------------------------------------------- TensorBoard


TRAIN_SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "seconds", "memory_bytes", "loss_scale")


class TensorBoardLog:
    """A run's scalars as TensorBoard event files under `logdir` (`tensorboard --logdir` on its parent)."""

    def __init__(self, logdir: str | Path):
        logdir = as_path("logdir", logdir)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch imports tensorboard lazily, here
            raise ImportError(f"TensorBoard logging needs tensorboard (pip install 'labkit[monitor]'): {err}") from None
        self.logdir = Path(logdir)
        self.writer = SummaryWriter(log_dir=os.fspath(self.logdir))
        self._seen = 0  # samples already written

    def log_step(self, record: dict[str, Any]) -> None:
        """One training step's record from `labkit.train.fit`, as train/<name> at its step."""
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise TypeError(f"record must be a dict with an int 'step' (a labkit.train.fit record), got {record!r}")
        for name in TRAIN_SCALARS:
            if record.get(name) is not None:
                self.writer.add_scalar(f"train/{name}", float(record[name]), int(record["step"]))

    def log_samples(self, sampler: Sampler, step: int) -> None:
        """The sampler's readings since the last call, as system/<name> at `step`, each at the wall time it was
        taken (TensorBoard's "relative" axis lines them up with the training curves)."""
        if not isinstance(sampler, Sampler):
            raise TypeError(f"sampler must be a monitor.Sampler, got {type(sampler).__name__}")
        check_int("step", step)
        new = sampler.samples[self._seen :]
        self._seen += len(new)
        for s in new:
            for name, value in s.items():
                if name not in ("t", "gpu_energy_j", "cpu_energy_j"):  # counters; their rates are power
                    self.writer.add_scalar(f"system/{name}", value, step, walltime=sampler.started_at + s["t"])

    def close(self) -> None:
        """Write everything out and close the event file."""
        self.writer.close()


@contextlib.contextmanager
def training_log(logdir: str | Path | None, device: torch.device) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A function that logs one training step's record, with the hardware sampled beside it, to TensorBoard;
    one that does nothing when `logdir` is None. The sampler stops and the event file closes on the way out."""
    if logdir is None:
        yield lambda record: None
        return
    board = TensorBoardLog(logdir)
    try:
        with Sampler(device=device) as sampler:

            def log(record: dict[str, Any]) -> None:
                board.log_step(record)
                board.log_samples(sampler, int(record["step"]))

            yield log
    finally:
        board.close()


def read_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files directly under `logdir`, as {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not as_path("logdir", logdir).is_dir():
        raise FileNotFoundError(f"no TensorBoard run at {logdir}")
    acc = EventAccumulator(os.fspath(logdir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
