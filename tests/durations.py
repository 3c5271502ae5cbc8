"""A pytest plugin that writes where the suite's time goes: every test and notebook cell, slowest first.

`make test` loads it (`-p tests.durations`) and sets LABKIT_DURATIONS to the file to write
(tests/durations.txt, kept in the repository so that a change that slows the suite shows in review).
Under pytest-xdist only the controller writes, from the reports every worker sends it.
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
