"""`labcourse gpu-check`: without CUDA it checks what a CPU can and says nothing GPU-side was measured; its
plan covers every lab and GPU benchmark; a step's failure, time-out or missing GPUs is reported, not fatal."""

import json
import sys

import pytest

from labcourse import cli, gpucheck
from labkit.parallel import launch

PY = sys.executable


def test_without_cuda_it_runs_the_cpu_checks_and_exits_0(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launch, "visible_gpus", lambda: 0)
    sizes = tmp_path / "test_sizes.py"  # stands in for tests/test_profiles.py, which the suite runs itself
    sizes.write_text("def test_one():\n    pass\n\n\ndef test_two():\n    pass\n")
    monkeypatch.setattr(gpucheck, "SIZES_TEST", sizes)
    assert cli.main(["gpu-check", "-o", str(tmp_path / "gpu.json")]) == 0
    out = capsys.readouterr().out
    assert "nothing GPU-side was measured" in out and "2 ranks on the CPU with gloo" in out
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["device"].startswith("CPU") and report["steps"] == [] and report["goals"] == {}
    checks = {row["check"]: row for row in report["checks"]}
    assert set(checks) == {"CUDA", "labs 04/05 ranks", "offline cache", "profile sizes vs the data"}
    assert checks["profile sizes vs the data"]["ok"] and "2 passed" in checks["profile sizes vs the data"]["detail"]


@pytest.mark.parametrize("gpus, all_reduce_ranks", [(1, 2), (2, 2), (8, 8)])
def test_the_plan_covers_every_lab_and_gpu_benchmark(tmp_path, gpus, all_reduce_ranks):
    steps = {s.name: s for s in gpucheck.plan(gpus, tmp_path)}
    labs = sorted(p.stem for p in (gpucheck.ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))
    assert len(labs) >= 9 and all(steps[f"lab {lab}"].env == {"LABKIT_PROFILE": "gpu"} for lab in labs)
    for name, script in (
        ("precision and MFU, torch.compile", "precision_mfu.py"),
        ("pruning speed and 2:4 kernels", "pruning_speed.py"),
        ("GPTQ 4-bit decode vs fp16", "gptq_decode.py"),
        ("LoRA vs full fine-tune memory", "lora_vs_full.py"),
        ("sharded memory and checkpointing", "memory_at_scale.py"),
    ):
        command = steps[name].command
        assert command[1].endswith(script) and command[command.index("--results") + 1] == str(tmp_path)
    assert "--compile" in steps["precision and MFU, torch.compile"].command
    assert f"--nproc_per_node={all_reduce_ranks}" in steps["all-reduce on NCCL"].command
    assert steps["all-reduce on NCCL"].gpus == 2  # NCCL needs a GPU per rank: skipped on one GPU


def test_steps_report_failure_timeout_and_missing_gpus(tmp_path):
    ok = gpucheck.run_step(gpucheck.Step("ok", [PY, "-c", "print('fine')"], 60), 1, tmp_path, echo=lambda _: None)
    bad = gpucheck.run_step(
        gpucheck.Step("bad", [PY, "-c", "raise SystemExit('broken')"], 60), 1, tmp_path, echo=lambda _: None
    )
    slow = gpucheck.run_step(
        gpucheck.Step("slow", [PY, "-c", "import time; time.sleep(30)"], 1), 1, tmp_path, echo=lambda _: None
    )
    many = gpucheck.run_step(gpucheck.Step("nccl", [PY, "-c", "pass"], 60, gpus=2), 1, tmp_path, echo=lambda _: None)
    assert (ok["status"], bad["status"], slow["status"], many["status"]) == ("passed", "failed", "timed out", "skipped")
    assert "fine" in ok["output_tail"] and "broken" in bad["output_tail"] and slow["seconds"] < 15
    assert many["detail"] == "needs 2 GPUs, this machine has 1"


def test_a_gpu_run_writes_every_step_and_reads_the_goals(tmp_path, monkeypatch, capsys):
    """The GPU path with stand-in steps (no GPU here): outcomes, the benchmarks' records and the goals."""
    runs = [  # what the benchmarks' results.save_run writes: {"benchmark", "machine", "figures"}
        ("precision_mfu", {"compile": True, "modes": {"bf16": {"mfu": 0.52}}}),
        ("precision_mfu", {"compile": False, "modes": {"bf16": {"mfu": 0.61}}}),
        ("pruning_speed", {"semi_structured": {"8192x8192": {"speedup": 1.4}}}),
    ]
    old = tmp_path / "pruning_speed" / "20200101-000000-old.json"  # an earlier check's run: not this one's
    old.parent.mkdir()
    old.write_text(json.dumps({"benchmark": "pruning_speed", "machine": {}, "figures": {"semi_structured": {}}}))

    def plan(gpus, folder):
        assert folder == tmp_path
        write = (
            "import json, pathlib\n"
            f"for i, (name, figures) in enumerate({runs!r}):\n"
            f"    path = pathlib.Path({str(folder)!r}) / name / f'20990101-00000{{i}}-h.json'\n"
            "    path.parent.mkdir(exist_ok=True)\n"
            "    path.write_text(json.dumps({'benchmark': name, 'machine': {}, 'figures': figures}))"
        )
        return [gpucheck.Step("bench", [PY, "-c", write], 60), gpucheck.Step("lab 99", [PY, "-c", "1/0"], 60)]

    monkeypatch.setattr(launch, "visible_gpus", lambda: 1)
    monkeypatch.setattr(gpucheck, "plan", plan)
    monkeypatch.setattr(gpucheck, "cpu_checks", lambda: [])  # run for real in the test above
    assert cli.main(["gpu-check", "-o", str(tmp_path / "gpu.json")]) == 1  # a lab failed
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert [(s["step"], s["status"]) for s in report["steps"]] == [("bench", "passed"), ("lab 99", "failed")]
    assert len(report["benchmarks"]) == 3
    measured = {goal: g["measured"] for goal, g in report["goals"].items()}
    assert measured == {
        "bf16 MFU, GPT-2 small, torch.compile": 0.52,
        "2:4 sparse linear speed-up, 8192 x 8192": 1.4,
        "GPTQ 4-bit / fp16 decode speed, batch 1": None,
        "activation checkpointing step time, with / without": None,
    }
    out = capsys.readouterr().out
    assert "GPTQ 4-bit / fp16 decode speed, batch 1: target > 1, not measured" in out
    assert "bf16 MFU, GPT-2 small, torch.compile: target >= 0.55, measured 0.52" in out
