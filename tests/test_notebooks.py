"""The committed labs, each one clean run: `labkit.execute.problems` finds nothing in any lab, so every lab was
written by `make execute` (counts from 1, no widgets, the machine it ran on recorded). A lab added, or saved from
Jupyter by hand, fails here with what is wrong; `make execute EXECUTE_ARGS="--profile cpu labs/NN_….ipynb"` mends it."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from labkit import execute

LABS = sorted((Path(__file__).resolve().parents[1] / "labs").glob("[0-9][0-9]_*.ipynb"))


def test_the_labs_are_found():
    assert len(LABS) >= 11, LABS  # an empty glob would parametrize no test at all


@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_a_committed_lab_is_one_clean_run(path):
    nb = nbformat.read(str(path), as_version=4)
    assert execute.problems(nb) == []
