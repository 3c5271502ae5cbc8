"""Collect and grade: every exercise of every submitted notebook run against the course's checks, one table out.

A submission is a student's copy of a lab (`submissions/<student>/<NN_lab>.ipynb`; the folder names the student).
For each exercise of that lab — a reference cell with a marked solution, its number from the "Exercise NN.K"
heading above it, its check from the `checks.check_...` call after it — the grader takes the student's last cell
that defines the exercise's function, runs it in a `Sandbox` (a child process with a time limit and no network),
and calls the check here, in the grader, on a proxy of the student's function. The student's code never runs in the
process that decides: a cell that redefines a check, loops, crashes or returns something strange is graded on what
its function computed, or reported as what happened. Cells that touch the checks are named in the table's notes.
"""

from __future__ import annotations

import ast
import contextlib
import csv
import html
import io
import re
from dataclasses import dataclass
from pathlib import Path

from labcourse import sandbox
from labcourse.execute import read_notebook
from labcourse.student import BEGIN
from labkit import assets, fileio

STATUSES = ("passed", "failed", "not written", "missing", "error", "timed out", "crashed")
EXERCISE = re.compile(r"Exercise (\d\d\.\d+)")
CHECK_CALL = re.compile(r"\bchecks\.(check_\w+)\(")
# what a cell that tampers with the grading would hold: an assignment to the checks, their internals, the modules
TAMPER = re.compile(r"checks\.\w+\s*=(?!=)|labcourse\.checks|CheckFailed\s*=(?!=)|__wrapped__|sys\.modules")


@dataclass(frozen=True)
class Exercise:
    """One exercise of a lab: its number ('00.1'), the function the student writes, the check that grades it."""

    number: str
    function: str
    check: str


@dataclass(frozen=True)
class Grade:
    """One student's result on one exercise."""

    student: str
    lab: str
    exercise: str
    status: str
    message: str


def exercises(lab: str | Path) -> list[Exercise]:
    """A reference lab's exercises, in order: each cell with a marked solution, the number of the heading above it,
    the function it defines and the check the next code cell calls."""
    cells = read_notebook(lab).cells
    found, number = [], None
    for index, cell in enumerate(cells):
        if cell.cell_type == "markdown" and (match := EXERCISE.search(cell.source)):
            number = match.group(1)
        if cell.cell_type != "code" or BEGIN not in cell.source:
            continue
        functions = [n.name for n in ast.parse(cell.source).body if isinstance(n, ast.FunctionDef)]
        later = next((c.source for c in cells[index + 1 :] if c.cell_type == "code"), "")
        checks = CHECK_CALL.findall(later)
        if number is None or len(functions) != 1 or len(checks) != 1:
            raise ValueError(
                f"{Path(lab).name}, cell {index}: an exercise cell needs an 'Exercise NN.K' heading above it, one "
                f"function and one checks.check_... call in the next code cell (found {functions}, {checks})"
            )
        found.append(Exercise(number, functions[0], checks[0]))
    return found


def student_cell(cells: list, function: str) -> str | None:
    """The source of the submission's last code cell that defines `function` at its top level, or None."""
    defines = re.compile(rf"^(?:async\s+)?def\s+{re.escape(function)}\s*\(", re.MULTILINE)
    sources = [c.source for c in cells if c.cell_type == "code" and defines.search(c.source)]
    return sources[-1] if sources else None


def tampering(cells: list) -> list[str]:
    """Where a submission touches the checks or the modules that hold them: 'cell N: the line'."""
    return [
        f"cell {i}: {line.strip()[:80]}"
        for i, cell in enumerate(cells)
        if cell.cell_type == "code"
        for line in cell.source.splitlines()
        if TAMPER.search(line)
    ]


class Boxes:
    """The sandbox a student's cells run in: one child for all of a student's notebooks, a new one after a child
    that timed out or crashed (the next exercise starts clean), closed at the end."""

    def __init__(self, timeout: float) -> None:
        self.timeout, self.box = timeout, None

    def get(self) -> sandbox.Sandbox:
        if self.box is None or not self.box.alive:
            self.box = sandbox.Sandbox(self.timeout)
        return self.box

    def close(self) -> None:
        if self.box is not None:
            self.box.close()


def grade_submission(path: str | Path, labs: str | Path, boxes: Boxes) -> tuple[list[Grade], list[str]]:
    """Every exercise of one submission graded in `boxes`, and the cells that touch the checks."""
    from labcourse import checks

    path = Path(path)
    student, lab = path.parent.name, path.name[:2]
    references = sorted(Path(labs).glob(f"{lab}_*.ipynb"))
    if not lab.isdigit() or len(references) != 1:
        raise ValueError(f"{path}: name it after its lab (NN_name.ipynb, as labs/ has them), got {path.name!r}")
    cells = read_notebook(path).cells
    grades = []
    for exercise in exercises(references[0]):
        source = student_cell(cells, exercise.function)
        if source is None:
            status, message = "missing", f"no cell defines {exercise.function}()"
        else:
            check = getattr(checks, exercise.check).__wrapped__  # the check itself, without the lab's fallback
            status, message = _run_check(boxes.get(), source, exercise, check)
        grades.append(Grade(student, lab, exercise.number, status, message))
    return grades, tampering(cells)


def _run_check(box: sandbox.Sandbox, source: str, exercise: Exercise, check) -> tuple[str, str]:
    """(status, message) of one exercise: its cell defined in the child, the check run here on the proxy."""
    from labcourse.checks.core import CheckFailed, NotWritten

    try:
        box.define(source)
        with contextlib.redirect_stdout(io.StringIO()):  # a check prints its pass line: the table holds it
            return "passed", str(check(box.function(exercise.function)))
    except NotWritten as err:
        return "not written", str(err)
    except CheckFailed as err:
        return "failed", str(err)
    except sandbox.TimedOut as err:
        return "timed out", str(err)
    except sandbox.Crashed as err:
        return "crashed", str(err)
    except (sandbox.StudentError, sandbox.SandboxError, NotImplementedError) as err:
        return "error", str(err)


def grade(submissions: list[str | Path], labs: str | Path, out: str | Path, timeout: float = 60.0) -> list[Grade]:
    """Grade every notebook given (or found one folder down in a folder given) and write `out`/grades.csv and
    `out`/grades.html: one row per student, one column per exercise, the check's message with each result."""
    paths = _submissions(submissions)
    if problem := assets.output_path_problem(out, directory=True):
        raise ValueError(f"out: {problem}")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    grades, notes = [], {}
    for student in sorted({p.parent.name for p in paths}):
        boxes = Boxes(timeout)
        try:
            for path in (p for p in paths if p.parent.name == student):
                found, touched = grade_submission(path, labs, boxes)
                grades += found
                notes.setdefault(student, []).extend(f"{path.name} {t}" for t in touched)
        finally:
            boxes.close()
    Path(out).mkdir(parents=True, exist_ok=True)
    fileio.atomic_write_text(Path(out) / "grades.csv", table_csv(grades, notes))
    fileio.atomic_write_text(Path(out) / "grades.html", table_html(grades, notes))
    return grades


def _submissions(given: list[str | Path]) -> list[Path]:
    """The notebooks named, and those in each folder named (`submissions/<student>/*.ipynb`), checked to exist."""
    if not given:
        raise ValueError("no submissions given: name notebooks, or a folder of students' folders")
    paths = []
    for item in map(Path, given):
        if item.is_dir():
            paths += sorted(p for p in item.glob("*/*.ipynb") if ".ipynb_checkpoints" not in p.parts)
        elif item.suffix == ".ipynb" and item.is_file():
            paths.append(item)
        else:
            raise FileNotFoundError(f"{item}: not a notebook nor a folder of students' folders")
    if not paths:
        raise FileNotFoundError(f"no notebooks found in {', '.join(map(str, given))} (expected <student>/NN_*.ipynb)")
    return paths


def _columns(grades: list[Grade]) -> tuple[list[str], list[str], dict[tuple[str, str], Grade]]:
    students = sorted({g.student for g in grades})
    numbers = sorted({g.exercise for g in grades}, key=lambda n: tuple(map(int, n.split("."))))
    return students, numbers, {(g.student, g.exercise): g for g in grades}


def table_csv(grades: list[Grade], notes: dict[str, list[str]]) -> str:
    """Students × exercises: per exercise its status and the check's message; passed count; notes."""
    students, numbers, by = _columns(grades)
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["student", "passed", *(f"{n} {part}" for n in numbers for part in ("status", "message")), "notes"])
    for s in students:
        row = [by.get((s, n)) for n in numbers]
        passed = sum(g is not None and g.status == "passed" for g in row)
        cells = [x for g in row for x in ((g.status, g.message) if g else ("", ""))]
        writer.writerow([s, passed, *cells, "; ".join(notes.get(s, []))])
    return buffer.getvalue()


def table_html(grades: list[Grade], notes: dict[str, list[str]]) -> str:
    """The same table as a page an instructor opens: a colour per status, the message under it, everything escaped."""
    students, numbers, by = _columns(grades)
    colour = {"passed": "#d8f0d8", "failed": "#f6d5d5", "not written": "#eeeeee", "missing": "#eeeeee"}
    head = "".join(f"<th>{html.escape(n)}</th>" for n in numbers)
    rows = []
    for s in students:
        tds = []
        for n in numbers:
            g = by.get((s, n))
            if g is None:
                tds.append("<td></td>")
                continue
            shade = colour.get(g.status, "#fbe3c4")
            tds.append(
                f'<td style="background:{shade}"><b>{html.escape(g.status)}</b>'
                f"<br><small>{html.escape(g.message[:300])}</small></td>"
            )
        note = "<br>".join(html.escape(x) for x in notes.get(s, []))
        rows.append(f"<tr><th>{html.escape(s)}</th>{''.join(tds)}<td><small>{note}</small></td></tr>")
    return (
        "<!doctype html>\n<meta charset=utf-8><title>Grades</title>\n"
        "<style>td,th{border:1px solid #999;padding:4px;vertical-align:top;font-family:sans-serif}</style>\n"
        f"<table><tr><th>student</th>{head}<th>notes</th></tr>\n" + "\n".join(rows) + "\n</table>\n"
    )
