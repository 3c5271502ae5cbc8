"""labkit.monitor: the sampler on a CPU, NVML absent or partial (a fake NVML), energy, and TensorBoard event files."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import psutil
import pytest
import torch

from labkit import bench, monitor
from labkit.models import tiny_llama
from labkit.train import TrainConfig, fit


def test_the_sampler_runs_and_stops_cleanly_on_a_cpu():
    with monitor.Sampler(interval=0.01) as sampler:
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:  # one core busy
            torch.randn(64, 64) @ torch.randn(64, 64)
    assert not any(t.name == "labkit-sampler" for t in threading.enumerate())
    assert len(sampler.samples) >= 5
    times, rss = sampler.series("rss_bytes")
    assert times == sorted(times) and times[-1] >= 0.29
    assert abs(rss[-1] - psutil.Process().memory_info().rss) < 64 * 2**20
    assert 0 <= sampler.mean("cpu_percent") <= 100
    assert sampler.mean("process_cpu_percent", since=0.05) > 30  # the loop above kept a core busy
    assert "no NVIDIA GPU" in sampler.unavailable["gpu"]
    assert sampler.series("gpu_util") == ([], []) and sampler.mean("gpu_util") is None
    sampler.stop()  # a second stop is harmless
    with pytest.raises(RuntimeError, match="already running"):
        sampler.start()


@pytest.mark.parametrize("interval", [0, -1, "1", True, 1e9])
def test_bad_intervals_are_refused(interval):
    with pytest.raises(ValueError, match="interval"):
        monitor.Sampler(interval=interval)


class FakeNVML:
    """nvidia-ml-py's surface as the sampler uses it: 100 W constant, no energy counter on this 'GPU'."""

    NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0

    def __init__(self, fail_init=False):
        self.fail_init, self.shut = fail_init, False

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return uuid

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=97, memory=12)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=3 * 2**30, total=80 * 2**30)

    def nvmlDeviceGetPowerUsage(self, handle):
        return 100_000  # milliwatts

    def nvmlDeviceGetClockInfo(self, handle, clock):
        return 1980

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 41

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        raise RuntimeError("Not Supported")


@pytest.fixture
def a_gpu(monkeypatch):
    """Pretend device cuda:0 exists, so the NVML path runs on a CPU-only machine."""
    monkeypatch.setattr(bench, "as_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="1234-abcd"))


def test_missing_nvml_is_reported_not_raised(a_gpu):
    assert "nvidia-ml-py is not installed" in monitor.Sampler(nvml=None, rapl=None).unavailable["gpu"]
    sampler = monitor.Sampler(nvml=FakeNVML(fail_init=True), rapl=None)
    assert sampler.unavailable["gpu"] == "NVML: NVML Shared Library Not Found"
    assert "gpu_util" not in sampler.sample()


def test_gpu_readings_and_energy_from_integrated_power(a_gpu):
    clock = iter([0.0, 0.0, 1.0, 3.0, 4.0]).__next__  # init, then one sample per call
    nvml = FakeNVML()
    sampler = monitor.Sampler(nvml=nvml, rapl=None, clock=clock)
    for _ in range(4):
        sampler.sample()
    first = sampler.samples[0]
    assert first["gpu_util"] == 97 and first["gpu_mem_util"] == 12 and first["power_w"] == 100
    assert first["gpu_memory_bytes"] == 3 * 2**30 and first["sm_clock_mhz"] == 1980 and first["temperature_c"] == 41
    assert sampler.unavailable["gpu_energy_j"] == "NVML: Not Supported"
    assert sampler.energy_joules() == {"gpu": pytest.approx(100 * 4)}  # 100 W for 4 s
    assert monitor.energy_per_token(400, 2000) == pytest.approx(0.2)
    sampler.stop()
    assert nvml.shut


def test_cpu_package_energy_from_rapl_skips_a_wrap(tmp_path):
    rapl = tmp_path / "energy_uj"
    sampler = monitor.Sampler(rapl=rapl)
    for microjoules in (1_000_000, 3_500_000, 500_000, 2_500_000):  # the counter wrapped after the second
        rapl.write_text(str(microjoules))
        sampler.sample()
    assert sampler.energy_joules() == {"cpu": pytest.approx(2.5 + 2.0)}
    missing = monitor.Sampler(rapl=tmp_path / "nope")
    missing.sample()
    assert "RAPL" in missing.unavailable["cpu_energy_j"] and "cpu_energy_j" not in missing.samples[0]


@pytest.mark.parametrize("joules, tokens", [(1.0, 0), (-1.0, 10)])
def test_energy_per_token_refuses_nonsense(joules, tokens):
    with pytest.raises(ValueError):
        monitor.energy_per_token(joules, tokens)


def test_tensorboard_log_holds_the_scalars_written(tmp_path):
    board = monitor.TensorBoardLog(tmp_path / "run")
    for step, loss in ((1, 4.5), (2, 3.25)):
        board.log_step({"step": step, "loss": loss, "lr": 1e-3, "loss_scale": None, "tokens": 64})
    sampler = monitor.Sampler(rapl=None)
    sampler.sample()
    board.log_samples(sampler, 2)
    board.log_samples(sampler, 3)  # nothing new: nothing written twice
    board.close()
    scalars = monitor.read_scalars(tmp_path / "run")
    assert scalars["train/loss"] == [(1, 4.5), (2, 3.25)]
    assert [s for s, _ in scalars["train/lr"]] == [1, 2] and "train/loss_scale" not in scalars
    assert "train/tokens" not in scalars  # a count, not one of the curves
    assert [s for s, _ in scalars["system/rss_bytes"]] == [2]
    with pytest.raises(FileNotFoundError):
        monitor.read_scalars(tmp_path / "missing")


def test_tensorboard_log_refuses_what_is_not_a_record_or_a_sampler(tmp_path):
    board = monitor.TensorBoardLog(tmp_path / "run")
    with pytest.raises(TypeError, match="record must be a dict with an int 'step'"):
        board.log_step({"loss": 1.0})
    with pytest.raises(TypeError, match="sampler must be a monitor.Sampler, got list"):
        board.log_samples([], 1)
    with pytest.raises(TypeError, match="step must be an int, got '1'"):
        board.log_samples(monitor.Sampler(rapl=None), "1")
    board.close()
    assert monitor.read_scalars(tmp_path / "run") == {}  # nothing was written


def test_fit_logs_every_step_and_the_hardware_to_tensorboard(tmp_path):
    model = tiny_llama(64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=0)
    data = [(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))) for _ in range(4)]
    history = fit(model, data, TrainConfig(steps=4, progress=False, tensorboard_dir=str(tmp_path / "tb")))
    scalars = monitor.read_scalars(tmp_path / "tb")
    for name in ("loss", "lr", "grad_norm", "tokens_per_s", "memory_bytes"):
        logged = scalars[f"train/{name}"]
        assert [s for s, _ in logged] == [1, 2, 3, 4]
        assert [v for _, v in logged] == pytest.approx([h[name] for h in history], rel=1e-6)  # float32 in the file
    assert {"system/cpu_percent", "system/rss_bytes"} <= set(scalars)
    assert not any(t.name == "labkit-sampler" for t in threading.enumerate())


def test_a_busy_core_reads_busy_while_small_matmuls_reach_little_of_the_peak():
    seen = monitor.busy_but_idle(size=16, seconds=0.3, peak_size=512)
    assert seen["utilization"] > 30 and seen["utilization_kind"].startswith("this process's CPU %")
    assert 0 < seen["fraction_of_peak"] < 1
