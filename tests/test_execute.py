"""labkit.execute: one clean top-to-bottom run written back — counts from 1, the machine recorded, progress bars as
their last text frame, no widget state or stray plotting reprs — and a failing run that changes nothing."""

from __future__ import annotations

import nbformat
import pytest
from nbclient.exceptions import CellExecutionError
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from labkit import execute, results


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
    "from labkit import expected\nexpected.check('00', {'perplexity': 18.7, 'tokens': 1234});",
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
    # the lab's figures: shown as text, and kept as JSON in the same output for `labkit figures`
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
        "no fingerprint: not written by `labkit execute`",
    ]
    nb.metadata = {"labkit": {"executed": {"cpu": "Test CPU"}}}
    figure = {"image/png": "iVBOR", "text/plain": "<Figure size 640x480 with 1 Axes>"}  # a figure, kept by tidy
    cells[1].execution_count, cells[1].outputs = 2, [new_output("execute_result", data=figure)]
    assert execute.problems(nb) == []


def test_a_failing_lab_is_left_as_it_was_and_its_partial_run_kept(tmp_path):
    path = tmp_path / "98_broken.ipynb"
    before = write_lab(path, ["print('first')", "raise RuntimeError('cell two broke')", "print('never')"])
    with pytest.raises(CellExecutionError, match="cell two broke"):
        execute.execute(path, "smoke", timeout=120, failed_dir=tmp_path / "failed")
    assert path.read_text() == before
    partial = nbformat.read(str(tmp_path / "failed" / path.name), as_version=4)
    assert partial.cells[0].outputs[0].text == "first\n" and partial.cells[2].execution_count is None


@pytest.mark.parametrize(
    "kwargs, match", [({"profile": "laptop"}, "unknown profile 'laptop'"), ({"timeout": 0}, "timeout must be")]
)
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, kwargs, match):
    path = tmp_path / "97_lab.ipynb"
    before = write_lab(path, ["print(1)"])
    with pytest.raises(ValueError, match=match):
        execute.execute(path, **{"profile": "smoke", **kwargs})
    assert path.read_text() == before


def test_the_command_goes_on_after_a_failing_lab_and_exits_non_zero(tmp_path, capsys, monkeypatch):
    from labkit import cli

    monkeypatch.chdir(tmp_path)  # the failed run goes to ./build/execute
    broken, fine = tmp_path / "01_broken.ipynb", tmp_path / "02_fine.ipynb"
    before = write_lab(broken, ["1 / 0"])
    write_lab(fine, ["print('ran')"])
    assert cli.main(["execute", "--profile", "smoke", "--timeout", "120", str(broken), str(fine)]) == 1
    out = capsys.readouterr().out
    assert "ZeroDivisionError" in out and "02_fine.ipynb: written back" in out
    assert "failed (left as they were): 01_broken.ipynb" in out
    assert broken.read_text() == before and (tmp_path / "build" / "execute" / broken.name).is_file()
    assert nbformat.read(str(fine), as_version=4).cells[0].outputs[0].text == "ran\n"
