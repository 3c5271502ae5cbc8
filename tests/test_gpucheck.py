"""`labcourse gpu-check`: without CUDA it checks what a CPU can and says nothing GPU-side was measured; its
plan covers every lab's core path (`labcourse execute --core`) and the steps each script declares (GPU_CHECK, read
without importing it; a malformed one is refused naming the file); a step's failure, time-out or missing GPUs is
reported, not fatal; a lab's core-path seconds are read from the notebook it executed and saved as a results run."""

import dataclasses
import json
import re
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


# The real plan's GPU steps, in order: what benchmarks/*.py and labs/scripts/*.py declare (GPU_CHECK), each folder
# by file name: (name, script, args after --results, timeout in seconds, GPUs).
REAL_STEPS = [
    ("GPTQ 4-bit decode vs fp16", "benchmarks/gptq_decode.py", ["--device", "cuda"], 1200, 1),
    ("LoRA vs full fine-tune memory", "benchmarks/lora_vs_full.py", [], 2400, 1),
    ("sharded memory and checkpointing", "benchmarks/memory_at_scale.py", [], 1800, 1),
    ("precision and MFU, eager", "benchmarks/precision_mfu.py", ["--device", "cuda"], 1200, 1),
    ("precision and MFU, torch.compile", "benchmarks/precision_mfu.py", ["--device", "cuda", "--compile"], 1800, 1),
    ("pruning speed and 2:4 kernels", "benchmarks/pruning_speed.py", ["--device", "cuda"], 1200, 1),
    ("all-reduce on NCCL", "labs/scripts/allreduce_bench.py", [], 600, 2),  # NCCL needs a GPU per rank
]


@pytest.mark.parametrize("gpus, all_reduce_ranks", [(0, 2), (1, 2), (2, 2), (8, 8)])
def test_the_plan_covers_every_lab_and_gpu_benchmark(tmp_path, gpus, all_reduce_ranks):
    steps = gpucheck.plan(gpus, tmp_path)
    labs = sorted(p.stem for p in (gpucheck.ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))
    assert len(labs) >= 9 and [s.name for s in steps] == [n for n, *_ in REAL_STEPS] + [f"lab {lab}" for lab in labs]
    for step, (name, script, args, timeout_s, need) in zip(steps, REAL_STEPS):
        ranks = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={all_reduce_ranks}"]
        launcher = [PY, *ranks] if name == "all-reduce on NCCL" else [PY]
        assert step.command == [*launcher, str(gpucheck.ROOT / script), "--results", str(tmp_path), *args]
        assert (step.timeout_s, step.gpus, step.env) == (timeout_s, need, {})
    for step, lab in zip(steps[len(REAL_STEPS) :], labs):  # the core path alone, into build/core/ under the cwd
        notebook = str(gpucheck.ROOT / "labs" / f"{lab}.ipynb")
        assert step.command == [PY, "-m", "labcourse", "execute", "--profile", "gpu", "--core", notebook]
        assert (step.timeout_s, step.gpus, step.env) == (1800, 1, {})
        assert step.executed == f"build/core/{lab}.ipynb"


NEW_BENCHMARK = """import not_installed_anywhere  # gpu-check reads the declaration without importing the script

from labcourse import results

GPU_CHECK = [
    {"name": "new, small", "args": ["--size", "1"], "timeout_s": 60},
    {"name": "new, large", "args": ["--size", "9"], "timeout_s": 90},
]
GPU_GOALS = [
    {"goal": "new speed-up", "target": "> 2", "figure": ["speed", "up"], "best": "max", "where": {"size": 9}},
    {"goal": "new step time", "target": "< 1", "figure": ["seconds"], "best": "min"},
]


def main():
    results.save_run("new_bench", {"speed": {"up": 3.0}})
"""


def fake_root(tmp_path, **files):
    """A repository with the given scripts ({"benchmarks/x.py": source}) and one lab."""
    for name, source in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source)
    (tmp_path / "labs").mkdir(exist_ok=True)
    (tmp_path / "labs" / "01_lab.ipynb").write_text("{}")
    return tmp_path


def test_a_benchmark_that_declares_its_steps_joins_the_plan_and_its_goals_are_read(tmp_path):
    root = fake_root(
        tmp_path / "repo",
        **{
            "benchmarks/new_bench.py": NEW_BENCHMARK,
            "benchmarks/a_plain.py": "print('no GPU_CHECK here')\n",
            "labs/scripts/ranks.py": 'GPU_CHECK = [{"name": "ranks", "args": [], "timeout_s": 5, "gpus": 4, '
            '"torchrun": True}]\n',
        },
    )
    runs = tmp_path / "runs"
    script = str(root / "benchmarks" / "new_bench.py")
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone"]
    assert [(s.name, s.command, s.timeout_s, s.gpus) for s in gpucheck.plan(2, runs, root)][:3] == [
        ("new, small", [PY, script, "--results", str(runs), "--size", "1"], 60, 1),
        ("new, large", [PY, script, "--results", str(runs), "--size", "9"], 90, 1),
        ("ranks", [*torchrun, "--nproc_per_node=4", str(root / "labs/scripts/ranks.py"), "--results", str(runs)], 5, 4),
    ]
    assert [s.name for s in gpucheck.plan(8, runs, root)][2:] == ["ranks", "lab 01_lab"]
    assert "--nproc_per_node=8" in gpucheck.plan(8, runs, root)[2].command  # a rank per GPU, at least 4
    goals = gpucheck.goals(root)
    assert {name: (g.target, g.benchmark) for name, g in goals.items()} == {
        "new speed-up": ("> 2", "new_bench"),
        "new step time": ("< 1", "new_bench"),
    }
    records = [
        {"benchmark": "new_bench", "size": 9, "speed": {"up": 2.5}, "seconds": 0.9},
        {"benchmark": "new_bench", "size": 9, "speed": {"up": 3.5}, "seconds": 0.7},
        {"benchmark": "new_bench", "size": 1, "speed": {"up": 7.0}, "seconds": 0.2},  # not where size is 9
        {"benchmark": "new_bench", "size": 9, "speed": "n/a"},  # a figure the path cannot reach: skipped
        {"benchmark": "other", "size": 9, "speed": {"up": 9.0}, "seconds": 0.1},  # another benchmark's run
    ]
    assert goals["new speed-up"].read(records) == 3.5 and goals["new step time"].read(records) == 0.2
    assert goals["new speed-up"].read(records[2:]) is None


@pytest.mark.parametrize(
    "source, problem",
    [
        ("GPU_CHECK = steps()", "GPU_CHECK .line 1. must be a literal"),
        ("GPU_CHECK = {'name': 'x'}", "GPU_CHECK must be a non-empty list of dicts"),
        ("GPU_CHECK = []", "GPU_CHECK must be a non-empty list of dicts"),
        (
            "GPU_CHECK = [{'name': 'x', 'args': [], 'timeout': 9}]",
            r"GPU_CHECK\[0\] lacks \['timeout_s'\] or has unknown keys \['timeout'\]",
        ),
        (
            "GPU_CHECK = [{'name': 'x', 'args': '--a', 'timeout_s': 9}]",
            r"GPU_CHECK\[0\]\['args'\] must be a list of str",
        ),
        ("GPU_CHECK = [{'name': 'x', 'args': [], 'timeout_s': 0}]", r"\['timeout_s'\] must be an int >= 1"),
        (
            "GPU_CHECK = [{'name': 'x', 'args': [], 'timeout_s': 9, 'torchrun': 1}]",
            r"\['torchrun'\] must be True or False",
        ),
        ("GPU_CHECK = [{'name': 'x', 'args': [], 'timeout_s': 9, 'gpus': True}]", r"\['gpus'\] must be an int >= 1"),
        ("GPU_CHECK = [{'name': 'x', 'args': [], 'timeout_s': 9}]\nGPU_CHECK = []", "GPU_CHECK is assigned twice"),
        ("GPU_CHECK = [{'name': 'x', 'args': [], 'timeout_s': 9}\n", "cannot be parsed"),
        (
            "GPU_GOALS = [{'goal': 'g', 'target': '> 1', 'figure': ['x'], 'best': 'most'}]",
            r"\['best'\] must be 'max' or 'min'",
        ),
        ("GPU_GOALS = [{'goal': 'g', 'target': '> 1', 'figure': ['x'], 'best': 'max'}]", "saves them under no name"),
        (
            "GPU_CHECK = [{'name': 'precision and MFU, eager', 'args': [], 'timeout_s': 9}]",
            "'precision and MFU, eager' is declared in .*precision_mfu.py too",
        ),
    ],
)
def test_a_malformed_declaration_is_refused_naming_the_file(tmp_path, source, problem):
    root = fake_root(
        tmp_path, **{"benchmarks/precision_mfu.py": (gpucheck.ROOT / "benchmarks/precision_mfu.py").read_text()}
    )
    bad = root / "labs" / "scripts" / "zz_bad.py"  # read after benchmarks/: a name shared with one is found here
    bad.parent.mkdir(parents=True)
    bad.write_text(source)
    for read in (lambda: gpucheck.plan(1, tmp_path, root), lambda: gpucheck.goals(root)):
        with pytest.raises(ValueError, match=f"^{bad}: .*{problem}"):
            read()


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
    assert all("core_seconds" not in s for s in (ok, bad, slow, many))  # not a lab's step


def test_a_step_past_its_limit_is_sent_sigterm_first_then_killed(tmp_path, monkeypatch):
    """SIGTERM lets `labcourse execute` shut its kernel down (a session of its own: SIGKILL would leave it on the
    GPU); one that ignores SIGTERM is killed STOP_GRACE_S later."""
    monkeypatch.setattr(gpucheck, "STOP_GRACE_S", 1)
    handles = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit('stopped cleanly'))\n"
    ignores = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    steps = [
        gpucheck.Step(n, [PY, "-c", f"{code}print('up', flush=True)\ntime.sleep(30)"], 2)
        for n, code in (("handles", handles), ("ignores", ignores))
    ]
    handled, ignored = (gpucheck.run_step(s, 1, tmp_path, echo=lambda _: None) for s in steps)
    assert (handled["status"], ignored["status"]) == ("timed out", "timed out")
    assert "stopped cleanly" in handled["output_tail"] and "up" in ignored["output_tail"]
    assert handled["seconds"] < 10 and ignored["seconds"] < 15


def cell(source, seconds):
    """An executed code cell as nbclient records it: its run time in metadata.execution (None: no timing)."""
    timing = (
        {}
        if seconds is None
        else {
            "iopub.execute_input": "2026-11-26T10:00:00.000000Z",
            "shell.execute_reply": f"2026-11-26T10:{int(seconds // 60):02d}:{seconds % 60:09.6f}Z",
        }
    )
    return {"cell_type": "code", "source": source, "metadata": {"execution": timing}, "outputs": []}


# A lab's core run: two core cells (40 s + 2.25 s) and a deep dive (100.5 s, its notice's time): core 42.25 s.
TIMED = {
    "cells": [
        {"cell_type": "markdown", "source": "# Lab 01", "metadata": {}},
        cell("from labcourse import core\ncore.follow()", 40.0),
        cell(["# Deep dive: the long table\n", "table()"], 100.5),  # sources as nbformat stores them: lists of lines
        cell("print('core')", 2.25),
    ],
    "metadata": {},
    "nbformat": 4,
    "nbformat_minor": 5,
}
UNTIMED = {**TIMED, "cells": [*TIMED["cells"], cell("print('no timing')", None)]}
# Stands in for `labcourse execute --core NOTEBOOK`: writes the executed notebook to build/core/ under its cwd.
FAKE_EXECUTE = """import pathlib, sys
notebook, status, lab = sys.argv[1:]
core = pathlib.Path("build/core") / pathlib.Path(lab).name
core.parent.mkdir(parents=True, exist_ok=True)
core.write_text(notebook)
sys.exit(int(status))
"""


def fake_lab(step, notebook, status=0):
    """A lab step of the plan, its command replaced by FAKE_EXECUTE writing `notebook` and exiting with `status`."""
    return dataclasses.replace(
        step, command=[PY, "-c", FAKE_EXECUTE, json.dumps(notebook), str(status), step.command[-1]]
    )


def test_a_lab_steps_core_seconds_are_read_from_the_notebook_it_executed(tmp_path):
    (tmp_path / "labs").mkdir()
    (tmp_path / "labs" / "01_lab.ipynb").write_text("{}")
    (lab,) = gpucheck.plan(1, tmp_path, tmp_path)
    cwd = tmp_path / "checkout"
    cwd.mkdir()
    quiet = {"echo": lambda _: None}
    assert gpucheck.run_step(fake_lab(lab, TIMED), 1, cwd, **quiet)["core_seconds"] == 42.25
    assert gpucheck.core_seconds(cwd / "build" / "core" / "01_lab.ipynb") == 42.25
    failed = gpucheck.run_step(fake_lab(lab, TIMED, status=1), 1, cwd, **quiet)  # wrote it, but did not pass
    untimed = gpucheck.run_step(fake_lab(lab, UNTIMED), 1, cwd, **quiet)
    wrote_none = gpucheck.run_step(dataclasses.replace(lab, command=[PY, "-c", "pass"]), 1, cwd, **quiet)  # stale one
    skipped = gpucheck.run_step(dataclasses.replace(lab, gpus=2), 1, cwd, **quiet)
    assert [(r["status"], r["core_seconds"]) for r in (failed, untimed, wrote_none, skipped)] == [
        ("failed", None),
        ("passed", None),
        ("passed", None),
        ("skipped", None),
    ]


@pytest.mark.parametrize("run_labs", [True, False])
def test_a_gpu_run_saves_each_labs_status_and_core_seconds(tmp_path, monkeypatch, capsys, run_labs):
    """The labs run from the checkout's root (ROOT), where execute's build/core/ lands and the core time is read."""
    checkout, runs = tmp_path / "checkout", tmp_path / "results"
    (checkout / "labs").mkdir(parents=True)
    for name in ("01_timed", "02_broken", "03_untimed"):
        (checkout / "labs" / f"{name}.ipynb").write_text("{}")
    real_plan = gpucheck.plan

    def plan(gpus, folder):
        assert folder == runs
        timed, broken, untimed = real_plan(gpus, folder, checkout)
        bench = gpucheck.Step("bench", [PY, "-c", "print('no run saved')"], 60)
        return [bench, fake_lab(timed, TIMED), fake_lab(broken, TIMED, status=1), fake_lab(untimed, UNTIMED)]

    monkeypatch.setattr(launch, "visible_gpus", lambda: 1)
    monkeypatch.setattr(gpucheck, "plan", plan)
    monkeypatch.setattr(gpucheck, "cpu_checks", lambda: [])
    monkeypatch.setattr(gpucheck, "ROOT", checkout)
    args = ["gpu-check", "-o", str(runs / "gpu-check.json")] + ([] if run_labs else ["--no-labs"])
    assert cli.main(args) == (1 if run_labs else 0)  # lab 02 failed
    report = json.loads((runs / "gpu-check.json").read_text())
    out = capsys.readouterr().out
    if not run_labs:
        assert [s["step"] for s in report["steps"]] == ["bench"] and report["labs_run"] is None
        assert not (runs / "gpu_labs").exists() and not (checkout / "build").exists()
        return
    assert [(s["step"], s["status"], s.get("core_seconds", "-")) for s in report["steps"]] == [
        ("bench", "passed", "-"),
        ("lab 01_timed", "passed", 42.25),
        ("lab 02_broken", "failed", None),
        ("lab 03_untimed", "passed", None),
    ]
    assert report["benchmarks"] == []  # the labs' run is not a benchmark's
    ((path, record),) = gpucheck.results.runs("gpu_labs", runs)
    assert report["labs_run"] == str(path) and record["machine"]["profile"] == "gpu"
    assert record["figures"] == {
        "labs": {
            "01_timed": {"status": "passed", "core_seconds": 42.25},
            "02_broken": {"status": "failed", "core_seconds": None},
            "03_untimed": {"status": "passed", "core_seconds": None},
        }
    }
    assert re.search(r"passed  lab 01_timed \(\d+ s, core path 42 s\)", out)
    assert re.search(r"failed  lab 02_broken \(\d+ s\)", out)
    assert re.search(r"passed  lab 03_untimed \(\d+ s, core path not timed\)", out)
    assert sorted(p.name for p in (checkout / "build" / "core").iterdir()) == [
        "01_timed.ipynb",
        "02_broken.ipynb",
        "03_untimed.ipynb",
    ]


def test_a_gpu_run_writes_every_step_and_reads_the_goals(tmp_path, monkeypatch, capsys):
    """The GPU path with stand-in steps (no GPU here): outcomes, the benchmarks' records and the goals."""
    runs = [  # what the benchmarks' results.save_run writes: {"benchmark", "machine", "figures"}
        ("precision_mfu", {"compile": True, "modes": {"bf16": {"mfu": 0.52}}}),
        ("precision_mfu", {"compile": False, "modes": {"bf16": {"mfu": 0.61}}}),
        ("pruning_speed", {"semi_structured": {"8192x8192": {"speedup": 1.4}}}),
        ("memory_at_scale", {"checkpointing_time_ratio": 1.3}),
        ("memory_at_scale", {"checkpointing_time_ratio": 1.2}),  # the lowest is the goal's reading
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
    assert len(report["benchmarks"]) == 5
    labs_run = json.loads(open(report["labs_run"]).read())
    assert labs_run["figures"] == {"labs": {"99": {"status": "failed", "core_seconds": None}}}
    measured = {goal: g["measured"] for goal, g in report["goals"].items()}
    assert measured == {
        "bf16 MFU, GPT-2 small, torch.compile": 0.52,
        "2:4 sparse linear speed-up, 8192 x 8192": 1.4,
        "GPTQ 4-bit / fp16 decode speed, batch 1": None,
        "activation checkpointing step time, with / without": 1.2,
    }
    out = capsys.readouterr().out
    assert "GPTQ 4-bit / fp16 decode speed, batch 1: target > 1, not measured" in out
    assert "bf16 MFU, GPT-2 small, torch.compile: target >= 0.55, measured 0.52" in out
