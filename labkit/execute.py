"""Run a lab top to bottom in a fresh kernel and write it back with its outputs (`labkit execute`, `make execute`).

One clean pass per notebook: execution counts 1, 2, 3 …; the machine it ran on recorded in the notebook's
metadata; progress bars saved as their last frame of plain text instead of widgets that GitHub shows frozen at
0 %; no `[<matplotlib.lines.Line2D …>]` left by a cell's last expression. A lab that fails is not written back:
its partial run goes to `failed_dir` for reading, and the committed notebook stays as it was.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from labkit import assets, env, profiles

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
        found.append("no fingerprint: not written by `labkit execute`")
    else:
        first = "".join(o.get("text", "") for o in (code[0].outputs if code else []) if o.output_type == "stream")
        if executed["cpu"] not in first:
            found.append(f"the first output does not name the CPU it ran on ({executed['cpu']})")
    return found


def execute(
    path: str | Path, profile: str, *, timeout: int | None = None, failed_dir: str | Path = "build/execute"
) -> list[str]:
    """Execute the notebook at `path` under `profile` in a fresh kernel, tidy it, record the fingerprint, and
    write it back atomically; returns what `tidy` dropped. A failing cell raises, and leaves `path` untouched."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    path = Path(path)
    if profile not in profiles.PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose from {', '.join(profiles.PROFILES)}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be positive seconds or None, got {timeout!r}")
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    with tempfile.TemporaryDirectory() as ipython_dir:
        startup = Path(ipython_dir) / "profile_default" / "startup"
        startup.mkdir(parents=True)
        (startup / "00-text-progress.py").write_text(_TEXT_PROGRESS)
        kernel_env = {**os.environ, profiles.ENV_VAR: profile, "IPYTHONDIR": ipython_dir}
        resources = {"metadata": {"path": path.parent}}  # the kernel runs in the notebook's folder
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources=resources)
        start = time.perf_counter()
        try:
            client.execute(env=kernel_env)
        except CellExecutionError:
            partial = Path(failed_dir) / path.name
            partial.parent.mkdir(parents=True, exist_ok=True)
            assets.atomic_write_text(partial, nbformat.writes(nb))
            print(f"{path.name} failed under profile {profile!r}; the partial run is in {partial}, {path} is unchanged")
            raise
    dropped = tidy(nb)
    seconds = round(time.perf_counter() - start, 1)  # kernel start to last cell: the lab's time for the guide
    nb.metadata["labkit"] = {"executed": {**env.fingerprint(profile), "seconds": seconds}}
    assets.atomic_write_text(path, nbformat.writes(nb))
    return dropped
