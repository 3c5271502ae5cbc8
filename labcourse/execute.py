"""Run a lab top to bottom in a fresh kernel and write it back with its outputs (`labcourse execute`, `make execute`).

One clean pass per notebook: execution counts 1, 2, 3 …; the machine it ran on recorded in the notebook's
metadata; progress bars saved as their last frame of plain text instead of widgets that GitHub shows frozen at
0 %; no `[<matplotlib.lines.Line2D …>]` left by a cell's last expression. A lab that fails, or whose run ^C or
SIGTERM stops, is not written back: its partial run goes to `failed_dir` for reading, and the committed notebook
stays as it was.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from labcourse import core
from labkit import fileio, profiles

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# what a cell's last expression leaves when it is a plotting call: `[<matplotlib.lines.Line2D at 0x…>]`, `<Axes: …>`
STRAY_REPR = re.compile(r"^\[?<(matplotlib\.|Figure size|Axes|Legend|Text)")
# Run at kernel start (an IPython startup file): tqdm.auto draws ipywidgets in a kernel, whose saved state is
# the first frame; plain tqdm writes text with carriage returns, which `last_frames` turns into the last frame.
_TEXT_PROGRESS = """\
import tqdm.auto, tqdm.autonotebook, tqdm.std
tqdm.auto.tqdm = tqdm.autonotebook.tqdm = tqdm.std.tqdm
tqdm.auto.trange = tqdm.autonotebook.trange = tqdm.std.trange
"""


def last_frames(text: str) -> str:
    """Stream text as a terminal would leave it: on each line only what follows its last carriage return, and
    lines that a progress bar cleared on closing (leave=False) dropped."""
    lines = []
    for line in text.split("\n"):
        frame = line.rsplit("\r", 1)[-1]
        if "\r" in line and not frame.strip():
            continue
        lines.append(frame)
    return "\n".join(lines)


def _stray(out: Any) -> str | None:
    """Why a saved output would not render as it ran, or None: a widget view (saved as its first frame), or the
    text-only repr a plotting call leaves as a cell's last expression (a figure with its image is kept)."""
    data = out.get("data", {})
    if WIDGET_VIEW in data:
        return "a widget view"
    if out.output_type == "execute_result" and set(data) == {"text/plain"} and STRAY_REPR.match(data["text/plain"]):
        return data["text/plain"][:60]
    return None


def tidy(nb: Any) -> list[str]:
    """Make saved outputs render as they ran: streams merged and reduced to their last frames, widget views and
    stray plotting reprs dropped, widget state removed. Returns what was dropped, one line each."""
    dropped = []
    nb.metadata.pop("widgets", None)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        kept: list[Any] = []
        for out in cell.outputs:
            if out.output_type == "stream":
                if kept and kept[-1].output_type == "stream" and kept[-1].name == out.name:
                    kept[-1].text += out.text
                else:
                    kept.append(out)
                continue
            if why := _stray(out):
                dropped.append(f"cell {index}: {why}")
                continue
            kept.append(out)
        for out in kept:
            if out.output_type == "stream":
                out.text = last_frames(out.text)
        cell.outputs = [o for o in kept if o.output_type != "stream" or o.text.strip()]
    return dropped


def problems(nb: Any) -> list[str]:
    """What keeps a saved notebook from being one clean run: execution counts not 1, 2, 3 … over its code cells,
    widget state or views, stray plotting reprs, no recorded fingerprint, or a first output that does not name the
    fingerprint's CPU. Empty for a notebook `execute` wrote."""
    found = []
    code = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.execution_count for c in code]
    if counts != list(range(1, len(code) + 1)):
        found.append(f"execution counts are {counts}, not 1 … {len(code)}")
    if "widgets" in nb.metadata:
        found.append("widget state in the metadata")
    for index, cell in enumerate(nb.cells):
        found += [f"cell {index}: {why}" for out in cell.get("outputs", []) if (why := _stray(out))]
    executed = nb.metadata.get("labkit", {}).get("executed")
    if not executed:
        found.append("no fingerprint: not written by `labcourse execute`")
    else:
        first = "".join(o.get("text", "") for o in (code[0].outputs if code else []) if o.output_type == "stream")
        if executed["cpu"] not in first:
            found.append(f"the first output does not name the CPU it ran on ({executed['cpu']})")
    return found


class ExecutionFailed(RuntimeError):
    """A notebook's run stopped short: a cell raised or ran past its time-out, or the kernel died. The message says
    which cell and where the partial run was kept; nbclient's error is its __cause__."""


class Interrupted(ExecutionFailed):
    """A notebook's run stopped by SIGINT or SIGTERM, its partial run kept as for a failure; `signum` is the signal's
    number (the command exits with 128 + it)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


def _shape_problem(data: Any) -> str | None:
    """What keeps parsed JSON from being a notebook in format 4 before nbformat's schema can say it, or None: nbformat
    itself answers these with an AttributeError, a TypeError or an ImportError."""
    if not isinstance(data, dict):
        return f"the JSON is of type {type(data).__name__}, not an object"
    if data.get("nbformat") != 4:
        return f"its nbformat is {data['nbformat']!r}, not 4" if "nbformat" in data else "it has no nbformat field"
    cells = data.get("cells")
    if not isinstance(cells, list):
        return "it has no cells field" if cells is None else f"its cells are of type {type(cells).__name__}, not a list"
    odd = next((i for i, c in enumerate(cells) if not isinstance(c, dict)), None)
    return None if odd is None else f"cell {odd} is of type {type(cells[odd]).__name__}, not an object"


def read_notebook(path: str | Path) -> Any:
    """The notebook at `path`, read and checked whole before anything acts on it: a malformed one raises ValueError
    naming the path and what is wrong (a missing or unreadable file, the OSError)."""
    import nbformat

    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:  # UnicodeDecodeError, JSONDecodeError
        raise ValueError(f"{path} is not a notebook: it is not UTF-8 JSON ({err})") from None
    if problem := _shape_problem(data):
        raise ValueError(f"{path} is not a notebook: {problem}")
    try:
        nbformat.validate(nbformat.from_dict(data))
    except nbformat.ValidationError as err:
        where = "/".join(map(str, err.absolute_path)) or "the top level"
        raise ValueError(f"{path} is not a valid notebook: {err.message} (at {where})") from None
    return nbformat.v4.to_notebook_json(data)  # as nbformat.read gives it: sources joined, transient fields dropped


def check_options(profile: str, timeout: int | None) -> None:
    """Refuse a profile or a time-out that `execute` cannot run with, naming the argument, before anything runs."""
    if not isinstance(profile, str):
        raise TypeError(f"profile must be a str, one of {', '.join(profiles.PROFILES)}; got {profile!r}")
    if profile not in profiles.PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose from {', '.join(profiles.PROFILES)}")
    if timeout is not None and (not isinstance(timeout, int) or isinstance(timeout, bool)):
        raise TypeError(f"timeout must be an int of seconds >= 1 or None, got {timeout!r}")
    if timeout is not None and timeout < 1:
        raise ValueError(f"timeout must be an int of seconds >= 1 or None, got {timeout!r}")


def _why_stopped(err: Exception, cell: int | str, timeout: int | None) -> str:
    """One line on why a run stopped, from nbclient's error and the index of the cell that was running."""
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    if isinstance(err, CellExecutionError):
        return f"cell {cell} raised {err.ename}: {' '.join(str(err.evalue).split())}"
    if isinstance(err, CellTimeoutError):
        return f"cell {cell} ran past the {timeout} s time-out"
    if isinstance(err, DeadKernelError):
        return f"the kernel died in cell {cell}"
    return f"the kernel failed ({' '.join(str(err).split())})"  # e.g. it died while starting


async def _execute_and_clean_up(client: Any, **kwargs: Any) -> None:
    """client.async_execute(**kwargs), and a kernel it leaves running shut down: nbclient's clean-up misses one whose
    start was cancelled."""
    try:
        await client.async_execute(**kwargs)
    finally:
        if client.km is not None and client.km.has_kernel:
            await client.km.shutdown_kernel(now=True)


def _execute_stoppably(client: Any, **kwargs: Any) -> int | None:
    """Run client.execute(**kwargs) in a thread of its own, where nbclient cannot set its SIGINT and SIGTERM handlers
    (which shut the kernel down under the running cell, then crash): here in the main thread, those signals cancel
    the run instead, its kernel killed. Returns the signal that stopped the run, or None; what the run raised
    otherwise is raised."""
    loop = asyncio.new_event_loop()
    run = loop.create_task(_execute_and_clean_up(client, **kwargs))
    stopped_by: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        if not stopped_by:  # once: a second ^C must not cut the kernel's shutdown short
            stopped_by.append(signum)
            client.shutdown_kernel = "immediate"
            loop.call_soon_threadsafe(run.cancel)

    in_main = threading.current_thread() is threading.main_thread()  # only it can set signal handlers
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
    try:
        worker = threading.Thread(target=loop.run_until_complete, args=(asyncio.wait([run]),))
        worker.start()
        worker.join()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    left = asyncio.all_tasks(loop)  # nbclient's pollers of a cancelled cell: ended as asyncio.run would end them
    for task in left:
        task.cancel()
    if left:
        loop.run_until_complete(asyncio.wait(left))
    loop.close()
    try:
        run.result()  # what the run raised, unless a signal stopped it
    except BaseException:
        if not stopped_by:
            raise
    return stopped_by[0] if stopped_by else None


def execute(
    path: str | Path,
    profile: str,
    *,
    timeout: int | None = None,
    failed_dir: str | Path = "build/execute",
    core_only: bool = False,
    core_dir: str | Path = "build/core",
) -> list[str]:
    """Execute the notebook at `path` under `profile` in a fresh kernel, tidy it, record the fingerprint, and
    write it back atomically; returns what `tidy` dropped. Every cell runs, whatever $LABCOURSE_CORE says; with
    `core_only` the deep dives are skipped and the run goes to `core_dir`, leaving `path` as it was. A run that
    stops short (a cell raises or times out, the kernel dies or fails to start) raises ExecutionFailed, with its
    partial run and the kernel's log put in `failed_dir`, and leaves `path` untouched; so does a missing (OSError)
    or malformed (ValueError) notebook, checked before any kernel starts. SIGINT or SIGTERM during the run stops it
    the same way, raising Interrupted, with the kernel shut down and the previous signal handlers restored."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    from labkit import env  # imports torch: only a run needs it, not read_notebook (the student build)

    check_options(profile, timeout)
    path = Path(path)
    nb = read_notebook(path)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    started: list[int] = []  # each cell's index as it starts: the last one is where a run stopped
    with tempfile.TemporaryDirectory() as ipython_dir:
        startup = Path(ipython_dir) / "profile_default" / "startup"
        startup.mkdir(parents=True)
        (startup / "00-text-progress.py").write_text(_TEXT_PROGRESS)
        kernel_env = {
            **os.environ,
            profiles.ENV_VAR: profile,
            core.ENV_VAR: "1" if core_only else "0",
            "IPYTHONDIR": ipython_dir,
        }
        resources = {"metadata": {"path": path.parent}}  # the kernel runs in the notebook's folder
        client = NotebookClient(
            nb,
            timeout=timeout,
            kernel_name="python3",
            resources=resources,
            on_cell_start=lambda cell, cell_index: started.append(cell_index),
        )
        log = Path(ipython_dir) / "kernel.log"
        start = time.perf_counter()
        # the kernel's own output (its log, a traceback when it is shut down mid-cell), not the cells': to a file
        with log.open("w", encoding="utf-8") as kernel_output:
            failure, signum = None, None
            try:
                signum = _execute_stoppably(client, env=kernel_env, stdout=kernel_output, stderr=kernel_output)
            except (CellExecutionError, CellTimeoutError, RuntimeError) as err:  # RuntimeError: a dead kernel
                failure = err
            if failure or signum:
                partial = Path(failed_dir) / path.name
                partial.parent.mkdir(parents=True, exist_ok=True)
                fileio.atomic_write_text(partial, nbformat.writes(nb))
                fileio.atomic_write_bytes(partial.with_suffix(".kernel.log"), log.read_bytes())
                if signum:
                    where = f"in cell {started[-1]}" if started else "before its first cell"
                    why = f"interrupted by {signal.Signals(signum).name} {where}"
                else:
                    why = _why_stopped(failure, started[-1] if started else "?", timeout)
                message = (
                    f"{path}: {why} under profile {profile!r}; the partial run is in {partial} (the kernel's log "
                    f"beside it), {path.name} is unchanged"
                )
                raise (Interrupted(message, signum) if signum else ExecutionFailed(message)) from failure
    dropped = tidy(nb)
    seconds = round(time.perf_counter() - start, 1)  # kernel start to last cell: the lab's time for the guide
    executed = {**env.fingerprint(profile), "seconds": seconds} | ({"core_only": True} if core_only else {})
    nb.metadata["labkit"] = {"executed": executed}
    target = Path(core_dir) / path.name if core_only else path
    target.parent.mkdir(parents=True, exist_ok=True)
    fileio.atomic_write_text(target, nbformat.writes(nb))
    return dropped
