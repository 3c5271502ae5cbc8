"""`labcourse gpu-check`: one command for a GPU machine. Every lab under the gpu profile and the GPU
benchmarks, each in its own process with a time limit, into one JSON that names the device; without
CUDA, the CPU-side checks only, and a plain statement that nothing GPU-side was measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labcourse import results
from labkit import assets, bench, env, fileio, precision, profiles
from labkit.parallel import launch
from labkit.torchutil import as_path, check_bool, check_int

ROOT = Path(__file__).resolve().parent.parent
SIZES_TEST = ROOT / "tests" / "test_profiles.py"  # every profile's sizes against the offline data (seconds)

# The course's GPU goals: (target, how to read the measured figure from this check's benchmark runs, each
# {"benchmark": name, **figures}).
# Printed beside the measurement, never failed: they are speed figures.
GOALS: dict[str, tuple[str, Callable[[list[dict[str, Any]]], float | None]]] = {
    "bf16 MFU, GPT-2 small, torch.compile": (
        ">= 0.55",
        lambda records: _best(
            r.get("modes", {}).get("bf16", {}).get("mfu")
            for r in records
            if r.get("benchmark") == "precision_mfu" and r.get("compile")
        ),
    ),
    "2:4 sparse linear speed-up, 8192 x 8192": (
        "> 1",
        lambda records: _best(
            r.get("semi_structured", {}).get("8192x8192", {}).get("speedup")
            for r in records
            if r.get("benchmark") == "pruning_speed"
        ),
    ),
    "GPTQ 4-bit / fp16 decode speed, batch 1": (
        "> 1",
        lambda records: _best(r.get("speedup") for r in records if r.get("benchmark") == "gptq_decode"),
    ),
    "activation checkpointing step time, with / without": (
        "<= 1.4",
        lambda records: _best(
            (r.get("checkpointing_time_ratio") for r in records if r.get("benchmark") == "memory_at_scale"),
            lowest=True,
        ),
    ),
}


def _best(values: Any, lowest: bool = False) -> float | None:
    found = [v for v in values if v is not None]
    return (min if lowest else max)(found) if found else None


@dataclass(frozen=True)
class Step:
    """One thing to run: a command in its own process, with a limit and the GPUs it needs."""

    name: str
    command: list[str]
    timeout_s: int
    gpus: int = 1
    env: dict[str, str] = field(default_factory=dict)


def plan(gpus: int, runs: Path, root: Path = ROOT) -> list[Step]:
    """The GPU steps for a machine with `gpus` CUDA devices: benchmarks first (minutes), each saving its run under
    `runs` (`results.save_run`), then every lab under the gpu profile. A step that needs more GPUs than there are
    is kept, to be reported skipped."""
    check_int("gpus", gpus)
    runs, root = as_path("runs", runs), as_path("root", root)
    py = sys.executable

    def benchmark(script: str, *args: str) -> list[str]:
        return [py, str(root / "benchmarks" / script), "--results", str(runs), *args]

    steps = [
        Step("precision and MFU, eager", benchmark("precision_mfu.py", "--device", "cuda"), 1200),
        Step("precision and MFU, torch.compile", benchmark("precision_mfu.py", "--device", "cuda", "--compile"), 1800),
        Step("pruning speed and 2:4 kernels", benchmark("pruning_speed.py", "--device", "cuda"), 1200),
        Step("GPTQ 4-bit decode vs fp16", benchmark("gptq_decode.py", "--device", "cuda"), 1200),
        Step("LoRA vs full fine-tune memory", benchmark("lora_vs_full.py"), 2400),
        Step("sharded memory and checkpointing", benchmark("memory_at_scale.py"), 1800),
        Step(
            "all-reduce on NCCL",
            [
                py,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={max(2, min(gpus, 8))}",
                str(root / "labs" / "scripts" / "allreduce_bench.py"),
                "--results",
                str(runs),
            ],
            600,
            gpus=2,
        ),
    ]
    for notebook in sorted((root / "labs").glob("[0-9][0-9]_*.ipynb")):
        steps.append(
            Step(
                f"lab {notebook.stem}",
                [
                    py,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "--nbval-lax",
                    "--nbval-cell-timeout=3600",
                    str(notebook),
                ],
                5400,
                env={profiles.ENV_VAR: "gpu"},
            )
        )
    return steps


def cpu_checks() -> list[dict[str, Any]]:
    """What can be checked without a GPU: the machine, where ranks would run, the gpu profile's sizes."""
    gpus = launch.visible_gpus()
    rows = [
        {
            "check": "CUDA",
            "ok": gpus > 0,
            "detail": f"{gpus} GPU(s): {', '.join(g['name'] for g in env.gpus())}"
            if gpus
            else precision.cuda_problem("cuda") or "no CUDA GPU visible to torch",
        }
    ]
    rows.append({"check": "labs 04/05 ranks", "ok": True, "detail": launch.placement(2, gpus).reason})
    cache = assets.read_access_problem(assets.cache_dir())
    rows.append({"check": "offline cache", "ok": cache is None, "detail": cache or str(assets.cache_dir())})
    if SIZES_TEST.is_file():  # a source checkout
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(SIZES_TEST)],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        rows.append(
            {
                "check": "profile sizes vs the data",
                "ok": done.returncode == 0,
                "detail": (done.stdout.strip().splitlines() or ["no output"])[-1],
            }
        )
    return rows


def run_step(step: Step, gpus: int, cwd: Path, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run one step; its outcome, time and output tail (a failed or skipped step does not stop the check)."""
    if not isinstance(step, Step):
        raise TypeError(f"step must be a gpucheck.Step (see plan), got {type(step).__name__}")
    check_int("gpus", gpus)
    cwd = as_path("cwd", cwd)
    _check_echo(echo)
    if gpus < step.gpus:
        return {
            "step": step.name,
            "status": "skipped",
            "seconds": 0.0,
            "detail": f"needs {step.gpus} GPUs, this machine has {gpus}",
        }
    echo(f"--- {step.name}")
    start = time.perf_counter()
    try:
        done = subprocess.run(
            step.command,
            cwd=cwd,
            env={**os.environ, **step.env},
            capture_output=True,
            text=True,
            timeout=step.timeout_s,
        )
        status, output = ("passed" if done.returncode == 0 else "failed"), done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        status, output = "timed out", f"{err.stdout or ''}{err.stderr or ''}"
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
    seconds = time.perf_counter() - start
    echo(f"    {status} in {seconds:.0f} s")
    return {"step": step.name, "status": status, "seconds": seconds, "output_tail": output[-4000:]}


def gpu_check(output: Path, *, run_labs: bool = True, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole check; writes `output` (JSON) and returns it. Without CUDA only cpu_checks run."""
    output = as_path("output", output)
    if output.is_dir():  # found now, not after an hour of labs
        raise IsADirectoryError(f"output {output} is a directory: give a file name (results/gpu-check.json)")
    check_bool("run_labs", run_labs)
    _check_echo(echo)
    report: dict[str, Any] = {
        "device": bench.device_name(),
        "environment": env.collect(),
        "checks": cpu_checks(),
        "steps": [],
        "benchmarks": [],
        "goals": {},
    }
    for row in report["checks"]:
        echo(f"{'ok ' if row['ok'] else 'NO '} {row['check']}: {row['detail']}")
    gpus = launch.visible_gpus()
    if gpus == 0:
        echo(
            "no CUDA GPU: the GPU steps (labs under the gpu profile, GPU benchmarks) were not run; "
            "nothing GPU-side was measured"
        )
    else:
        runs = output.resolve().parent  # results/: each benchmark's run beside this report, to be committed
        before = set(runs.glob("*/*.json"))
        steps = [s for s in plan(gpus, runs) if run_labs or not s.name.startswith("lab ")]
        report["steps"] = [run_step(s, gpus, ROOT / "labs" if s.name.startswith("lab ") else ROOT, echo) for s in steps]
        report["benchmarks"] = [
            {"benchmark": record["benchmark"], "file": str(path), **record["figures"]}
            for name in sorted({p.parent.name for p in set(runs.glob("*/*.json")) - before})
            for path, record in results.runs(name, runs)
            if path not in before
        ]
        report["goals"] = {
            goal: {"target": target, "measured": read(report["benchmarks"])} for goal, (target, read) in GOALS.items()
        }
        echo(summary(report))
    fileio.atomic_write_text(output, json.dumps(report, indent=1, default=str))
    echo(f"wrote {output}")
    return report


def _check_echo(echo: Callable[[str], None]) -> None:
    if not callable(echo):
        raise TypeError(f"echo must be callable (print, say), got {echo!r}")


def summary(report: dict[str, Any]) -> str:
    """The steps' outcomes and the goals against what was measured, one line each."""
    if not isinstance(report, dict) or not {"device", "steps", "goals"} <= report.keys():
        raise ValueError("report must be gpu_check's result: a dict with 'device', 'steps' and 'goals'")
    lines = [f"gpu-check on {report['device']}:"]
    lines += [f"  {s['status']:>9}  {s['step']} ({s['seconds']:.0f} s)" for s in report["steps"]]
    lines += ["goals (speed: reported, never failed):"]
    lines += [
        f"  {goal}: target {g['target']}, "
        + ("not measured" if g["measured"] is None else f"measured {g['measured']:.3g}")
        for goal, g in report["goals"].items()
    ]
    return "\n".join(lines)
