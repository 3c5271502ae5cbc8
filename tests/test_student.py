"""labcourse.student: the student build stubs every marked solution, drops the `solution-only` cells and keeps
everything else; every solution in the labs passes its check (the suite runs the student build under nbval, so
this is where the solutions run); `make lab`'s working copies never overwrite what a student changed."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import torch

from labcourse import checks, student

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
    for page in LABS.glob("*.md"):  # the start page and the pages it links, beside the labs as in labs/
        assert (tmp_path / "student" / page.name).read_text() == page.read_text()
    for name in counts:
        nb = nbformat.read(str(tmp_path / "student" / name), as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(c.outputs == [] and c.execution_count is None for c in code)
        assert not any(student.BEGIN in c.source or student.END in c.source for c in code)
        assert not any(student.HIDDEN in c.metadata.get("tags", []) for c in nb.cells)
        solved = nbformat.read(str(LABS / name), as_version=4)
        hidden = [c for c in solved.cells if student.HIDDEN in c.metadata.get("tags", [])]
        assert hidden and all(c.cell_type == "markdown" for c in hidden)  # every lab's reference figures, no code
        assert len(nb.cells) == len(solved.cells) - len(hidden)


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
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.ipynb", "labkit-output.txt"]


def _exercises(path: Path) -> list[tuple[str, str]]:
    """(the exercise cell's source, the check cell's source) for each exercise of a lab notebook."""
    cells = [c for c in nbformat.read(str(path), as_version=4).cells if c.cell_type == "code"]
    found = []
    for i, cell in enumerate(cells):
        if student.BEGIN in cell.source:
            found.append((cell.source, next(c.source for c in cells[i + 1 :] if "checks.check_" in c.source)))
    return found


@pytest.mark.parametrize("lab", sorted(p.name for p in LABS.glob("*.ipynb")))
def test_every_solution_in_the_labs_passes_its_check(lab, capsys):
    exercises = _exercises(LABS / lab)
    assert len(exercises) == 2, "two exercises per lab"
    for solution, check_cell in exercises:
        namespace = {"torch": torch}
        exec(compile(solution, f"{lab} exercise", "exec"), namespace)
        name, check = re.search(r"^(\w+) = checks\.(check_\w+)\(\1\)$", check_cell, re.M).groups()
        assert getattr(checks, check)(namespace[name]) is namespace[name]  # the lab goes on with the solution
        assert "passed" in capsys.readouterr().out
        # in the student build the stub sits inside the function: defining it raises nothing
        stubbed, count = student.strip_solutions(solution)
        exec(compile(stubbed, f"{lab} exercise, stubbed", "exec"), {"torch": torch})
        assert count == 1


def _source(path: Path) -> str:
    return "\n".join(c.source for c in nbformat.read(str(path), as_version=4).cells)


def _lab(tmp_path: Path, cells: list) -> Path:
    labs = tmp_path / "labs"
    labs.mkdir(exist_ok=True)
    nbformat.write(nbformat.v4.new_notebook(cells=cells), str(labs / "a.ipynb"))
    return labs


def test_solution_only_cells_are_left_out_and_outputs_kept_only_when_asked(tmp_path):
    ran = nbformat.v4.new_code_cell(SOLVED, execution_count=3, outputs=[nbformat.v4.new_output("stream", text="x")])
    reveal = nbformat.v4.new_markdown_cell("measured: 0.72x", metadata={"tags": [student.HIDDEN]})
    labs = _lab(tmp_path, [ran, reveal, nbformat.v4.new_markdown_cell("kept")])
    nb, count = student.student_notebook(labs / "a.ipynb")
    assert count == 1 and [c.source for c in nb.cells[1:]] == ["kept"]
    assert nb.cells[0].outputs == [] and nb.cells[0].execution_count is None
    kept, _ = student.student_notebook(labs / "a.ipynb", keep_outputs=True)
    assert kept.cells[0].outputs[0].text == "x" and len(kept.cells) == 2 and student.STUB in kept.cells[0].source


def test_the_workspace_never_overwrites_a_students_copy(tmp_path):
    labs = _lab(tmp_path, [nbformat.v4.new_code_cell(SOLVED)])
    (labs / "scripts").mkdir()
    (labs / "scripts" / "run.py").write_text("print(1)\n")
    work = tmp_path / "work"
    assert student.workspace(labs, work) == {"a.ipynb": "written"}
    assert (work / "scripts" / "run.py").read_text() == "print(1)\n"
    assert student.STUB in _source(work / "a.ipynb") and "out = list" not in _source(work / "a.ipynb")
    assert student.workspace(labs, work) == {"a.ipynb": "up to date"}

    _lab(tmp_path, [nbformat.v4.new_code_cell(SOLVED), nbformat.v4.new_markdown_cell("new section")])
    assert student.workspace(labs, work) == {"a.ipynb": "updated to the course's new version"}  # untouched copy
    assert "new section" in _source(work / "a.ipynb")

    mine = (work / "a.ipynb").read_text().replace("raise NotImplementedError", "return tuple(word)  #")
    (work / "a.ipynb").write_text(mine)
    assert student.workspace(labs, work) == {"a.ipynb": "kept as you left it"}
    _lab(tmp_path, [nbformat.v4.new_markdown_cell("rewritten")])
    said = student.workspace(labs, work)["a.ipynb"]
    assert said.startswith("kept as you left it (the course's version differs") and "a.mine.ipynb" in said
    assert (work / "a.ipynb").read_text() == mine


def test_the_solution_workspace_copies_the_notebooks_as_committed(tmp_path):
    labs = _lab(tmp_path, [nbformat.v4.new_code_cell(SOLVED, outputs=[nbformat.v4.new_output("stream", text="x")])])
    assert student.workspace(labs, tmp_path / "work", solutions=True) == {"a.ipynb": "written"}
    assert (tmp_path / "work" / "a.ipynb").read_text() == (labs / "a.ipynb").read_text()


@pytest.mark.parametrize(
    "damaged, problem",
    [
        (b"{not json", "is not JSON"),
        (b"\xff\xfe", "is not JSON"),
        (b"[]", "is not an object of notebook names and digests"),
        (b'{"a.ipynb": 5}', "is not an object of notebook names and digests"),
    ],
    ids=["not-json", "not-utf8", "a-list", "a-number-for-a-digest"],
)
def test_a_damaged_workspace_record_keeps_every_copy_and_says_so(tmp_path, damaged, problem):
    labs = _lab(tmp_path, [nbformat.v4.new_code_cell(SOLVED)])
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("b")]), str(labs / "b.ipynb"))
    work = tmp_path / "work"
    student.workspace(labs, work)
    mine = (work / "a.ipynb").read_text().replace("raise NotImplementedError", "return tuple(word)  #")
    (work / "a.ipynb").write_text(mine)
    record = work / student.MANIFEST
    record.write_bytes(damaged)
    _lab(tmp_path, [nbformat.v4.new_code_cell(SOLVED), nbformat.v4.new_markdown_cell("new section")])
    with pytest.warns(UserWarning, match=re.escape(f"{record} {problem}") + ".*kept as yours"):
        report = student.workspace(labs, work)
    assert report["a.ipynb"].startswith("kept as you left it") and report["b.ipynb"] == "up to date"
    assert (work / "a.ipynb").read_text() == mine
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("b2")]), str(labs / "b.ipynb"))
    assert student.workspace(labs, work)["b.ipynb"] == "updated to the course's new version"  # the record is whole


def printed_sources(source: str) -> list[str]:
    """The dotted names whose source a code cell prints with inspect.getsource."""
    return re.findall(r"getsource\(\s*([\w.]+)\s*\)", source)


def test_printed_sources_are_found():
    assert printed_sources("print(inspect.getsource(bench.time_fn))\nx = 1\ngetsource( lora.LoRALinear.forward )") == [
        "bench.time_fn",
        "lora.LoRALinear.forward",
    ]


@pytest.mark.parametrize("lab", sorted(LABS.glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.stem)
def test_no_lab_prints_an_exercises_answer_before_its_check(lab):
    """A lab may show labkit's source of an exercise's reference as 'compare yours', after the exercise's check;
    printed before it, the student build hands out the answer above the question."""
    from labcourse import grade

    cells = nbformat.read(str(lab), as_version=4).cells
    leaks = []
    for exercise in grade.exercises(lab):
        reference = getattr(checks, exercise.check).shown_as  # "bench.time_fn(...).median", "lora.LoRALinear"
        name = re.match(r"[\w.]+", reference).group(0).split(".")[-1]
        check_at = next(i for i, c in enumerate(cells) if c.cell_type == "code" and exercise.check + "(" in c.source)
        leaks += [
            f"cell {i} prints {shown} before exercise {exercise.number}'s check (cell {check_at})"
            for i, c in enumerate(cells[:check_at])
            if c.cell_type == "code"
            for shown in printed_sources(c.source)
            if name in shown.split(".")
        ]
    assert leaks == []
