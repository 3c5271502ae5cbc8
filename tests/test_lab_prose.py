"""Markdown teaches; it does not report. A figure of this run typed into a lab's markdown (a time, a ratio, a
share, a size) drifts when the machine, the run or the code changes, and the student build ships the reference
machine's numbers to students whose runs differ: such figures are printed by code from the measured values
(labkit.claims). Markdown keeps definitions, reasoning, questions and literature figures with their source.

`run_figures` finds figures with units in markdown that are none of those. Until every lab is converted, each lab
has a budget of such figures that may only shrink: a lab above its budget fails (a typed figure came back or was
added), and a lab below it fails too, until the budget is lowered to the new count."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

LABS = sorted((Path(__file__).resolve().parents[1] / "labs").glob("[0-9][0-9]_*.ipynb"))

NUMBER = r"(?<![\w.])\d+(?:[.,]\d+)*(?:\s?[–-]\s?\d+(?:[.,]\d+)*)?"  # 23.45, 49,152, a range 60–80
UNIT = r"\s?(?:µs|ms|s|min|minutes|h|GiB|MiB|KiB|GB|MB|KB|TB/s|GB/s|tokens/s|TFLOP/s|GFLOP/s|%|x)(?![\w/])"
# a ratio is written against its number (4.6×); "8 × 256" and "49,152 × width" are shapes
FIGURE = re.compile(NUMBER + r"(?:" + UNIT + r"|×(?!\w))")
UNIT_START = re.compile(r"\s*(?:[-*+] |\d+[.)] |\||#|>)")  # a line that starts a list item, a table row, a heading
SENTENCE = re.compile(r".+?(?:[.?!]+(?=\s|$)|$)")
# A sentence that cites where its figure comes from: a paper, a table, a data sheet, a link.
SOURCE = re.compile(
    r"\bpaper\b|\bTable \d|\bFig(?:ure|\.)? ?\d|data[- ]?sheet|\bet al\.|arXiv|\]\(https?://|\bspec\b", re.I
)
# The authors' reading-time estimate in each lab's first cell ("Reading and predicting: 45–60 minutes").
READING = re.compile(r"\bReading\b[^:]*:", re.I)


def _units(markdown: str) -> list[str]:
    """Paragraphs and list items with their hard-wrapped lines joined: a sentence may span lines."""
    units: list[str] = []
    for line in markdown.splitlines():
        if not line.strip() or UNIT_START.match(line) or not units:
            units.append(line.strip())
        else:
            units[-1] += " " + line.strip()
    return [u for u in units if u]


def run_figures(markdown: str) -> list[str]:
    """The figures with units in `markdown` that read as this run's: not in a question (prediction options), not in
    a sentence citing a source (a literature or data-sheet figure), not a reading-time estimate."""
    found = []
    for sentence in (s for unit in _units(markdown) for s in SENTENCE.findall(unit)):
        text = sentence.strip()
        if text.endswith("?") or SOURCE.search(text) or READING.search(text):
            continue
        found += [m.group(0).strip() for m in FIGURE.finditer(text)]
    return found


def lab_figures(path: Path) -> list[tuple[int, str]]:
    """(cell index, figure) for every run figure typed in the lab's markdown cells."""
    nb = nbformat.read(str(path), as_version=4)
    return [(i, f) for i, c in enumerate(nb.cells) if c.cell_type == "markdown" for f in run_figures(c.source)]


def test_a_typed_run_figure_is_found_and_teaching_is_not():
    planted = "In this run GPTQ scored 23.45 and the checkpoint shrank 4.6×, to 112.7 MiB; decode took 29.8 ms."
    assert run_figures(planted) == ["4.6×", "112.7 MiB", "29.8 ms"]
    assert run_figures("Pruned 50 % of the weights, the loss rose by 3 %.") == ["50 %", "3 %"]
    question = "**Predict before you run.** How many times faster: 1×, 10×, 100× or 10,000×?"
    literature = "On OPT-125M the GPTQ paper reports 27.65 (Table 3); an H100's data sheet lists 989 TFLOP/s."
    shapes = "The logits are 8 × 256 positions × 49,152 scores"
    assert run_figures(question) == [] and run_figures(literature) == [] and run_figures(shapes) == []
    assert run_figures("Time: about 30 minutes of compute. Reading and predicting: 45–60 minutes.") == ["30 minutes"]


# Figures still typed per lab (issue 40): each lab's count may only go down, to 0.
BUDGET = {
    "00_gpu_setup": 1,
    "01_data_and_tokenization": 0,
    "02_mixed_precision": 1,
    "03_gradient_accumulation": 0,
    "04_data_parallelism": 0,
    "05_pipeline_parallelism": 1,
    "06_magnitude_pruning": 9,
    "07_gptq_quantization": 3,
    "08_lora_finetuning": 2,
    "09_memory_at_scale": 6,
    "10_profiling_and_monitoring": 4,
}


def test_every_lab_has_a_budget():
    assert {p.stem for p in LABS} == set(BUDGET)


@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_typed_run_figures_only_go_down(path):
    found = lab_figures(path)
    budget = BUDGET[path.stem]
    shown = "; ".join(f"cell {i}: {f}" for i, f in found[:12])
    assert len(found) <= budget, (
        f"{path.name} types {len(found)} run figures in markdown, over its budget of {budget} ({shown}): print them "
        "from the measured values (labkit.claims), or cite the source of a literature figure"
    )
    assert len(found) == budget, f"{path.name} is down to {len(found)} typed run figures: lower its BUDGET to that"
