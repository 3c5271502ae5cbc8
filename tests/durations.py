"""A pytest plugin that writes where the suite's time goes: every test and notebook cell, slowest first.

`make test` loads it (`-p tests.durations`) and sets LABKIT_DURATIONS to the file to write
(tests/durations.txt, kept in the repository so that a change that slows the suite shows in review).
Under pytest-xdist only the controller writes, from the reports every worker sends it.

The same file orders the next run: files are collected longest first (by the last run's per-file totals; a file
not in it, a new lab, first of all), so that with `--dist loadscope --no-loadscope-reorder` the long notebooks
start at once on separate workers and the short files fill in around them, instead of a long notebook starting
last and running alone.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest

ENV_VAR = "LABKIT_DURATIONS"
CI_STARTED = "LABKIT_CI_STARTED"  # .ci/run's start (Unix seconds), so the report can say what the whole run took
_seconds: dict[str, float] = defaultdict(float)
_started = time.monotonic()


def read_file_seconds(text: str) -> dict[str, float]:
    """The per-file totals of a report written by `format_report`."""
    section = text.split("## per file\n", 1)[1].split("\n\n", 1)[0] if "## per file\n" in text else ""
    return {name: float(s) for s, name in (line.split(None, 1) for line in section.splitlines() if line.strip())}


def longest_first(nodeids: list[str], file_seconds: dict[str, float]) -> list[int]:
    """Indices of `nodeids` by their file's total, longest first (unknown files first), in order within a file."""
    key = lambda i: -file_seconds.get(nodeids[i].split("::", 1)[0], float("inf"))  # noqa: E731
    return sorted(range(len(nodeids)), key=key)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    dest = os.environ.get(ENV_VAR)
    if not dest or not Path(dest).is_file():
        return
    order = longest_first([item.nodeid for item in items], read_file_seconds(Path(dest).read_text(encoding="utf-8")))
    items[:] = [items[i] for i in order]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[report.nodeid] += report.duration  # setup + call + teardown


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _by_file(seconds: dict[str, float]) -> dict[str, float]:
    """Each file's seconds summed over its tests, slowest first."""
    by_file: dict[str, float] = defaultdict(float)
    for nodeid, s in seconds.items():
        by_file[nodeid.split("::", 1)[0]] += s
    return dict(sorted(by_file.items(), key=lambda kv: -kv[1]))


def _commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"


def format_report(
    seconds: dict[str, float], wall: float, workers: int, exit_status: int, since_ci: float | None = None
) -> str:
    """Per-file totals, then every test, slowest first (seconds summed over setup, call and teardown). `since_ci`:
    seconds since .ci/run started (setup, lint, the student build and this suite), when it did."""
    by_file = _by_file(seconds)
    lines = [
        f"# {len(seconds)} tests in {wall:.0f} s wall on {workers} worker(s), exit status {exit_status}",
        f"# {_cpu()}, {os.cpu_count()} logical cores; profile {os.environ.get('LABKIT_PROFILE', '?')}",
        f"# written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; times are per test, summed over workers",
        f"# commit {_commit()}"
        + ("" if since_ci is None else f"; .ci/run started {since_ci:.0f} s before this report was written"),
        "",
        "## per file",
        *(f"{s:8.1f}  {name}" for name, s in by_file.items()),
        "",
        "## per test",
        *(f"{s:8.2f}  {nodeid}" for nodeid, s in sorted(seconds.items(), key=lambda kv: -kv[1])),
    ]
    return "\n".join(lines) + "\n"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    dest = os.environ.get(ENV_VAR)
    if not dest or hasattr(session.config, "workerinput") or not _seconds:  # an xdist worker reports, never writes
        return
    workers = getattr(session.config.option, "numprocesses", None) or 1
    started = os.environ.get(CI_STARTED)
    since_ci = time.time() - float(started) if started else None
    wall = time.monotonic() - _started
    text = format_report(_seconds, wall, workers, int(exitstatus), since_ci)
    tmp = Path(dest).with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(dest)
    if since_ci is not None:  # a whole .ci/run: saved as a run for the README (commit it from a fresh clone's run)
        from labcourse import results

        results.save_run("make_test", ci_figures(_seconds, wall, workers, int(exitstatus), since_ci))


def ci_figures(seconds: dict[str, float], wall: float, workers: int, exit_status: int, since_ci: float) -> dict:
    """What a whole .ci/run measured: its time, the suite's, the outcome and each file's summed seconds."""
    return {
        "ci_seconds": round(since_ci, 1),
        "suite_seconds": round(wall, 1),
        "workers": workers,
        "tests": len(seconds),
        "exit_status": exit_status,
        "commit": _commit(),
        "files": {name: round(s, 1) for name, s in _by_file(seconds).items()},
    }
