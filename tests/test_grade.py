"""Collect and grade, on planted submissions: the reference labs pass every exercise and the student build none;
a wrong answer fails with the check's hint; a crash, a loop, a redefined check, a cell that reaches for the network
are reported for what they are, and the exercises after them are still graded; the table says it all, escaped."""

import csv
import io
import shutil
from pathlib import Path

import nbformat
import pytest

from labcourse import grade
from labcourse.cli import main
from labcourse.student import student_notebook

LABS = Path(__file__).resolve().parents[1] / "labs"
LAB00 = LABS / "00_gpu_setup.ipynb"
RIGHT = """import statistics


def median_time(work, sync, clock, warmup, repeats):
    for _ in range(warmup):
        work()
    times = []
    for _ in range(repeats):
        sync()
        start = clock()
        work()
        sync()
        times.append(clock() - start)
    return statistics.median(times)
"""
MEAN = RIGHT.replace("return statistics.median(times)", "return sum(times) / len(times)")
PLANTED = {  # student -> the cell that replaces their exercise 00.1 (exercise 00.2 keeps the reference)
    "right": RIGHT,
    "wrong": MEAN,
    "crashing": "def median_time(work, sync, clock, warmup, repeats):\n    import os\n    os._exit(1)\n",
    "looping": "def median_time(work, sync, clock, warmup, repeats):\n    while True:\n        pass\n",
    "tampering": "from labcourse import checks\nchecks.check_median_time = lambda fn: fn\n" + MEAN,
    "networked": "import urllib.request\n\n\ndef median_time(work, sync, clock, warmup, repeats):\n"
    "    return urllib.request.urlopen('http://example.com', timeout=2).read()\n",
    "nan": "def median_time(work, sync, clock, warmup, repeats):\n    [work() for _ in range(warmup + repeats)]\n"
    "    return float('nan')\n",
    # the lab's own imports are there (bench), and a test line needing the notebook's state does not sink the cell
    "delegating": "def median_time(work, sync, clock, warmup, repeats):\n"
    "    return bench.time_fn(work, warmup=warmup, repeats=repeats, clock=clock, sync=sync).median\n\n\n"
    "%time x = 1\nprint(median_time(lambda: a @ a, sync, time.perf_counter, 2, 7))\n",
}


def submission(folder: Path, student: str, exercise_cell: str | None) -> Path:
    """Lab 00 as a student might hand it in: the reference, with exercise 00.1's cell replaced (or removed)."""
    nb = nbformat.read(str(LAB00), as_version=4)
    index = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "def median_time(" in c.source)
    if exercise_cell is None:
        del nb.cells[index]
    else:
        nb.cells[index].source = exercise_cell
    path = folder / student / LAB00.name
    path.parent.mkdir(parents=True)
    nbformat.write(nb, str(path))
    return path


def statuses(grades: list[grade.Grade]) -> dict[tuple[str, str], str]:
    return {(g.student, g.exercise): g.status for g in grades}


def test_exercises_are_read_from_the_reference_labs():
    found = {path.name[:2]: grade.exercises(path) for path in sorted(LABS.glob("[0-9][0-9]_*.ipynb"))}
    assert sum(map(len, found.values())) == 22
    assert found["00"] == [
        grade.Exercise("00.1", "median_time", "check_median_time"),
        grade.Exercise("00.2", "windows", "check_windows"),
    ]
    assert all(e.number.startswith(lab + ".") for lab, listed in found.items() for e in listed)


def test_the_reference_passes_every_exercise_and_the_student_build_none(tmp_path):
    for path in sorted(LABS.glob("[0-9][0-9]_*.ipynb")):
        (tmp_path / "reference").mkdir(exist_ok=True)
        shutil.copy(path, tmp_path / "reference" / path.name)
        nb, _ = student_notebook(path)
        (tmp_path / "newcomer").mkdir(exist_ok=True)
        nbformat.write(nb, str(tmp_path / "newcomer" / path.name))
    grades = grade.grade([tmp_path], LABS, tmp_path / "out", timeout=60)
    reference = [g for g in grades if g.student == "reference"]
    assert len(reference) == 22 and [g for g in reference if g.status != "passed"] == []
    assert {g.status for g in grades if g.student == "newcomer"} == {"not written"}


def test_planted_submissions_are_graded_for_what_they_do(tmp_path):
    for student, cell in PLANTED.items():
        submission(tmp_path / "in", student, cell)
    submission(tmp_path / "in", "forgetful", None)
    grades = grade.grade([tmp_path / "in"], LABS, tmp_path / "out", timeout=5)
    got = statuses(grades)
    assert {s: got[(s, "00.1")] for s in [*PLANTED, "forgetful"]} == {
        "right": "passed",
        "wrong": "failed",
        "crashing": "crashed",
        "looping": "timed out",
        "tampering": "failed",  # its own copy of the check changed; the grader's did not
        "networked": "error",
        "nan": "failed",
        "delegating": "passed",
        "forgetful": "missing",
    }
    assert all(got[(s, "00.2")] == "passed" for s in [*PLANTED, "forgetful"])  # graded after a crash or a loop too
    message = {g.student: g.message for g in grades if g.exercise == "00.1"}
    assert "report the median, not the mean" in message["wrong"]
    assert "no answer within 5 s" in message["looping"]
    assert "no network while grading" in message["networked"] or "URLError" in message["networked"]

    rows = {r["student"]: r for r in csv.DictReader(io.StringIO((tmp_path / "out" / "grades.csv").read_text()))}
    assert rows["right"]["passed"] == "2" and rows["wrong"]["passed"] == "1"
    assert rows["wrong"]["00.1 status"] == "failed" and "median" in rows["wrong"]["00.1 message"]
    assert "checks.check_median_time = lambda fn: fn" in rows["tampering"]["notes"]
    assert rows["right"]["notes"] == ""
    assert "exercise 00.1 uses labkit's bench.time_fn, the answer itself" in rows["delegating"]["notes"]
    page = (tmp_path / "out" / "grades.html").read_text()
    assert "<th>tampering</th>" in page and "timed out" in page and "lambda fn: fn" in page


def test_every_submission_is_checked_before_the_first_is_graded(tmp_path):
    submission(tmp_path / "in", "ann", RIGHT)
    copy = tmp_path / "in" / "ann" / "00_gpu_setup-Copy1.ipynb"
    shutil.copy(LAB00, copy)
    with pytest.raises(ValueError, match="two copies of lab 00 from ann; keep one"):
        grade.grade([tmp_path / "in"], LABS, tmp_path / "out")
    copy.unlink()
    broken = tmp_path / "in" / "zoe" / LAB00.name
    broken.parent.mkdir()
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="is not a notebook"):  # zoe sorts last: ann is not graded first
        grade.grade([tmp_path / "in"], LABS, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_cell_s_definitions_are_its_second_try():
    cell = "import statistics\n\n\ndef f(x):\n    return x\n\n\nprint(f(model))\nclass K:\n    pass\n"
    assert grade.definitions(cell) == "import statistics\n\ndef f(x):\n    return x\n\nclass K:\n    pass"
    assert grade.definitions("def f(x):\n    return x\n") is None  # nothing to leave out
    assert grade.without_magics("%%time\nx = 1\n!ls\n%matplotlib inline\ny = 2") == "x = 1\n\n\ny = 2"
    cells = [nbformat.v4.new_code_cell(s) for s in ('"""def f(x): in a string"""', "def f(x):\n    return 1", "y = 2")]
    assert grade.student_cell(cells, "f") == "def f(x):\n    return 1"
    assert grade.student_cell(cells[:1], "f") is None  # only in a string


def test_the_page_escapes_what_students_wrote(tmp_path):
    odd = "<script>alert(1)</script>"
    grades = [grade.Grade(odd, "00", "00.1", "failed", f"got {odd}")]
    page = grade.table_html(grades, {odd: [odd]})
    assert "<script>" not in page and "&lt;script&gt;" in page


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a notebook nor a folder"):
        grade.grade([tmp_path / "nowhere"], LABS, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="no notebooks found"):
        grade.grade([tmp_path], LABS, tmp_path / "out")
    stray = tmp_path / "in" / "ann" / "my_lab.ipynb"
    stray.parent.mkdir(parents=True)
    shutil.copy(LAB00, stray)
    with pytest.raises(ValueError, match="name it after its lab"):
        grade.grade([tmp_path / "in"], LABS, tmp_path / "out")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="out: .* exists and is not a directory"):
        grade.grade([tmp_path / "in"], LABS, tmp_path / "file")
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        grade.grade([tmp_path / "in"], LABS, tmp_path / "out", timeout=-1)
    assert not (tmp_path / "out").exists()


def test_the_command_writes_the_table_and_sums_up(tmp_path, capsys):
    submission(tmp_path / "in", "right", RIGHT)
    assert main(["grade", str(tmp_path / "in"), "--output", str(tmp_path / "out")]) == 0
    assert "right: 2 of 2 exercises passed" in capsys.readouterr().out
    assert (tmp_path / "out" / "grades.csv").is_file() and (tmp_path / "out" / "grades.html").is_file()
