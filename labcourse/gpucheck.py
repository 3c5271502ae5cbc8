"""`labcourse gpu-check`: one command for a GPU machine. The GPU benchmarks, and every lab's core path under the
gpu profile (`labcourse execute --core`, its time read from the executed notebook), each in its own process with a
time limit, into one JSON that names the device; without CUDA, the CPU-side checks only, and a plain statement that
nothing GPU-side was measured."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labcourse import core, figures, results
from labkit import assets, bench, env, fileio, precision
from labkit.parallel import launch
from labkit.torchutil import as_path, check_bool, check_int

ROOT = Path(__file__).resolve().parent.parent
SIZES_TEST = ROOT / "tests" / "test_profiles.py"  # every profile's sizes against the offline data (seconds)
LAB_TIMEOUT_S = 1800  # a lab step: one lab's core path under the gpu profile, kernel start included
CORE_DIR = Path("build/core")  # where `labcourse execute --core` writes a lab's run, under its cwd (gpu-check: ROOT)
LABS_RUN = "gpu_labs"  # the results run that holds each lab's outcome and core-path seconds
STOP_GRACE_S = 60  # a step past its limit gets SIGTERM (execute then shuts its kernel down), then SIGKILL after this

# A script under DECLARING declares its own gpu-check steps, and the course goals its runs measure, as module-level
# literals: gpu-check reads them with ast.literal_eval and never imports the script (the scripts import torch;
# `gpu-check --plan` stays cheap). A step runs the script with `--results FOLDER` and its args (under torchrun: a
# rank per GPU, at least `gpus`, at most 8). A goal is printed beside the best `figure` (a key path) among the runs
# the script saved (results.save_run) that match `where`: a speed figure, reported and never failed.
DECLARING = ("benchmarks", "labs/scripts")  # benchmarks first; each folder's scripts by file name
DECLARED = {  # declaration -> key -> (test, what it must be)
    "GPU_CHECK": {
        "name": (lambda v: isinstance(v, str) and v != "", "a non-empty str"),
        "args": (lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v), "a list of str"),
        "timeout_s": (lambda v: type(v) is int and v >= 1, "an int >= 1 (seconds)"),
        "gpus": (lambda v: type(v) is int and v >= 1, "an int >= 1 (optional, default 1)"),
        "torchrun": (lambda v: isinstance(v, bool), "True or False (optional, default False)"),
    },
    "GPU_GOALS": {
        "goal": (lambda v: isinstance(v, str) and v != "", "a non-empty str"),
        "target": (lambda v: isinstance(v, str) and v != "", "a non-empty str, e.g. '>= 0.55'"),
        "figure": (
            lambda v: isinstance(v, list) and v != [] and all(isinstance(k, str) for k in v),
            "a non-empty list of keys",
        ),
        "best": (lambda v: v in ("max", "min"), "'max' or 'min'"),
        "where": (lambda v: isinstance(v, dict), "a dict of figure -> value the run must have (optional)"),
    },
}
OPTIONAL = {"gpus", "torchrun", "where"}


@dataclass(frozen=True)
class Step:
    """One thing to run: a command in its own process, with a limit and the GPUs it needs."""

    name: str
    command: list[str]
    timeout_s: int
    gpus: int = 1
    env: dict[str, str] = field(default_factory=dict)
    executed: str | None = None  # a lab's: its executed notebook, relative to the cwd, whose core seconds are read


@dataclass(frozen=True)
class Goal:
    """A course GPU goal: its target, and the figure it reads from one benchmark's runs (the best one)."""

    target: str
    benchmark: str
    figure: tuple[str, ...]
    best: str  # "max" or "min"
    where: dict[str, Any] = field(default_factory=dict)

    def read(self, records: list[dict[str, Any]]) -> float | None:
        """The best `figure` among the `records` ({"benchmark": name, **figures}) of this benchmark that match
        `where`; None when none has it."""
        found = []
        for record in records:
            if record.get("benchmark") != self.benchmark or any(record.get(k) != v for k, v in self.where.items()):
                continue
            value: Any = record
            for key in self.figure:
                value = value.get(key) if isinstance(value, dict) else None
            if value is not None:
                found.append(value)
        return (max if self.best == "max" else min)(found) if found else None


def _declared(script: Path) -> tuple[dict[str, list[dict[str, Any]]], set[str]]:
    """The checked GPU_CHECK / GPU_GOALS of `script` and the names it saves runs under, read without importing it;
    ValueError naming the file for a malformed declaration."""
    text = script.read_text(encoding="utf-8")
    if not any(name in text for name in DECLARED):
        return {}, set()
    try:
        tree = ast.parse(text, filename=str(script))
    except SyntaxError as err:
        raise ValueError(f"{script}: cannot be parsed to read its gpu-check declaration: {err}") from err
    found: dict[str, Any] = {}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [None])[0]
        if not isinstance(target, ast.Name) or target.id not in DECLARED:
            continue
        if target.id in found:
            raise ValueError(f"{script}: {target.id} is assigned twice (line {node.lineno}); declare it once")
        try:
            found[target.id] = ast.literal_eval(node.value)
        except (ValueError, TypeError, SyntaxError) as err:
            raise ValueError(
                f"{script}: {target.id} (line {node.lineno}) must be a literal: lists, dicts, strings, numbers, "
                "no names or calls (gpu-check reads it without importing the script)"
            ) from err
    for name, entries in found.items():
        keys = DECLARED[name]
        if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
            raise ValueError(f"{script}: {name} must be a non-empty list of dicts with keys {list(keys)}")
        for i, entry in enumerate(entries):
            missing, unknown = sorted(keys.keys() - OPTIONAL - entry.keys()), sorted(entry.keys() - keys.keys())
            if missing or unknown:
                raise ValueError(
                    f"{script}: {name}[{i}] lacks {missing} or has unknown keys {unknown}; its keys: {list(keys)}"
                )
            for key, value in entry.items():
                test, what = keys[key]
                if not test(value):
                    raise ValueError(f"{script}: {name}[{i}][{key!r}] must be {what}, got {value!r}")
    saves = {  # save_run("name", ...) calls, the name written out
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == "save_run"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }
    return found, saves


def _declarations(root: Path) -> list[tuple[Path, list[dict[str, Any]], dict[str, Goal]]]:
    """(script, steps, goals by name) for every script in DECLARING that declares any, in order; ValueError naming
    the file for a malformed declaration or a step or goal name that another script declares too."""
    declared = []
    owners: dict[str, Path] = {}
    for folder in DECLARING:
        for script in sorted((root / folder).glob("*.py")):
            found, saves = _declared(script)
            if not found:
                continue
            steps, goals = found.get("GPU_CHECK", []), found.get("GPU_GOALS", [])
            if goals and len(saves) != 1:
                raise ValueError(
                    f"{script}: GPU_GOALS reads the runs the script saves, but it saves them under "
                    f"{sorted(saves) or 'no name'}: call results.save_run once, with the name written out"
                )
            for name in [s["name"] for s in steps] + [g["goal"] for g in goals]:
                if name in owners:
                    raise ValueError(f"{script}: {name!r} is declared in {owners[name]} too: give each its own name")
                owners[name] = script
            benchmark = next(iter(saves), "")  # the one name its runs have (checked above when it has goals)
            read = {
                g["goal"]: Goal(g["target"], benchmark, tuple(g["figure"]), g["best"], g.get("where", {}))
                for g in goals
            }
            declared.append((script, steps, read))
    return declared


def goals(root: Path = ROOT) -> dict[str, Goal]:
    """The course's GPU goals by name, as the scripts under `root` declare them (GPU_GOALS)."""
    return {name: goal for _, _, read in _declarations(as_path("root", root)) for name, goal in read.items()}


def plan(gpus: int, runs: Path, root: Path = ROOT) -> list[Step]:
    """The GPU steps for a machine with `gpus` CUDA devices: the steps the scripts declare (GPU_CHECK; benchmarks/,
    then labs/scripts/, each by file name), each saving its run under `runs` (`results.save_run`), then every lab's
    core path under the gpu profile (`labcourse execute --core`, run from the repository root: the executed
    notebook lands in build/core/). A step that needs more GPUs than there are is kept, to be reported skipped."""
    check_int("gpus", gpus)
    runs, root = as_path("runs", runs), as_path("root", root)
    py = sys.executable
    steps = []
    for script, declared, _ in _declarations(root):
        for step in declared:
            need = step.get("gpus", 1)
            ranks = f"--nproc_per_node={max(need, min(gpus, 8))}"  # a rank per GPU, on one node
            launcher = [py, "-m", "torch.distributed.run", "--standalone", ranks] if step.get("torchrun") else [py]
            command = [*launcher, str(script), "--results", str(runs), *step["args"]]
            steps.append(Step(step["name"], command, step["timeout_s"], gpus=need))
    for notebook in sorted((root / "labs").glob("[0-9][0-9]_*.ipynb")):
        command = [py, "-m", "labcourse", "execute", "--profile", "gpu", "--core", str(notebook)]
        steps.append(Step(f"lab {notebook.stem}", command, LAB_TIMEOUT_S, executed=str(CORE_DIR / notebook.name)))
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


def core_seconds(notebook: Path) -> float | None:
    """The core-path seconds of an executed notebook (the sum of its core cells' run times); None when it cannot be
    read or a code cell has no recorded run time."""
    try:
        return core.split_seconds(figures.read_cells(as_path("notebook", notebook)))[0]
    except (OSError, ValueError):
        return None


def _stamp(path: Path) -> tuple[int, int] | None:
    """What tells a file rewritten since (its inode and modification time), or None when there is none."""
    try:
        found = path.stat()
    except OSError:
        return None
    return found.st_ino, found.st_mtime_ns


def run_step(step: Step, gpus: int, cwd: Path, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run one step in `cwd`; its outcome, time and output tail (a failed or skipped step does not stop the check).
    A step past its limit gets SIGTERM (`labcourse execute` then shuts its kernel down, which runs in a session of
    its own, and keeps the partial run), and SIGKILL STOP_GRACE_S later. A lab step's entry also has `core_seconds`:
    those of the notebook it executed (`cwd / step.executed`), or None when it did not pass or wrote none."""
    if not isinstance(step, Step):
        raise TypeError(f"step must be a gpucheck.Step (see plan), got {type(step).__name__}")
    check_int("gpus", gpus)
    cwd = as_path("cwd", cwd)
    _check_echo(echo)
    lab = {} if step.executed is None else {"core_seconds": None}
    if gpus < step.gpus:
        return {
            "step": step.name,
            "status": "skipped",
            "seconds": 0.0,
            "detail": f"needs {step.gpus} GPUs, this machine has {gpus}",
            **lab,
        }
    executed = None if step.executed is None else cwd / step.executed
    before = None if executed is None else _stamp(executed)
    echo(f"--- {step.name}")
    start = time.perf_counter()
    with subprocess.Popen(
        step.command,
        cwd=cwd,
        env={**os.environ, **step.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
    ) as process:
        try:
            out, err = process.communicate(timeout=step.timeout_s)
            status = "passed" if process.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            status = "timed out"
            process.terminate()
            try:
                out, err = process.communicate(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                out, err = process.communicate()
    output = (out or "") + (err or "")
    seconds = time.perf_counter() - start
    if executed is not None and status == "passed" and _stamp(executed) not in (None, before):  # written by this run
        lab["core_seconds"] = core_seconds(executed)
    done = {"step": step.name, "status": status, "seconds": seconds, **lab, "output_tail": output[-4000:]}
    echo(f"    {status} in {seconds:.0f} s{_core_note(done)}")
    return done


def gpu_check(output: Path, *, run_labs: bool = True, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole check; writes `output` (JSON) and returns it. Without CUDA only cpu_checks run. With CUDA, the steps
    run from the repository root, and when a lab ran, its outcome and core-path seconds are saved as a results run
    (LABS_RUN) beside the benchmarks' runs, in the folder of `output`."""
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
        "labs_run": None,  # the gpu_labs run saved under results/, when a lab ran
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
        report["steps"] = [run_step(s, gpus, ROOT, echo) for s in steps]  # a lab's build/core/ in this checkout
        report["benchmarks"] = [
            {"benchmark": record["benchmark"], "file": str(path), **record["figures"]}
            for name in sorted({p.parent.name for p in set(runs.glob("*/*.json")) - before})
            for path, record in results.runs(name, runs)
            if path not in before
        ]
        report["goals"] = {
            name: {"target": goal.target, "measured": goal.read(report["benchmarks"])} for name, goal in goals().items()
        }
        labs = {
            s["step"].removeprefix("lab "): {"status": s["status"], "core_seconds": s.get("core_seconds")}
            for s in report["steps"]
            if s["step"].startswith("lab ")
        }
        if any(lab["status"] != "skipped" for lab in labs.values()):  # beside the benchmarks' runs, after reading them
            report["labs_run"] = str(results.save_run(LABS_RUN, {"labs": labs}, profile="gpu", root=runs))
        echo(summary(report))
        if report["labs_run"]:
            echo(f"saved the labs' outcomes and core-path seconds to {report['labs_run']}")
    fileio.atomic_write_text(output, json.dumps(report, indent=1, default=str))
    echo(f"wrote {output}")
    return report


def _check_echo(echo: Callable[[str], None]) -> None:
    if not callable(echo):
        raise TypeError(f"echo must be callable (print, say), got {echo!r}")


def _core_note(step: dict[str, Any]) -> str:
    """A lab step's core-path seconds, to print beside its own; nothing for another step or a lab that did not pass."""
    if step.get("core_seconds") is not None:
        return f", core path {step['core_seconds']:.0f} s"
    return ", core path not timed" if "core_seconds" in step and step["status"] == "passed" else ""


def summary(report: dict[str, Any]) -> str:
    """The steps' outcomes (a lab's with its core-path seconds) and the goals against what was measured, one line
    each."""
    if not isinstance(report, dict) or not {"device", "steps", "goals"} <= report.keys():
        raise ValueError("report must be gpu_check's result: a dict with 'device', 'steps' and 'goals'")
    lines = [f"gpu-check on {report['device']}:"]
    lines += [f"  {s['status']:>9}  {s['step']} ({s['seconds']:.0f} s{_core_note(s)})" for s in report["steps"]]
    lines += ["goals (speed: reported, never failed):"]
    lines += [
        f"  {goal}: target {g['target']}, "
        + ("not measured" if g["measured"] is None else f"measured {g['measured']:.3g}")
        for goal, g in report["goals"].items()
    ]
    return "\n".join(lines)
