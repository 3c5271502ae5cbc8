"""The core path and the deep dives: the marker, the switch in a real IPython shell, the core time of an executed
lab, and every lab's structure (deep dives under their headings, no core cell reading what only a deep dive made,
the committed cpu run's core within the ten-minute budget)."""

from __future__ import annotations

import ast
import builtins
import json
import re
from pathlib import Path

import pytest

from labcourse import core, expected, figures

LABS = sorted((Path(__file__).resolve().parents[1] / "labs").glob("[0-9][0-9]_*.ipynb"))
HEADING = re.compile(r"^#{1,6} (.+)$", re.MULTILINE)


def test_the_marker_is_the_first_non_blank_line():
    assert core.is_deep_dive("\n# Deep dive: the 3-bit table\nx = 1")
    assert not core.is_deep_dive("x = 1\n# Deep dive: too late")
    assert not core.is_deep_dive("# deep dive in lower case is an ordinary comment\nx = 1")
    assert not core.is_deep_dive("")
    assert core.what("# Deep dive: the 3-bit table\nx = 1") == "the 3-bit table"
    assert core.what("# Deep dive\nx = 1") == "a deep dive"


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("YES", True), ("0", False), ("", False)])
def test_the_switch_reads_the_environment(monkeypatch, value, on):
    monkeypatch.setenv(core.ENV_VAR, value)
    assert core.core_only() is on


def test_the_transformer_replaces_deep_dives_only_when_the_core_runs_alone(monkeypatch):
    cell = ["# Deep dive: a slow scan\n", "x = 1\n"]
    monkeypatch.setenv(core.ENV_VAR, "1")
    assert core.skip_deep_dives(cell) == [
        "print('deep dive skipped (LABCOURSE_CORE=1, the core path alone): a slow scan')\n"
    ]
    assert core.skip_deep_dives(["x = 1\n"]) == ["x = 1\n"]
    monkeypatch.setenv(core.ENV_VAR, "0")
    assert core.skip_deep_dives(cell) == cell


def test_follow_makes_a_real_shell_skip_deep_dives_and_can_be_flipped(monkeypatch, capsys):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        monkeypatch.setenv(core.ENV_VAR, "1")
        core.follow()
        core.follow()  # twice: installed once
        assert shell.input_transformers_post.count(core.skip_deep_dives) == 1
        assert "the core path alone" in capsys.readouterr().out
        shell.run_cell("# Deep dive: sets a\na = 1\n")
        shell.run_cell("b = 2\n")
        assert "a" not in shell.user_ns and shell.user_ns["b"] == 2
        assert "deep dive skipped" in capsys.readouterr().out
        monkeypatch.setenv(core.ENV_VAR, "0")  # read at every cell
        shell.run_cell("# Deep dive: sets a\na = 1\n")
        assert shell.user_ns["a"] == 1
    finally:
        InteractiveShell.clear_instance()


def _timed(source: str, start: str, end: str) -> dict:
    timing = {"iopub.execute_input": start, "shell.execute_reply": end}
    return {"cell_type": "code", "source": source, "metadata": {"execution": timing}}


def test_split_seconds_adds_the_recorded_times_per_side():
    cells = [
        {"cell_type": "markdown", "source": "# Lab"},
        _timed("x = 1", "2026-01-01T00:00:00.000000Z", "2026-01-01T00:00:01.500000Z"),
        _timed("# Deep dive: slow\ny = 2", "2026-01-01T00:00:02Z", "2026-01-01T00:01:02Z"),
        _timed("z = 3", "2026-01-01T00:01:02Z", "2026-01-01T00:01:04.250000Z"),
    ]
    assert core.split_seconds(cells) == (3.75, 60.0)
    with pytest.raises(ValueError, match="cell 1 has no recorded run time"):
        core.split_seconds([cells[0], {"cell_type": "code", "source": "x", "metadata": {}}])


def test_expected_check_lists_a_deep_dive_figure_as_skipped_only_on_the_core_path(monkeypatch, capsys):
    table = expected.EXPECTED["06"]["smoke"]
    skipped = "perplexity, 20 % of MLP channels by activation"
    measured = {k: (v.low + v.high) / 2 for k, v in table.items() if k != skipped}
    monkeypatch.setenv(core.ENV_VAR, "0")
    with pytest.raises(expected.ExpectationFailed, match="20 % of MLP channels by activation was never measured"):
        expected.check("06", measured, profile="smoke")
    monkeypatch.setenv(core.ENV_VAR, "1")
    expected.check("06", measured, profile="smoke")
    assert "its deep dive was skipped (LABCOURSE_CORE=1)" in capsys.readouterr().out


def _names(source: str) -> tuple[set[str], set[str]]:
    """(bound, read) names of a cell: every name stored, defined or imported, and every name loaded."""
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    bound, read = set(), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, ast.Store | ast.Del) else read).add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            bound.add(node.name)
            bound |= {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
        elif isinstance(node, ast.Lambda):
            bound |= {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound, read


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.name[:2])
def test_deep_dives_sit_under_their_headings_and_the_core_never_reads_them(path):
    heading, core_bound, deep_only, wrong = "", set(dir(builtins)), set(), []
    for index, cell in enumerate(figures.read_cells(path)):
        if cell["cell_type"] == "markdown":
            heading = (HEADING.findall(cell["source"]) or [heading])[-1]
            continue
        if cell["cell_type"] != "code":
            continue
        deep = core.is_deep_dive(cell["source"])
        if deep != ("Deep dive" in heading):
            wrong.append(f"cell {index} {'is' if deep else 'is not'} marked '# Deep dive' under heading {heading!r}")
        bound, read = _names(cell["source"])
        if deep:
            deep_only |= bound - core_bound
            continue
        leaks = sorted((read - bound - core_bound) & deep_only)
        if leaks:
            wrong.append(f"core cell {index} reads {', '.join(leaks)}, made only in a deep dive above it")
        core_bound |= bound
        deep_only -= bound
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.name[:2])
def test_the_committed_cpu_runs_core_path_fits_the_budget(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    executed = nb["metadata"].get("labkit", {}).get("executed", {})
    if executed.get("profile") != "cpu":
        pytest.skip(f"{path.name} was last executed under {executed.get('profile')!r}, not the cpu profile")
    seconds, _ = core.split_seconds(figures.read_cells(path))
    assert seconds <= core.CORE_BUDGET_S, f"{path.name}: the core path ran {seconds:.0f} s, over {core.CORE_BUDGET_S}"
    if path.name.startswith("07"):  # a GPTQ run loaded from the cache would hide minutes of the core's time
        published, _ = figures.Sources(path.parents[1]).get("lab07")
        assert published["the core path's GPTQ run loaded from the cache"] == 0, "run the core's GPTQ afresh"


def test_figures_publish_a_labs_core_and_deep_dive_seconds_from_its_recorded_cells(tmp_path):
    (tmp_path / "labs").mkdir()
    cells = [
        {"cell_type": "markdown", "metadata": {}, "source": "# Lab 04 — Data parallelism"},
        _timed("x = 1", "2026-01-01T00:00:00Z", "2026-01-01T00:00:30Z"),
        _timed("# Deep dive: more\ny = 2", "2026-01-01T00:00:30Z", "2026-01-01T00:02:00Z"),
        _timed("z = 3", "2026-01-01T00:02:00Z", "2026-01-01T00:02:12Z"),
    ]
    for index, cell in enumerate(cells[1:], 1):
        cell |= {"execution_count": index, "outputs": []}
    executed = {"profile": "cpu", "cpu": "Test CPU", "date": "2026-01-01 00:00 UTC", "seconds": 135.0}
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {"labkit": {"executed": executed}}, "cells": cells}
    (tmp_path / "labs" / "04_data.ipynb").write_text(json.dumps(nb), encoding="utf-8")
    found, _ = figures.Sources(tmp_path).get("lab04")
    assert (found["core seconds"], found["deep-dive seconds"], found["executed seconds"]) == (42.0, 90.0, 135.0)
