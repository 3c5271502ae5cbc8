"""labkit.student: the student build stubs every marked solution, keeps everything else, and the
built notebooks run up to the first exercise, where the check says what is left."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from labkit import student

LABS = Path(__file__).resolve().parent.parent / "labs"

SOLVED = '''def merge(word):
    """Exercise."""
    # BEGIN SOLUTION
    out = list(word)
    return tuple(out)
    # END SOLUTION


print("after")
'''


def test_a_marked_region_becomes_a_stub_at_its_indentation():
    source, count = student.strip_solutions(SOLVED)
    assert count == 1
    assert source == f'def merge(word):\n    """Exercise."""\n    {student.STUB}\n\n\nprint("after")\n'
    assert "out = list" not in source
    assert student.strip_solutions("x = 1\n") == ("x = 1\n", 0)


@pytest.mark.parametrize(
    "source, problem",
    [
        ("# BEGIN SOLUTION\nx = 1\n", "never closed"),
        ("x = 1\n# END SOLUTION\n", "without a"),
        ("# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION\n", "inside a solution region"),
    ],
)
def test_unbalanced_markers_are_errors_that_name_the_place(source, problem):
    with pytest.raises(ValueError, match=problem):
        student.strip_solutions(source, "lab.ipynb, cell 3")


def test_the_student_build_covers_every_lab_and_clears_outputs(tmp_path):
    counts = student.build_student(LABS, tmp_path / "student")
    assert set(counts) == {p.name for p in LABS.glob("*.ipynb")}
    assert sum(counts.values()) >= 5  # exercises in labs 01, 02, 03, 06 and 08 at least
    assert (tmp_path / "student" / "scripts" / "ddp_train.py").is_file()
    for name in counts:
        nb = nbformat.read(str(tmp_path / "student" / name), as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(c.outputs == [] and c.execution_count is None for c in code)
        assert not any(student.BEGIN in c.source or student.END in c.source for c in code)


def test_a_failed_build_leaves_the_previous_one(tmp_path):
    good = tmp_path / "labs"
    good.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SOLVED)])
    nbformat.write(nb, str(good / "a.ipynb"))
    student.build_student(good, tmp_path / "out")
    nbformat.write(
        nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("# BEGIN SOLUTION\n")]), str(good / "b.ipynb")
    )
    with pytest.raises(ValueError, match="b.ipynb, cell 0"):
        student.build_student(good, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.ipynb"]


@pytest.mark.slow
def test_the_student_lab_runs_up_to_its_first_exercise_and_the_check_names_it(tmp_path):
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    student.build_student(LABS, tmp_path / "student")
    nb = nbformat.read(str(tmp_path / "student" / "01_data_and_tokenization.ipynb"), as_version=4)
    first = next(i for i, c in enumerate(nb.cells) if student.STUB in c.source)
    nb.cells = nb.cells[: first + 2]  # everything before the exercise, the exercise, and its check
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path / "student")}}
    )
    with pytest.raises(CellExecutionError) as failure:
        client.execute()
    assert "CheckFailed" in str(failure.value) and "not written yet" in str(failure.value)
    ran = [c for c in nb.cells[:first] if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in ran)  # every cell before the exercise ran
