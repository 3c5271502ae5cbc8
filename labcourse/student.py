"""The student build: the lab notebooks with their exercise solutions replaced by stubs (`make student`),
and the working copies `make lab` opens, so that running a lab never modifies a tracked file.

One source: a solution is written once, in the lab notebook, between two marker lines

    # BEGIN SOLUTION
    ...the reference answer...
    # END SOLUTION

and the student build replaces each such region by `raise NotImplementedError(...)` at the same
indentation, drops the cells tagged `solution-only` (reference figures that would give away a
prediction), and clears every output. A student notebook runs from the first cell to the last: each
exercise's check says it is not written yet and the lab goes on with labkit's reference.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import warnings
from pathlib import Path

from labkit import fileio

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
STUB = 'raise NotImplementedError("exercise: write this part, then run the check below")'
HIDDEN = "solution-only"  # a cell tag: left out of the student build
MANIFEST = ".labkit-workspace.json"  # what `workspace` wrote, to tell a student's edits from the course's
RUN_OUTPUTS = {"results", "runs", "logs", ".ipynb_checkpoints"}  # what running the labs writes beside them


def strip_solutions(source: str, where: str = "cell") -> tuple[str, int]:
    """(source with each marked solution replaced by a stub, number of regions replaced)."""
    out, inside, count, indent = [], False, 0, ""
    for number, line in enumerate(source.splitlines(keepends=True), 1):
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise ValueError(f"{where}, line {number}: {BEGIN!r} inside a solution region (missing {END!r})")
            inside, count = True, count + 1
            indent = re.match(r"\s*", line).group(0)
            out.append(f"{indent}{STUB}\n")
        elif marker == END:
            if not inside:
                raise ValueError(f"{where}, line {number}: {END!r} without a {BEGIN!r} before it")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: {BEGIN!r} is never closed by {END!r}")
    return "".join(out), count


def student_notebook(path: str | Path, keep_outputs: bool = False) -> tuple[dict, int]:
    """A lab notebook as students get it: solutions stubbed, `solution-only` cells dropped, outputs and
    execution counts cleared (kept with keep_outputs, for the suite's nbval run of the student build)."""
    from labcourse.execute import read_notebook  # a malformed lab: ValueError naming the file and what is wrong

    nb = read_notebook(path)
    total, cells = 0, []
    for index, cell in enumerate(nb.cells):
        if HIDDEN in cell.metadata.get("tags", []):
            continue
        if cell.cell_type == "code":
            cell.source, count = strip_solutions(cell.source, f"{Path(path).name}, cell {index}")
            total += count
            if not keep_outputs:
                cell.outputs, cell.execution_count = [], None
                cell.metadata.pop("execution", None)
        cells.append(cell)
    nb.cells = cells
    if not keep_outputs:
        nb.metadata.pop("widgets", None)
    return nb, total


def _notebooks(labs: str | Path) -> list[Path]:
    notebooks = sorted(Path(labs).glob("*.ipynb"))
    if not notebooks:
        raise FileNotFoundError(f"no notebooks in {labs}")
    return notebooks


def _copy_course_files(labs: str | Path, dest: str | Path) -> None:
    """The course's pages (start page, glossary, reading list) and what labs 04-05 launch under torchrun, beside
    the notebooks, unchanged: their links to each other work in every copy."""
    for page in Path(labs).glob("*.md"):
        fileio.atomic_write_text(Path(dest) / page.name, page.read_text(encoding="utf-8"))
    if (Path(labs) / "scripts").is_dir():
        shutil.copytree(
            Path(labs) / "scripts",
            Path(dest) / "scripts",
            ignore=shutil.ignore_patterns("__pycache__"),
            dirs_exist_ok=True,
        )


def _earlier_build(dest: Path, names: set[str]) -> bool:
    """Whether `dest` is a student build from before labkit marked what it writes (`make test` rewrites
    build/test-labs on every run): nothing but notebooks named in `names` without a solution in them, scripts/,
    and what running them writes (RUN_OUTPUTS). A copy of the labs, solutions and all, is not."""
    entries = list(dest.iterdir())
    return all(p.name in names | {"scripts"} | RUN_OUTPUTS for p in entries) and not any(
        p.suffix == ".ipynb" and BEGIN in p.read_text(errors="replace") for p in entries
    )


def build_student(labs: str | Path, dest: str | Path, keep_outputs: bool = False) -> dict[str, int]:
    """Write the student version of every notebook in `labs` into `dest` (atomically); returns exercises per lab.
    `dest` must be new, empty or an earlier build: never `labs`, a folder holding it, or anyone's other files."""
    import nbformat  # the dev extra's: only the student build needs it

    built = {path.name: student_notebook(path, keep_outputs) for path in _notebooks(labs)}  # all checked first
    with fileio.atomic_directory(dest, source=labs, legacy=lambda d: _earlier_build(d, set(built))) as tmp:
        for name, (nb, _) in built.items():
            nbformat.write(nb, str(Path(tmp) / name))
        _copy_course_files(labs, tmp)
    return {name: count for name, (_, count) in built.items()}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _read_manifest(path: Path) -> dict[str, str]:
    """What `workspace` last wrote (notebook name -> digest), {} if nothing yet. A manifest that is not JSON of
    that shape is a warning naming it and what is wrong, and reads as {}: every existing copy then counts as the
    student's and is kept, so a damaged record can cost an update, never a student's work."""
    if not path.is_file():
        return {}
    try:
        written = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        problem = f"is not JSON ({err})"
    else:
        if isinstance(written, dict) and all(isinstance(v, str) for v in written.values()):
            return written
        problem = "is not an object of notebook names and digests"
    warnings.warn(
        f"{path} {problem}: every existing working copy is kept as yours, and the record is written anew",
        stacklevel=3,
    )
    return {}


def workspace(labs: str | Path, dest: str | Path, solutions: bool = False) -> dict[str, str]:
    """Working copies of the labs in `dest` for JupyterLab: the student build, or the solution notebooks as
    committed (with their outputs). A copy the student has changed is never overwritten; an unchanged copy
    follows the course's notebook. Returns, per lab, what happened to it, in words."""
    import nbformat  # the dev extra's: only the student build needs it

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    manifest_path = dest / MANIFEST
    written = _read_manifest(manifest_path)
    report = {}
    for path in _notebooks(labs):
        text = path.read_text() if solutions else nbformat.writes(student_notebook(path)[0])
        copy, new = dest / path.name, _digest(text)
        current = _digest(copy.read_text()) if copy.exists() else None
        if current is None:
            report[path.name] = "written"
        elif current == new:
            report[path.name] = "up to date"
            written[path.name] = new
            continue
        elif current == written.get(path.name):  # the course changed, the student did not
            report[path.name] = "updated to the course's new version"
        else:
            report[path.name] = "kept as you left it" + (
                f" (the course's version differs: rename yours, e.g. to {path.stem}.mine.ipynb, to get it)"
                if written.get(path.name) != new
                else ""
            )
            continue
        fileio.atomic_write_text(copy, text)
        written[path.name] = new
    _copy_course_files(labs, dest)
    fileio.atomic_write_text(manifest_path, json.dumps(written, indent=1, sort_keys=True))
    return report
