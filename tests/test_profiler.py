"""labkit.profiler: a known workload's top operator, the trace file, and the phase breakdown read from it."""

from __future__ import annotations

import json
import time

import pytest
import torch

from labkit import profiler
from labkit.models import tiny_llama
from labkit.train import TrainConfig, fit, stepper


def test_the_top_operator_of_a_matmul_heavy_step_is_the_matmul(tmp_path):
    a, b, small = torch.randn(384, 384), torch.randn(384, 384), torch.randn(8)

    def step():
        for _ in range(4):
            a @ b  # 4 × 2·384³ = 453 MFLOP per step
        small + 1  # microseconds

    trace = profiler.profile_steps(step, tmp_path / "run", active=2, warmup=1, wait=0)
    top = trace.top(3)
    assert top[0]["name"] == "aten::mm"
    assert top[0]["calls"] == 4  # per step
    assert trace.count(r"^aten::mm$") == 4 and trace.count(r"^aten::add$") == 1
    assert trace.share(r"^aten::mm$") > 0.5
    with pytest.raises(ValueError, match="by must be one of"):
        trace.top(by="flops")


def test_the_trace_file_is_chrome_json_with_one_profiler_step_per_active_step(tmp_path):
    trace = profiler.profile_steps(lambda: torch.randn(64, 64).sum(), tmp_path / "run", active=3, warmup=1, wait=1)
    assert trace.path.parent == tmp_path / "run" and trace.path.name.endswith(".pt.trace.json")
    assert [p.name for p in (tmp_path / "run").iterdir()] == [trace.path.name]  # no temporary file left
    events = json.loads(trace.path.read_text())["traceEvents"]
    steps = [e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")]
    assert len(steps) == 3  # the wait and warm-up steps are not in it
    assert trace.steps == 3 and trace.device_busy is None  # no GPU kernels on a CPU


def test_a_sleeping_data_phase_shows_as_data_time(tmp_path):
    def step():
        with profiler.phase("data"):
            time.sleep(0.05)
        with profiler.phase("forward"):
            torch.ones(32, 32) @ torch.ones(32, 32)

    trace = profiler.profile_steps(step, tmp_path, active=2, warmup=1, wait=0)
    parts = trace.breakdown
    assert 0.045 < parts["data"] < 0.2
    assert parts["data"] > parts["forward"] > 0
    assert parts["backward"] == parts["optimizer"] == parts["communication"] == 0
    assert parts["data"] + parts["forward"] + parts["other"] == pytest.approx(parts["step"], rel=1e-6)


def _event(name, ts, dur, cat="user_annotation"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_breakdown_counts_nested_and_overlapping_events_once():
    # two steps of 1000 µs each; hand-computed: data 100 + 50, forward 300 + 300, backward 400 (one step only),
    # communication 150 + 100 - 50 overlap = 200 in step 2, nested c10d op inside the gloo range adds nothing
    events = [
        _event("ProfilerStep#1", 0, 1000),
        _event("ProfilerStep#2", 1000, 1000),
        _event("labkit/data", 0, 100),
        _event("labkit/forward", 100, 300),
        _event("labkit/backward", 400, 400),
        _event("labkit/data", 1000, 50),
        _event("labkit/forward", 1050, 300),
        _event("gloo:all_reduce", 1400, 150),
        _event("c10d::allreduce_", 1420, 50, cat="cpu_op"),
        _event("nccl:all_gather", 1500, 100),
        _event("aten::mm", 1100, 100, cat="cpu_op"),
        {"ph": "i", "cat": "cpu_instant_event", "name": "labkit/data", "ts": 0},  # not a span
    ]
    parts = profiler.breakdown(events)
    assert parts["data"] == pytest.approx(150 / 2 / 1e6)
    assert parts["forward"] == pytest.approx(600 / 2 / 1e6)
    assert parts["backward"] == pytest.approx(400 / 2 / 1e6)
    assert parts["communication"] == pytest.approx(200 / 2 / 1e6)
    assert parts["step"] == pytest.approx(1000 / 1e6)
    assert parts["other"] == pytest.approx((2000 - 1150) / 2 / 1e6)
    with pytest.raises(ValueError, match="side"):
        profiler.breakdown(events, side="gpu")
    with pytest.raises(ValueError, match="ProfilerStep"):
        profiler.breakdown(events[2:])
    first, second = profiler.step_breakdowns(events)  # the same events, step by step
    assert (first["data"], second["data"]) == pytest.approx((100 / 1e6, 50 / 1e6))
    assert (first["backward"], second["backward"]) == pytest.approx((400 / 1e6, 0.0))
    assert (first["communication"], second["communication"]) == pytest.approx((0.0, 200 / 1e6))
    assert first["step"] == second["step"] == pytest.approx(1000 / 1e6)
    with pytest.raises(ValueError, match="ProfilerStep"):
        profiler.step_breakdowns(events[2:])


def test_device_side_and_busy_share_read_the_gpu_timeline():
    events = [
        _event("ProfilerStep#1", 0, 1000),
        _event("labkit/forward", 10, 500, cat="gpu_user_annotation"),
        _event("sgemm", 100, 300, cat="kernel"),
        _event("elementwise", 350, 100, cat="kernel"),  # overlaps the first: busy 100..450
        _event("ncclKernel_AllReduce", 700, 100, cat="kernel"),
        _event("before", -500, 600, cat="kernel"),  # starts before the step: only 0..100 counts
    ]
    assert profiler.device_busy(events) == pytest.approx((100 + 350 + 100) / 1000)
    parts = profiler.breakdown(events, side="device")
    assert parts["forward"] == pytest.approx(500e-6) and parts["communication"] == pytest.approx(100e-6)
    assert profiler.device_busy(events[:2]) is None


def test_the_trainer_marks_its_phases_every_step():
    model = tiny_llama(64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=0)
    data = [(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))) for _ in range(6)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fit(model, data, TrainConfig(steps=3, accum_steps=2, progress=False))
    calls = {e.key: e.count for e in prof.key_averages() if e.key.startswith(profiler.PREFIX)}
    assert calls == {"labkit/data": 3, "labkit/forward": 6, "labkit/backward": 6, "labkit/optimizer": 3}


def test_kinetos_start_and_stop_lines_stay_out_of_stderr(tmp_path, capfd):
    profiler.profile_steps(lambda: torch.ones(4).sum(), tmp_path, active=1, warmup=1, wait=0)
    assert "USDT" not in capfd.readouterr().err


@pytest.mark.parametrize("bad", [{"active": 0}, {"warmup": -1}, {"wait": 1.5}, {"active": True}])
def test_bad_schedules_are_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="must be an int"):
        profiler.profile_steps(lambda: None, tmp_path, **bad)


def test_stepper_takes_the_steps_fit_takes():
    data = [(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))) for _ in range(3)]
    cfg = TrainConfig(steps=3, schedule="constant", progress=False)

    def make():
        return tiny_llama(64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=0)

    fitted, stepped = make(), make()
    losses = [h["loss"] for h in fit(fitted, data, cfg)]
    step = stepper(stepped, data, cfg)
    assert [step()["loss"] for _ in range(3)] == pytest.approx(losses, rel=1e-6)
    for a, b in zip(fitted.parameters(), stepped.parameters()):
        torch.testing.assert_close(a, b)
