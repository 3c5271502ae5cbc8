"""A lab's core path and its deep dives: the cells a workshop runs, and the optional ones it may skip.

A deep-dive code cell says so on its first line (`# Deep dive: <what it adds>`), under a markdown heading that
says so too, and no later cell of the core path reads anything it alone defines. With `LABCOURSE_CORE=1` in the
kernel's environment, a lab whose first cell called `follow()` runs those cells as a one-line notice instead, so
Run All takes the core path alone; without it (and under `make execute`) every cell runs. The core time of an
executed lab is the sum of its core cells' recorded run times.
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any

ENV_VAR = "LABCOURSE_CORE"
MARKER = "# Deep dive"
CORE_BUDGET_S = 600  # a lab's core path under the cpu profile on a 2-core CPU: ten minutes


def core_only() -> bool:
    """Whether this process runs the core path alone: $LABCOURSE_CORE set to 1, true or yes (any case)."""
    return os.environ.get(ENV_VAR, "").strip().lower() in {"1", "true", "yes"}


def _first_line(source: str) -> str:
    return next((line.strip() for line in source.splitlines() if line.strip()), "")


def is_deep_dive(source: str) -> bool:
    """Whether a code cell's source belongs to a deep dive: its first non-blank line starts with `# Deep dive`."""
    return _first_line(source).startswith(MARKER)


def what(source: str) -> str:
    """What a deep-dive cell adds, from its marker line (`# Deep dive: the 3-bit table` gives 'the 3-bit table')."""
    return _first_line(source)[len(MARKER) :].lstrip(" :—-") or "a deep dive"


def skip_deep_dives(lines: list[str]) -> list[str]:
    """An IPython input transformer: a deep-dive cell becomes a notice when the core path runs alone."""
    source = "".join(lines)
    if not (core_only() and is_deep_dive(source)):
        return lines
    notice = f"deep dive skipped ({ENV_VAR}=1, the core path alone): {what(source)}"
    return [f"print({notice!r})\n"]


def follow() -> None:
    """Make the running IPython kernel honour $LABCOURSE_CORE from here on (read at each cell, so `%env` can flip
    it); say so when it is set. Outside IPython (a plain script) it does nothing."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    if skip_deep_dives not in shell.input_transformers_post:
        shell.input_transformers_post.append(skip_deep_dives)
    if core_only():
        print(f"{ENV_VAR}=1: the core path alone; cells marked '{MARKER}' print a notice instead of running")


def cell_seconds(cell: Any) -> float | None:
    """How long an executed code cell ran, from the timestamps nbclient records in its metadata; None if absent."""
    timing = cell.get("metadata", {}).get("execution", {})
    start, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
    if not (start and end):
        return None
    began, ended = (datetime.fromisoformat(t.replace("Z", "+00:00")) for t in (start, end))
    return (ended - began).total_seconds()


def split_seconds(cells: list[Any]) -> tuple[float, float]:
    """(core, deep-dive) seconds of an executed notebook's code cells, their sources joined into strings (as
    `figures.read_cells` gives them); ValueError naming a cell without timing."""
    core = deep = 0.0
    for index, cell in enumerate(cells):
        if cell.get("cell_type") != "code":
            continue
        seconds = cell_seconds(cell)
        if seconds is None:
            raise ValueError(f"cell {index} has no recorded run time: the notebook was not executed by nbclient")
        if is_deep_dive(cell.get("source", "")):
            deep += seconds
        else:
            core += seconds
    return core, deep
