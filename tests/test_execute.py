"""labcourse.execute: one clean top-to-bottom run written back — counts from 1, the machine recorded, progress bars as
their last text frame, no widget state or stray plotting reprs — and a failing run that changes nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest
from nbclient.exceptions import CellExecutionError
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from labcourse import execute, results


def test_last_frames_keeps_what_a_terminal_shows():
    bar = "\r  0%|          | 0/3\r 33%|███       | 1/3\r100%|██████████| 3/3\n"
    assert execute.last_frames("before\n" + bar + "after\n") == "before\n100%|██████████| 3/3\nafter\n"
    cleared = "\r 50%|█████     | 1/2\r                    \r"  # tqdm(leave=False) wipes its line on closing
    assert execute.last_frames("kept\n" + cleared) == "kept"


def test_tidy_drops_widgets_and_stray_reprs_and_merges_streams():
    nb = new_notebook(metadata={"widgets": {"state": {}}})
    cell = new_code_cell("x", execution_count=1)
    cell.outputs = [
        new_output("stream", name="stderr", text="\r 50%|█"),
        new_output("stream", name="stderr", text="\r100%|██| 2/2\n"),
        new_output("display_data", data={execute.WIDGET_VIEW: {"model_id": "a"}, "text/plain": "HBox()"}),
        new_output("execute_result", data={"text/plain": "[<matplotlib.lines.Line2D at 0x7f>]"}, execution_count=1),
        new_output("display_data", data={"image/png": "iVBOR", "text/plain": "<Figure size 640x480 with 1 Axes>"}),
        new_output("execute_result", data={"text/plain": "18.7"}, execution_count=1),
    ]
    nb.cells = [new_markdown_cell("# a lab"), cell]
    dropped = execute.tidy(nb)
    assert "widgets" not in nb.metadata
    assert [o.output_type for o in cell.outputs] == ["stream", "display_data", "execute_result"]
    assert cell.outputs[0].text == "100%|██| 2/2\n"
    assert "image/png" in cell.outputs[1].data and cell.outputs[2].data["text/plain"] == "18.7"
    assert dropped == ["cell 1: a widget view", "cell 1: [<matplotlib.lines.Line2D at 0x7f>]"]


LAB = [
    "import os, time\nprint('profile', os.environ['LABKIT_PROFILE'])",
    "from tqdm.auto import tqdm\nfor _ in tqdm(range(3), desc='steps'):\n    time.sleep(0.01)",
    "import matplotlib\nmatplotlib.use('agg')\nimport matplotlib.pyplot as plt\nplt.plot([1, 2])",
    "6 * 7",
    "from labcourse import expected\nexpected.check('00', {'perplexity': 18.7, 'tokens': 1234});",
]


def write_lab(path, sources):
    nb = new_notebook(cells=[new_code_cell(s) for s in sources])
    nb.cells[0].outputs = [new_output("stream", name="stdout", text="an old run's output\n")]
    nbformat.write(nb, str(path))
    return path.read_text()


def test_a_lab_is_run_top_to_bottom_and_written_back_clean(tmp_path):
    path = tmp_path / "99_lab.ipynb"
    write_lab(path, LAB)
    dropped = execute.execute(path, "smoke", timeout=120)
    nb = nbformat.read(str(path), as_version=4)
    assert [c.execution_count for c in nb.cells] == [1, 2, 3, 4, 5]
    assert nb.cells[0].outputs[0].text == "profile smoke\n"  # the profile reached the kernel; the old run is gone
    bar = "".join(o.text for o in nb.cells[1].outputs if o.output_type == "stream")
    assert "100%" in bar and "3/3" in bar and "\r" not in bar  # text, its last frame
    assert not any(execute.WIDGET_VIEW in o.get("data", {}) for c in nb.cells for o in c.outputs)
    assert nb.cells[2].outputs == [] and len(dropped) == 1 and dropped[0].startswith("cell 2: [<matplotlib.lines")
    assert nb.cells[3].outputs[0].data["text/plain"] == "42"
    executed = nb.metadata["labkit"]["executed"]
    assert executed["profile"] == "smoke" and executed["cpu"] and executed["packages"]["torch"]
    assert 0 < executed["seconds"] < 120
    # the lab's figures: shown as text, and kept as JSON in the same output for `labcourse figures`
    (shown,) = nb.cells[4].outputs
    assert "perplexity" in shown.data["text/plain"] and "expected 18.4–19" in shown.data["text/plain"]
    assert results.notebook_figures(path) == [
        {"lab": "00", "profile": "smoke", "figures": {"perplexity": 18.7, "tokens": 1234.0}}
    ]
    # the one thing this lab lacks to pass the committed-notebook check: a first line naming the machine
    assert execute.problems(nb) == [f"the first output does not name the CPU it ran on ({executed['cpu']})"]


def test_problems_names_each_way_a_saved_notebook_falls_short():
    nb = new_notebook(metadata={"widgets": {}})
    cells = [new_code_cell("print(banner)", execution_count=1), new_code_cell("plt.plot()", execution_count=3)]
    cells[0].outputs = [new_output("stream", name="stdout", text="labkit 0.1.0 | ran on CPU: Test CPU\n")]
    cells[1].outputs = [new_output("execute_result", data={"text/plain": "[<matplotlib.lines.Line2D>]"})]
    nb.cells = cells
    assert execute.problems(nb) == [
        "execution counts are [1, 3], not 1 … 2",
        "widget state in the metadata",
        "cell 1: [<matplotlib.lines.Line2D>]",
        "no fingerprint: not written by `labcourse execute`",
    ]
    nb.metadata = {"labkit": {"executed": {"cpu": "Test CPU"}}}
    figure = {"image/png": "iVBOR", "text/plain": "<Figure size 640x480 with 1 Axes>"}  # a figure, kept by tidy
    cells[1].execution_count, cells[1].outputs = 2, [new_output("execute_result", data=figure)]
    assert execute.problems(nb) == []


def test_a_failing_lab_is_left_as_it_was_and_its_partial_run_kept(tmp_path):
    path = tmp_path / "98_broken.ipynb"
    before = write_lab(path, ["print('first')", "raise RuntimeError('cell two broke')", "print('never')"])
    with pytest.raises(execute.ExecutionFailed, match="cell 1 raised RuntimeError: cell two broke") as failed:
        execute.execute(path, "smoke", timeout=120, failed_dir=tmp_path / "failed")
    assert isinstance(failed.value.__cause__, CellExecutionError)
    assert path.read_text() == before
    partial = nbformat.read(str(tmp_path / "failed" / path.name), as_version=4)
    assert partial.cells[0].outputs[0].text == "first\n" and partial.cells[2].execution_count is None


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"profile": "laptop"}, ValueError, "unknown profile 'laptop'"),
        ({"profile": None}, TypeError, "profile must be a str"),
        ({"timeout": 0}, ValueError, "timeout must be an int of seconds >= 1 or None, got 0"),
        ({"timeout": "10"}, TypeError, "timeout must be an int of seconds >= 1 or None, got '10'"),
        ({"timeout": 1.5}, TypeError, "timeout must be an int of seconds >= 1 or None, got 1.5"),
        ({"timeout": True}, TypeError, "timeout must be an int of seconds >= 1 or None, got True"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, kwargs, error, match):
    path = tmp_path / "97_lab.ipynb"
    before = write_lab(path, ["print(1)"])
    with pytest.raises(error, match=match):
        execute.execute(path, **{"profile": "smoke", "failed_dir": tmp_path / "failed", **kwargs})
    assert path.read_text() == before and not (tmp_path / "failed").exists()


CELL = {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": "1"}
MALFORMED = [
    ("[]", "the JSON is of type list, not an object"),
    ('{"cells": 3}', "it has no nbformat field"),
    ("not json", "it is not UTF-8 JSON"),
    ('{"nbformat": 3, "cells": []}', "its nbformat is 3, not 4"),
    ('{"nbformat": 4, "nbformat_minor": 4, "metadata": {}, "cells": 3}', "its cells are of type int, not a list"),
    ('{"nbformat": 4, "nbformat_minor": 4, "metadata": {}, "cells": [7]}', "cell 0 is of type int, not an object"),
    ('{"nbformat": 4, "nbformat_minor": 4, "cells": []}', "'metadata' is a required property (at the top level)"),
    (json.dumps({"nbformat": 4, "nbformat_minor": 4, "metadata": {}, "cells": [{**CELL, "source": 5}]}), "at cells/0"),
]


@pytest.mark.parametrize("text, problem", MALFORMED)
def test_a_malformed_notebook_is_named_with_what_is_wrong(tmp_path, text, problem):
    path = tmp_path / "bad.ipynb"
    path.write_text(text)
    with pytest.raises(ValueError, match="bad.ipynb is not a (valid )?notebook: ") as refused:
        execute.read_notebook(path)
    assert problem in str(refused.value)
    with pytest.raises(ValueError, match="bad.ipynb"):  # before any kernel starts, changing nothing
        execute.execute(path, "smoke", failed_dir=tmp_path / "failed")
    assert path.read_text() == text and not (tmp_path / "failed").exists()


def test_read_notebook_reads_every_lab():
    labs = sorted((Path(__file__).parents[1] / "labs").glob("*.ipynb"))
    assert len(labs) >= 10 and all(execute.read_notebook(p).cells for p in labs)


def test_the_command_runs_every_notebook_and_reports_each_one_that_stops_short(tmp_path, capfd, monkeypatch):
    """A cell that raises, one past the time-out, one that kills its kernel, a missing and a malformed notebook:
    each is one line on stderr (no traceback, not even the kernel's), the partial runs are kept, the fine notebook
    after them all is written, and the summary and the exit status say so."""
    from labcourse import cli

    monkeypatch.chdir(tmp_path)  # the failed runs go to ./build/execute
    runs = {
        "01_raises.ipynb": ["print('before')", "1 / 0"],
        "02_sleeps.ipynb": ["print('before')", "import time\ntime.sleep(60)", "print('never')"],
        "03_kills.ipynb": ["print('before')", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"],
    }
    before = {name: write_lab(tmp_path / name, cells) for name, cells in runs.items()}
    (tmp_path / "05_malformed.ipynb").write_text("[]")
    write_lab(tmp_path / "06_fine.ipynb", ["print('ran')"])
    names = [*runs, "04_missing.ipynb", "05_malformed.ipynb", "06_fine.ipynb"]
    assert cli.main(["execute", "--profile", "smoke", "--timeout", "2", *names]) == 1
    out, err = capfd.readouterr()
    assert err.splitlines() == [
        "labcourse execute: 01_raises.ipynb: cell 1 raised ZeroDivisionError: division by zero under profile 'smoke'; "
        "the partial run is in build/execute/01_raises.ipynb (the kernel's log beside it), "
        "01_raises.ipynb is unchanged",
        "labcourse execute: 02_sleeps.ipynb: cell 1 ran past the 2 s time-out under profile 'smoke'; the partial run "
        "is in build/execute/02_sleeps.ipynb (the kernel's log beside it), 02_sleeps.ipynb is unchanged",
        "labcourse execute: 03_kills.ipynb: the kernel died in cell 1 under profile 'smoke'; the partial run is in "
        "build/execute/03_kills.ipynb (the kernel's log beside it), 03_kills.ipynb is unchanged",
        "labcourse execute: No such file or directory: 04_missing.ipynb",
        "labcourse execute: 05_malformed.ipynb is not a notebook: the JSON is of type list, not an object",
    ]
    assert "06_fine.ipynb: written back" in out and out.endswith(
        "written back: 06_fine.ipynb\nfailed (left as they were): " + ", ".join(names[:5]) + "\n"
    )
    for name in runs:
        assert (tmp_path / name).read_text() == before[name]
        partial = nbformat.read(str(tmp_path / "build" / "execute" / name), as_version=4)
        assert partial.cells[0].outputs[0].text == "before\n"
        assert (tmp_path / "build" / "execute" / name).with_suffix(".kernel.log").is_file()
    assert nbformat.read(str(tmp_path / "06_fine.ipynb"), as_version=4).cells[0].outputs[0].text == "ran\n"


def test_a_closed_output_pipe_does_not_stop_the_command(tmp_path):
    """`labcourse execute a b | head -1`, made certain: stdout is a pipe whose reader has already gone. Every notebook
    still runs, and the exit status says whether all were written."""
    write_lab(tmp_path / "a.ipynb", ["print('a ran')"])
    (tmp_path / "bad.ipynb").write_text('{"cells": 3}')
    write_lab(tmp_path / "b.ipynb", ["print('b ran')"])
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "labcourse", "execute", "--profile", "smoke", "a.ipynb", "bad.ipynb", "b.ipynb"],
            cwd=tmp_path,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    finally:
        os.close(write)
    assert done.returncode == 1
    assert done.stderr == "labcourse execute: bad.ipynb is not a notebook: it has no nbformat field\n"
    for name in ("a", "b"):
        assert nbformat.read(str(tmp_path / f"{name}.ipynb"), as_version=4).cells[0].outputs[0].text == f"{name} ran\n"


# cell 0 leaves the kernel's pid, cell 1 a file saying it has started, then sleeps until a signal stops the run
SLEEPS = [
    "import os\nopen('kernel.pid', 'w').write(str(os.getpid()))\nprint('first')",
    "import time\nopen('started', 'w').close()\ntime.sleep(60)",
    "print('never')",
]


def wait_for(path, seconds=60):
    """Wait until `path` exists (a cell has written it), at most `seconds`; whether it does."""
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return path.exists()


def test_sigterm_stops_the_command_keeping_the_partial_run_and_no_kernel(tmp_path):
    """A scheduler's time limit (or `timeout`) sends SIGTERM mid-cell: the partial run is kept as for a failed cell,
    the kernel is gone, the notebooks after it do not run, and the exit status is 128 + 15."""
    write_lab(tmp_path / "a.ipynb", SLEEPS)
    write_lab(tmp_path / "b.ipynb", ["print('b ran')"])
    before = {name: (tmp_path / name).read_bytes() for name in ("a.ipynb", "b.ipynb")}
    command = [sys.executable, "-m", "labcourse", "execute", "--profile", "smoke", "a.ipynb", "b.ipynb"]
    with subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as run:
        try:
            assert wait_for(tmp_path / "started"), "cell 1 never started"
            run.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            out, err = run.communicate(timeout=10)
        finally:
            run.kill()  # a no-op once it has exited
    assert run.returncode == 143 and time.monotonic() - sent < 5
    assert err == (
        "labcourse execute: a.ipynb: interrupted by SIGTERM in cell 1 under profile 'smoke'; the partial run is in "
        "build/execute/a.ipynb (the kernel's log beside it), a.ipynb is unchanged\n"
    )
    assert "b.ipynb" not in out and out.endswith("written back: none\nfailed (left as they were): a.ipynb\n")
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    partial = nbformat.read(str(tmp_path / "build" / "execute" / "a.ipynb"), as_version=4)
    assert partial.cells[0].outputs[0].text == "first\n" and "execution" in partial.cells[0].metadata
    assert partial.cells[2].execution_count is None
    assert (tmp_path / "build" / "execute" / "a.kernel.log").is_file()
    with pytest.raises(ProcessLookupError):  # the kernel was shut down, not left running without its client
        os.kill(int((tmp_path / "kernel.pid").read_text()), 0)


def test_sigint_to_a_library_call_raises_interrupted_and_leaves_the_signal_handlers_as_they_were(tmp_path):
    """^C in a caller of execute(), a test among others: the partial run kept, the kernel gone, Interrupted raised,
    and the caller's own SIGINT handler back in place (it never saw this ^C)."""
    path = tmp_path / "a.ipynb"
    write_lab(path, SLEEPS)
    before = path.read_bytes()
    missed = []

    def stray(signum, frame):  # takes a ^C that execute's own handler did not
        missed.append(signum)

    previous = signal.signal(signal.SIGINT, stray)
    sender = threading.Thread(target=lambda: wait_for(tmp_path / "started") and os.kill(os.getpid(), signal.SIGINT))
    try:
        sender.start()
        with pytest.raises(execute.Interrupted, match="a.ipynb: interrupted by SIGINT in cell 1 under") as stopped:
            execute.execute(path, "smoke", timeout=20, failed_dir=tmp_path / "failed")
        sender.join()
        assert signal.getsignal(signal.SIGINT) is stray and missed == []
    finally:
        signal.signal(signal.SIGINT, previous)
    assert stopped.value.signum == signal.SIGINT and path.read_bytes() == before
    assert nbformat.read(str(tmp_path / "failed" / path.name), as_version=4).cells[0].outputs[0].text == "first\n"
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "kernel.pid").read_text()), 0)


CORE_LAB = [
    "from labcourse import core\ncore.follow()",
    "# Deep dive: a slow part\nslow = True",
    "print('slow' in globals())",
]


@pytest.mark.parametrize("core_only", [False, True])
def test_the_core_switch_skips_deep_dives_and_writes_elsewhere_whatever_the_environment_says(
    tmp_path, monkeypatch, core_only
):
    monkeypatch.setenv("LABCOURSE_CORE", "0" if core_only else "1")  # the argument decides, not the environment
    path = tmp_path / "99_lab.ipynb"
    before = write_lab(path, CORE_LAB)
    execute.execute(path, "smoke", timeout=120, core_only=core_only, core_dir=tmp_path / "core")
    written = tmp_path / "core" / path.name if core_only else path
    nb = nbformat.read(str(written), as_version=4)
    assert nb.cells[2].outputs[0].text == f"{not core_only}\n"
    assert ("deep dive skipped" in "".join(o.get("text", "") for o in nb.cells[1].outputs)) is core_only
    assert nb.metadata["labkit"]["executed"].get("core_only", False) is core_only
    if core_only:
        assert path.read_text() == before  # the lab itself is left as it was
