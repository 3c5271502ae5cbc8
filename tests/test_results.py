"""labcourse.results: one JSON file per benchmark run, with the machine it ran on, never overwritten; the figures a
lab publishes read back from the saved notebook."""

from __future__ import annotations

import json
import math

import pytest
import torch
from nbformat.v4 import new_code_cell, new_notebook, new_output

from labcourse import results


def test_a_run_is_saved_with_the_machine_and_read_back(tmp_path):
    path = results.save_run("perplexity", {"perplexity": 15.62, "tokens": torch.tensor(412)}, root=tmp_path)
    assert path.parent == tmp_path / "perplexity" and path.suffix == ".json"
    record = json.loads(path.read_text())
    assert record["benchmark"] == "perplexity"
    assert record["figures"] == {"perplexity": 15.62, "tokens": 412}  # a tensor stored as its number
    assert record["machine"]["cpu"] and record["machine"]["packages"]["torch"] == torch.__version__
    assert record["machine"]["profile"] == "smoke"  # the suite's profile (conftest)
    assert results.latest("perplexity", tmp_path) == (path, record)


def test_runs_in_the_same_second_never_overwrite_each_other(tmp_path):
    paths = [results.save_run("speed", {"seconds": s}, root=tmp_path) for s in (1.0, 2.0, 3.0)]
    assert len(set(paths)) == 3
    assert [r["figures"]["seconds"] for _, r in results.runs("speed", tmp_path)] == [1.0, 2.0, 3.0]


def test_non_finite_figures_survive_the_round_trip_as_text(tmp_path):
    path = results.save_run("prune", {"ppl": math.inf, "nan": math.nan, "low": -math.inf}, root=tmp_path)
    stored = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} is not JSON"))["figures"]
    assert stored == {"ppl": "inf", "nan": "nan", "low": "-inf"}
    assert results.number(stored["ppl"]) == math.inf and math.isnan(results.number(stored["nan"]))
    assert results.number("a label") == "a label" and results.number(3) == 3


@pytest.mark.parametrize(
    "name, figures, match",
    [
        ("Bad Name", {"x": 1}, "lower-case"),
        ("../escape", {"x": 1}, "lower-case"),
        ("ok", {}, "non-empty"),
        ("ok", [1, 2], "non-empty"),
        ("ok", {"model": object()}, "cannot store object"),
    ],
)
def test_bad_input_is_refused_and_writes_nothing(tmp_path, name, figures, match):
    with pytest.raises((ValueError, TypeError), match=match):
        results.save_run(name, figures, root=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_reading_names_what_is_missing_or_broken(tmp_path):
    with pytest.raises(FileNotFoundError, match="run benchmarks/perplexity.py"):
        results.latest("perplexity", tmp_path)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "20260101-000000-h.json").write_text('{"figures": ')
    with pytest.raises(ValueError, match="20260101-000000-h.json: not a JSON record"):
        results.runs("broken", tmp_path)
    (tmp_path / "broken" / "20260101-000000-h.json").write_text('{"figures": {}}')
    with pytest.raises(ValueError, match="not a benchmark run"):
        results.runs("broken", tmp_path)


def test_outside_a_kernel_publish_prints_the_text(capsys):
    results.publish("perplexity 18.7", {"figures": {"perplexity": 18.7}})
    assert capsys.readouterr().out == "perplexity 18.7\n"


def test_notebook_figures_reads_every_published_payload_in_order(tmp_path):
    cells = [new_code_cell("a"), new_code_cell("b"), new_code_cell("c")]
    cells[0].outputs = [new_output("display_data", data={"text/plain": "x", results.MIME: {"figures": {"a": 1}}})]
    cells[1].outputs = [new_output("stream", name="stdout", text="no figures here\n")]
    cells[2].outputs = [new_output("display_data", data={"text/plain": "y", results.MIME: {"figures": {"b": 2}}})]
    path = tmp_path / "lab.ipynb"
    path.write_text(json.dumps(new_notebook(cells=cells)))
    assert results.notebook_figures(path) == [{"figures": {"a": 1}}, {"figures": {"b": 2}}]
