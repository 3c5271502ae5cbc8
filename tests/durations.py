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
import time
from collections import defaultdict
from pathlib import Path

import pytest

ENV_VAR = "LABKIT_DURATIONS"
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


def format_report(seconds: dict[str, float], wall: float, workers: int, exit_status: int) -> str:
    """Per-file totals, then every test, slowest first (seconds summed over setup, call and teardown)."""
    by_file: dict[str, float] = defaultdict(float)
    for nodeid, s in seconds.items():
        by_file[nodeid.split("::", 1)[0]] += s
    lines = [
        f"# {len(seconds)} tests in {wall:.0f} s wall on {workers} worker(s), exit status {exit_status}",
        f"# {_cpu()}, {os.cpu_count()} logical cores; profile {os.environ.get('LABKIT_PROFILE', '?')}",
        f"# written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; times are per test, summed over workers",
        "",
        "## per file",
        *(f"{s:8.1f}  {name}" for name, s in sorted(by_file.items(), key=lambda kv: -kv[1])),
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
    text = format_report(_seconds, time.monotonic() - _started, workers, int(exitstatus))
    tmp = Path(dest).with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(dest)
