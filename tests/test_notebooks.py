"""The committed labs, each one clean run: `labcourse.execute.problems` finds nothing in any lab, so every lab was
written by `make execute` (counts from 1, no widgets, the machine it ran on recorded). A lab added, or saved from
Jupyter by hand, fails here with what is wrong; `make execute EXECUTE_ARGS="--profile cpu labs/NN_….ipynb"` mends it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

from labcourse import execute

LABS = sorted((Path(__file__).resolve().parents[1] / "labs").glob("[0-9][0-9]_*.ipynb"))


def test_the_labs_are_found():
    assert len(LABS) >= 11, LABS  # an empty glob would parametrize no test at all


@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_a_committed_lab_is_one_clean_run(path):
    nb = nbformat.read(str(path), as_version=4)
    assert execute.problems(nb) == []


# A speed depends on the machine and its load: the labs report it (expected.check's `speed` ranges are reported,
# never failed) and never assert it. A fresh clone's CI once failed on `assert 0.3 < efficiency` in lab 04.
SPEED = re.compile(r"per_s|seconds|efficiency|speed|throughput|latency|elapsed|\bstep\.(median|min|max)\b")


def speed_asserts(source: str) -> list[str]:
    """The assert statements of a code cell that name a timing or a throughput (IPython magics skipped)."""
    code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    asserts = [ast.unparse(n) for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Assert)]
    return [a for a in asserts if SPEED.search(a)]


def test_speed_asserts_finds_a_timing_and_passes_a_quality_check():
    assert speed_asserts("x = 1\nassert 0.3 < efficiency < 1.2, efficiency") == [
        "assert 0.3 < efficiency < 1.2, efficiency"
    ]
    assert speed_asserts('assert all(r["tokens_per_s"] > demand for r in rows)') != []
    assert speed_asserts("%matplotlib inline\nassert loss < 3.0\nassert ppl.perplexity < 25") == []


@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_a_lab_asserts_no_speed(path):
    nb = nbformat.read(str(path), as_version=4)
    found = [(i, a) for i, c in enumerate(nb.cells) if c.cell_type == "code" for a in speed_asserts(c.source)]
    assert found == [], f"{path.name} asserts a speed (report it with expected.check's speed ranges instead): {found}"


PROGRESS = re.compile(r"^[^|]*\d+%\|.*\|")  # a tqdm bar: "train: 100%|██████████| 40/40 [...]"


def library_noise(outputs: list[dict]) -> list[str]:
    """The stderr lines of a cell's outputs that are not progress bars: a library talking to the student."""
    lines = [
        line
        for out in outputs
        if out.get("output_type") == "stream" and out.get("name") == "stderr"
        for line in re.split(r"[\r\n]+", out.get("text", ""))
    ]
    return [line for line in lines if line.strip() and not PROGRESS.match(line)]


def test_library_noise_finds_a_warning_and_passes_progress_bars():
    bar = "train: 100%|██████████| 40/40 [01:15<00:00,  1.90s/it, loss=7.384]\r"
    warning = "[transformers] `use_cache=True` is incompatible with gradient checkpointing."
    assert library_noise([{"output_type": "stream", "name": "stderr", "text": bar + "\n"}]) == []
    assert library_noise([{"output_type": "stream", "name": "stderr", "text": f"{bar}\n{warning}\n"}]) == [warning]
    assert library_noise([{"output_type": "stream", "name": "stdout", "text": warning}]) == []


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_a_committed_run_has_no_library_noise(path):
    """Warnings that are not the student's business are silenced where they arise (labkit, the Makefile), so a
    clean run shows on stderr only progress bars."""
    nb = nbformat.read(str(path), as_version=4)
    noise = {i: library_noise(c.get("outputs", [])) for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    assert not {i: lines for i, lines in noise.items() if lines}, f"{path.name}: stderr lines by cell index"
