"""The student build: the lab notebooks with their exercise solutions replaced by stubs (`make student`).

One source: a solution is written once, in the lab notebook, between two marker lines

    # BEGIN SOLUTION
    ...the reference answer...
    # END SOLUTION

and the student build replaces each such region by `raise NotImplementedError(...)` at the same
indentation, and clears every output. The solution notebooks are what CI executes; the student
notebooks still run top to bottom up to the first exercise, where the stub raises and the check
after it says which exercise is left.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from labkit import assets

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
STUB = 'raise NotImplementedError("exercise: write this part, then run the check below")'


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


def student_notebook(path: str | Path) -> tuple[dict, int]:
    """A lab notebook as students get it: solutions stubbed, outputs and execution counts cleared."""
    import nbformat  # the dev extra's: only `make student` needs it

    nb = nbformat.read(str(path), as_version=4)
    total = 0
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        cell.source, count = strip_solutions(cell.source, f"{Path(path).name}, cell {index}")
        total += count
        cell.outputs, cell.execution_count = [], None
        cell.metadata.pop("execution", None)
    nb.metadata.pop("widgets", None)
    return nb, total


def build_student(labs: str | Path, dest: str | Path) -> dict[str, int]:
    """Write the student version of every notebook in `labs` into `dest` (atomically); returns exercises per lab."""
    import nbformat  # the dev extra's: only `make student` needs it

    notebooks = sorted(Path(labs).glob("*.ipynb"))
    if not notebooks:
        raise FileNotFoundError(f"no notebooks in {labs}")
    built = {path.name: student_notebook(path) for path in notebooks}  # every notebook checked before writing
    with assets.atomic_directory(dest) as tmp:
        for name, (nb, _) in built.items():
            nbformat.write(nb, str(Path(tmp) / name))
        if (Path(labs) / "scripts").is_dir():  # what labs 04-05 launch under torchrun, unchanged
            shutil.copytree(Path(labs) / "scripts", Path(tmp) / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    return {name: count for name, (_, count) in built.items()}
