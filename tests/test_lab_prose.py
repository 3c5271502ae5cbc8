"""Markdown teaches; it does not report. A figure of this run typed into a lab's markdown (a time, a ratio, a
share, a size) drifts when the machine, the run or the code changes, and the student build ships the reference
machine's numbers to students whose runs differ: such figures are printed by code from the measured values
(labcourse.claims). Markdown keeps definitions, reasoning, questions and literature figures with their source.

`run_figures` finds figures with units in markdown that are none of those. A figure typed on purpose — a setting the
code uses, arithmetic on a published shape, a hypothetical — is listed in REVIEWED with the reason it is not this
run's: any other fails, so a typed run figure cannot come back, and an entry no longer found fails too."""

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


def figure_sentences(markdown: str) -> list[tuple[str, str]]:
    """(sentence, figure) for the figures with units in `markdown` that read as this run's: not in a question
    (prediction options), not in a sentence citing a source (a literature or data-sheet figure), not a reading-time
    estimate."""
    found = []
    for sentence in (s for unit in _units(markdown) for s in SENTENCE.findall(unit)):
        text = sentence.strip()
        if text.endswith("?") or SOURCE.search(text) or READING.search(text):
            continue
        found += [(text, m.group(0).strip()) for m in FIGURE.finditer(text)]
    return found


def run_figures(markdown: str) -> list[str]:
    """The figures of `figure_sentences`, alone."""
    return [figure for _, figure in figure_sentences(markdown)]


def unreviewed(lab: str, markdown_cells: list[str]) -> list[str]:
    """The typed figures of a lab's markdown whose sentence no REVIEWED entry of that lab opens."""
    openings = [opening for name, opening in REVIEWED if name == lab]
    return [
        f"{figure} in: {sentence[:100]}"
        for source in markdown_cells
        for sentence, figure in figure_sentences(source)
        if not any(sentence.startswith(opening) for opening in openings)
    ]


def markdown_cells(path: Path) -> list[str]:
    return [c.source for c in nbformat.read(str(path), as_version=4).cells if c.cell_type == "markdown"]


def test_a_typed_run_figure_is_found_and_teaching_is_not():
    planted = "In this run GPTQ scored 23.45 and the checkpoint shrank 4.6×, to 112.7 MiB; decode took 29.8 ms."
    assert run_figures(planted) == ["4.6×", "112.7 MiB", "29.8 ms"]
    assert run_figures("Pruned 50 % of the weights, the loss rose by 3 %.") == ["50 %", "3 %"]
    question = "**Predict before you run.** How many times faster: 1×, 10×, 100× or 10,000×?"
    literature = "On OPT-125M the GPTQ paper reports 27.65 (Table 3); an H100's data sheet lists 989 TFLOP/s."
    shapes = "The logits are 8 × 256 positions × 49,152 scores"
    assert run_figures(question) == [] and run_figures(literature) == [] and run_figures(shapes) == []
    assert run_figures("Time: about 30 minutes of compute. Reading and predicting: 45–60 minutes.") == ["30 minutes"]


# Figures typed on purpose, each read against the code: lab, the opening words of the figure's sentence, and why the
# figure is not this run's. A sentence that reports a run must print its figure from the measured values instead.
REVIEWED = {
    ("00_gpu_setup", "Without `sync()`, a timer around"): "a hypothetical: what a timer without a sync can return",
    ("02_mixed_precision", "So the lab first **times one step"): "the lab's rule: modes within 10x of fp32 train",
    ("05_pipeline_parallelism", "(The formula gives"): "arithmetic: the bubble formula at the shown p and m",
    ("06_magnitude_pruning", "Prune with calibration data"): "an objective: the sparsities the lab sweeps",
    ("06_magnitude_pruning", "**Time:** the core path is"): "the lab's plan: the sparsity its core path prunes at",
    ("06_magnitude_pruning", "The sections titled *Deep dive*"): "the lab's plan: the sparsities its deep dives sweep",
    ("06_magnitude_pruning", "### Deep dive: from 30 to 70 %"): "a heading: the sparsities the deep dive sweeps",
    ("06_magnitude_pruning", "The histogram shows the magnitudes"): "a definition: global 50 % is the setting drawn",
    ("06_magnitude_pruning", "At 50 % the gap is the whole lesson"): "a setting: the sparsity compared",
    ("06_magnitude_pruning", "At 70 % and at 2:4"): "settings: where the update has the most to do",
    ("06_magnitude_pruning", "Prune **one group at a time**"): "a setting: each group pruned to 50 %",
    ("06_magnitude_pruning", "Below, Wanda at 50 % is calibrated"): "a setting: the sparsity of the calibration study",
    ("06_magnitude_pruning", "Timing a forward pass of the dense"): "a setting: the 50 %-sparse model timed",
    ("06_magnitude_pruning", "Now the structured model this lab keeps"): "a setting: 20 % of the MLP channels",
    ("07_gptq_quantization", "A 7-billion-parameter model needs"): "arithmetic: 7 B parameters at 4, 2, 0.5 bytes",
    ("08_lora_finetuning", "# Lab 08 — LoRA"): "arithmetic: LoRA r=8 on q, v of SmolLM2's shapes",
    ("08_lora_finetuning", "The cell above printed whether the spectrum"): "a definition: the ranks holding 90 %",
    (
        "09_memory_at_scale",
        "For a model of Ψ parameters trained with AdamW",
    ): "arithmetic: 16 B x 6.7 B; the H100's 80 GB",
    ("09_memory_at_scale", "(DDP holds 16 bytes"): "arithmetic: 16 B x 6.7 B parameters",
    ("09_memory_at_scale", "At 8 ranks every ZeRO stage"): "a hardware figure: an H100's 80 GB",
    ("09_memory_at_scale", "Below, one 80 GB H100 per rank"): "settings: the GPU and the reserve the table assumes",
    ("10_profiling_and_monitoring", "What the hardware saw"): "a setting: the sampler's period",
    ("10_profiling_and_monitoring", 'NVML\'s "GPU utilization"'): "a definition: what 100 % utilization means",
    ("10_profiling_and_monitoring", "A colleague reports"): "a hypothetical: the question's premise",
}


def test_an_unreviewed_figure_fails_and_a_reviewed_one_passes():
    planted = "Decode took 29.8 ms here. Prune **one group at a time** to 50 % (everything else dense)."
    assert unreviewed("06_magnitude_pruning", [planted]) == ["29.8 ms in: Decode took 29.8 ms here."]
    assert unreviewed("07_gptq_quantization", [planted])[1].startswith("50 % in: Prune **one group")


def test_every_lab_is_read():
    assert {name for name, _ in REVIEWED} <= {p.stem for p in LABS}


@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_no_typed_run_figure(path):
    found = unreviewed(path.stem, markdown_cells(path))
    assert found == [], (
        f"{path.name} types run figures in markdown: {found[:12]}. Print them from the measured values "
        "(labcourse.claims), cite the source of a literature figure, or, for a setting or a definition, add the "
        "sentence to REVIEWED with the reason"
    )


@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_every_reviewed_sentence_is_still_there(path):
    sentences = [sentence for source in markdown_cells(path) for sentence, _ in figure_sentences(source)]
    stale = [o for name, o in REVIEWED if name == path.stem and not any(s.startswith(o) for s in sentences)]
    assert stale == [], f"{path.name}: REVIEWED lists sentences no longer typed with a figure: {stale}"
