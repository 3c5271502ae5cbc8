"""Collect and grade: every exercise of every submitted notebook run against the course's checks, one table out.

A submission is a student's copy of a lab (`submissions/<student>/<NN_lab>.ipynb`; the folder names the student).
For each exercise of that lab — a reference cell with a marked solution, its number from the "Exercise NN.K"
heading above it, its check from the `checks.check_...` call after it — the grader takes the student's last cell
that defines the exercise's function, runs it in a `Sandbox` (a child process with a time limit and no network),
and calls the check here, in the grader, on a proxy of the student's function. The student's code never runs in the
process that decides: a cell that redefines a check, loops, crashes or returns something strange is graded on what
its function computed, or reported as what happened. The notes name cells that touch the checks and exercise cells
that call labkit's own answer. The child runs as the grader's user: grade untrusted work as a throwaway user.
"""

from __future__ import annotations

import ast
import contextlib
import csv
import functools
import html
import io
import re
from dataclasses import dataclass
from pathlib import Path

from labcourse import sandbox
from labcourse.execute import read_notebook
from labcourse.student import BEGIN
from labkit import assets, fileio

HEADING = re.compile(r"^(?:#+ *|\*\*)Exercise (\d\d\.\d+)", re.MULTILINE)  # a heading, or a bold lead-in
KEPT = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
CHECK_CALL = re.compile(r"\bchecks\.(check_\w+)\(")
NO_NAMESPACE = (
    "Warning: this kernel refused a network namespace (unshare -rn): the students' code ran with Python's sockets "
    "refused, which code that knows how can get around. Grade on a machine that allows it, or offline."
)
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
    """A reference lab's exercises, in order: each cell with a marked solution, the number of the "Exercise NN.K"
    heading above it (NN: the lab's own, each number once), the function it defines and the check the next code
    cell calls."""
    cells, lab_number = read_notebook(lab).cells, Path(lab).name[:2]
    found, number = [], None
    for index, cell in enumerate(cells):
        if cell.cell_type == "markdown" and (match := HEADING.search(cell.source)):
            number = match.group(1)
        if cell.cell_type != "code" or BEGIN not in cell.source:
            continue
        functions = [n.name for n in ast.parse(cell.source).body if isinstance(n, ast.FunctionDef)]
        later = next((c.source for c in cells[index + 1 :] if c.cell_type == "code"), "")
        checks = CHECK_CALL.findall(later)
        if number is None or len(functions) != 1 or len(checks) != 1 or not number.startswith(lab_number + "."):
            raise ValueError(
                f"{Path(lab).name}, cell {index}: an exercise cell needs an 'Exercise {lab_number}.K' heading above "
                f"it, one function and one checks.check_... call in the next code cell (found {number}, {functions}, "
                f"{checks})"
            )
        if number in {e.number for e in found}:
            raise ValueError(f"{Path(lab).name}, cell {index}: a second exercise numbered {number}")
        found.append(Exercise(number, functions[0], checks[0]))
        number = None  # the next exercise needs a heading of its own
    return found


def without_magics(source: str) -> str:
    """A cell's Python: IPython's line magics and shell lines (% and !) left out, cell magics (%%) too."""
    if source.lstrip().startswith("%%"):
        source = source.split("\n", 1)[1] if "\n" in source else ""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def student_cell(cells: list, function: str) -> str | None:
    """The Python of the submission's last code cell that defines `function` at its top level, or None. A cell
    that does not parse counts if a line opens the definition (its define then reports the syntax error)."""
    opens = re.compile(rf"^(?:async\s+)?def\s+{re.escape(function)}\s*\(", re.MULTILINE)
    found = None
    for cell in (c for c in cells if c.cell_type == "code"):
        source = without_magics(cell.source)
        try:
            body = ast.parse(source).body
        except SyntaxError:
            found = source if opens.search(source) else found
            continue
        if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function for n in body):
            found = source
    return found


def definitions(source: str) -> str | None:
    """Only the imports, functions and classes of a cell (its top-level statements left out), or None if that is
    the whole cell or it does not parse: a second try for a cell whose test lines need the notebook's state."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    kept = [n for n in tree.body if isinstance(n, KEPT)]
    return None if len(kept) == len(tree.body) else "\n\n".join(ast.get_source_segment(source, n) for n in kept)


def lab_imports(lab: str | Path) -> list[str]:
    """The import statements of a reference lab (the course's own package left out), each once, in order: the
    names an exercise cell may use without importing them, as in the notebook."""
    statements: list[str] = []
    for cell in read_notebook(lab).cells:
        if cell.cell_type != "code":
            continue
        try:
            body = ast.parse(without_magics(cell.source)).body
        except SyntaxError:
            continue
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) and "labcourse" not in ast.unparse(node):
                if (text := ast.unparse(node)) not in statements:
                    statements.append(text)
    return statements


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
    """The sandbox a student's cells run in: one child for all of a student's notebooks (a lab's imports run once),
    a new one after a child that timed out or crashed (the next exercise starts clean), closed at the end."""

    def __init__(self, timeout: float) -> None:
        self.timeout, self.box, self.imports = timeout, None, None

    def get(self, imports: list[str]) -> sandbox.Sandbox:
        if self.box is None or not self.box.alive:
            self.box, self.imports = sandbox.Sandbox(self.timeout), None
        if self.imports != imports:
            self.box.prelude(imports)
            self.imports = imports
        return self.box

    def close(self) -> None:
        if self.box is not None:
            self.box.close()


def grade_submission(
    path: str | Path, labs: str | Path, boxes: Boxes, cells: list | None = None
) -> tuple[list[Grade], list[str]]:
    """Every exercise of one submission graded in `boxes`, and the notes on it: cells that touch the checks, and
    exercise cells that call labkit's own answer. `cells`: the submission's, if already read."""
    from labcourse import checks

    path = Path(path)
    student, (lab_exercises, imports) = path.parent.name, _plan(_reference(path, labs))
    cells = read_notebook(path).cells if cells is None else cells
    grades, notes = [], tampering(cells)
    for exercise in lab_exercises:
        source = student_cell(cells, exercise.function)
        check = getattr(checks, exercise.check)
        if source is None:
            status, message = "missing", f"no cell defines {exercise.function}()"
        else:
            status, message = _run_check(boxes, imports, source, exercise, check.__wrapped__)  # without the fallback
            if answer := _calls_the_answer(source, check.shown_as):
                notes.append(f"exercise {exercise.number} uses labkit's {answer}, the answer itself")
        grades.append(Grade(student, path.name[:2], exercise.number, status, message))
    return grades, notes


@functools.cache
def _plan(reference: Path) -> tuple[list[Exercise], list[str]]:
    """A reference lab's exercises and imports, read once per process however many students hand it in."""
    return exercises(reference), lab_imports(reference)


def _calls_the_answer(source: str, shown_as: str) -> str | None:
    """The name of labkit's answer ('bench.time_fn', 'ring.ring_step') if the cell uses it, qualified by its module
    or imported from labkit by name; else None (a student's own function may share the name)."""
    *modules, name = re.match(r"[\w.]+", shown_as).group(0).split(".")
    qualified = f"{modules[-1]}.{name}" if modules else name
    imported = re.search(rf"^\s*from labkit[\w.]* import .*\b{re.escape(name)}\b", source, re.MULTILINE)
    return qualified if re.search(rf"\b{re.escape(qualified)}\b", source) or imported else None


def _reference(path: Path, labs: str | Path) -> Path:
    """The reference lab a submission is a copy of, by the two digits its name starts with."""
    lab = path.name[:2]
    references = sorted(Path(labs).glob(f"{lab}_*.ipynb")) if lab.isdigit() else []
    if len(references) != 1:
        found = f"{len(references)} labs {lab}_*.ipynb in {labs}" if lab.isdigit() else f"{path.name!r}"
        raise ValueError(f"{path}: name it after its lab (NN_name.ipynb, as labs/ has them); found {found}")
    return references[0]


def _run_check(boxes: Boxes, imports: list[str], source: str, exercise: Exercise, check) -> tuple[str, str]:
    """(status, message) of one exercise: its cell defined in the child (its definitions alone if the whole cell
    fails), the check run here on the proxy. Whatever goes wrong is this exercise's outcome, never the run's."""
    from labcourse.checks.core import CheckFailed, NotWritten

    try:
        box = boxes.get(imports)
        box.limit(boxes.timeout)  # the exercise's budget: every call of its check together
        try:
            box.define(source)
        except sandbox.StudentError:
            if (fallback := definitions(source)) is None:
                raise
            box.define(fallback)
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
    except Exception as err:  # noqa: BLE001 (a check tripped over a strange answer: that answer's outcome)
        return "error", f"the check could not use the answer: {type(err).__name__}: {err}"


def grade(submissions: list[str | Path], labs: str | Path, out: str | Path, timeout: float = 60.0) -> list[Grade]:
    """Grade every notebook given (or found one folder down in a folder given) and write `out`/grades.csv and
    `out`/grades.html: one row per student, one column per exercise, the check's message with each result. Every
    submission is read and matched to its lab before the first is graded."""
    paths = _submissions(submissions)
    if problem := assets.output_path_problem(out, directory=True):
        raise ValueError(f"out: {problem}")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    seen: dict[tuple[str, str], Path] = {}
    read = {}
    for path in paths:
        _reference(path, labs)
        read[path] = read_notebook(path).cells
        if (key := (path.parent.name, path.name[:2])) in seen:
            raise ValueError(f"{path} and {seen[key]}: two copies of lab {key[1]} from {key[0]}; keep one")
        seen[key] = path
    grades, notes = [], {}
    for student in sorted({p.parent.name for p in paths}):
        boxes = Boxes(timeout)
        try:
            for path in (p for p in paths if p.parent.name == student):
                found, said = grade_submission(path, labs, boxes, read[path])
                grades += found
                notes.setdefault(student, []).extend(f"{path.name}: {t}" for t in said)
        finally:
            boxes.close()
    Path(out).mkdir(parents=True, exist_ok=True)
    isolated = bool(sandbox.network_isolation())
    fileio.atomic_write_text(Path(out) / "grades.csv", table_csv(grades, notes))
    fileio.atomic_write_text(Path(out) / "grades.html", table_html(grades, notes, isolated))
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
        cells = [x for g in row for x in ((g.status, g.message[:1000]) if g else ("not submitted", ""))]
        writer.writerow([s, passed, *cells, "; ".join(notes.get(s, []))])
    return buffer.getvalue()


def table_html(grades: list[Grade], notes: dict[str, list[str]], isolated: bool = True) -> str:
    """The same table as a page an instructor opens: a colour per status, the message under it, everything escaped;
    a warning on top where the children ran without a network namespace of their own."""
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
        + ("" if isolated else f"<p><b>{html.escape(NO_NAMESPACE)}</b></p>\n")
        + "<style>td,th{border:1px solid #999;padding:4px;vertical-align:top;font-family:sans-serif}</style>\n"
        f"<table><tr><th>student</th>{head}<th>notes</th></tr>\n" + "\n".join(rows) + "\n</table>\n"
    )
