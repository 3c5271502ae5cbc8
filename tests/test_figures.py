"""labcourse.figures: the README's measured table rendered from the saved runs and the executed labs — every figure
read from its source, formatted as asked, linked with the machine it ran on — and the README as committed is
exactly what it renders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from labcourse import figures, results


@pytest.mark.parametrize(
    "value, digits, text",
    [(10612, 3, "10,600"), (46.31, 3, "46.3"), (577.2, 3, "577"), (2358.05, 3, "2,360"), (9.996, 3, "10.0"),
     (0.0012345, 2, "0.0012"), (-17.889, 4, "-17.89"), (0, 3, "0")],
)  # fmt: skip
def test_significant_digits_by_hand(value, digits, text):
    assert figures.significant(value, digits) == text


def test_fmt_takes_a_python_spec_or_significant_digits():
    assert figures.fmt(0.0022303, ".2%") == "0.22%"
    assert figures.fmt(1658880, ",") == "1,658,880"
    assert figures.fmt("inf", ".1f") == "inf"  # stored as text, formatted as the float it was
    assert figures.fmt("4-bit g64", "") == "4-bit g64"
    assert figures.fmt(1194.3, "min") == "19 min 54 s"
    assert figures.fmt(6701.0, ",") == "6,701" and figures.fmt(64.0, "") == "64" and figures.fmt(0.5, "") == "0.5"
    with pytest.raises(figures.FigureError, match="significant digits"):
        figures.fmt(1.0, "~x")
    with pytest.raises(figures.FigureError, match="cannot format 'text'"):
        figures.fmt("text", ".2f")


RUN = {
    "documents": 64,
    "runs": [
        {"method": "dense", "sparsity": 0.0, "ppl": 17.889},
        {"method": "wanda", "sparsity": "50%", "ppl": 46.3158},
        {"method": "wanda", "sparsity": "2:4", "ppl": 188.31},
    ],
    "parity": {"ours_s": 1.7358, "theirs_s": 1.5397},
    "seconds_per_step": {"labkit.train.fit": 0.412, "bare loop": 0.420},
}


def test_lookup_follows_keys_indices_and_selectors():
    assert figures.lookup(RUN, "documents") == 64
    assert figures.lookup(RUN, "runs.1.ppl") == 46.3158
    assert figures.lookup(RUN, "runs[method=wanda,sparsity=2:4].ppl") == 188.31
    assert figures.lookup(RUN, "runs[sparsity=0.0].method") == "dense"
    assert figures.lookup(RUN, "seconds_per_step[labkit.train.fit]") == 0.412  # a key with dots, in brackets
    with pytest.raises(figures.FigureError, match=r"matches 2 of 3 entries, not one"):
        figures.lookup(RUN, "runs[method=wanda].ppl")
    with pytest.raises(figures.FigureError, match=r"no 'ppx' \(there: method, sparsity, ppl\)"):
        figures.lookup(RUN, "runs.0.ppx")
    with pytest.raises(figures.FigureError, match="key=value"):
        figures.lookup(RUN, "runs[wanda].ppl")


def test_ratios_and_differences_of_two_figures():
    ratio = figures.evaluate(RUN, "parity.ours_s ÷ parity.theirs_s", by_name=False)
    assert ratio == pytest.approx(1.7358 / 1.5397)
    assert figures.evaluate(RUN, "documents − 4", by_name=False) == 60
    lab = {"tokens/s, 1 rank": 450.0, "tokens/s, 2 ranks": 829.0}  # a lab's names keep their '/' and ','
    assert figures.evaluate(lab, "tokens/s, 2 ranks ÷ tokens/s, 1 rank", by_name=True) == pytest.approx(829 / 450)
    with pytest.raises(figures.FigureError, match="'speed' was not measured in this run"):
        figures.evaluate({"speed": None}, "speed", by_name=True)
    with pytest.raises(figures.FigureError, match="division by zero"):
        figures.evaluate(RUN, "documents ÷ 0", by_name=False)


README_BEGIN = figures.begin(Path("docs/measured.md"))


def make_repo(tmp_path, *, executed=True):
    """A repository with one executed lab that published figures, one benchmark run and a README with markers."""
    (tmp_path / "labs").mkdir()
    cell = new_code_cell("expected.check(...)", execution_count=1)
    payload = {"lab": "04", "profile": "cpu", "figures": {"tokens/s, 1 rank": 450.2, "tokens/s, 2 ranks": 829.0}}
    cell.outputs = [new_output("display_data", data={"text/plain": "table", results.MIME: payload})]
    header = new_markdown_cell(
        "# Lab 04 — Data parallelism\n\n**Prerequisites:** labs 02 and 03 (the trainer); a GPU helps."
    )
    nb = new_notebook(cells=[header, cell])
    if executed:
        nb.metadata["labkit"] = {
            "executed": {
                "profile": "cpu",
                "cpu": "Test CPU",
                "cpu_features": ["avx2", "avx512_bf16"],
                "gpus": [],
                "date": "2026-11-25 10:00 UTC",
                "seconds": 61.5,
            },
        }
    (tmp_path / "labs" / "04_data.ipynb").write_text(json.dumps(nb))
    run = tmp_path / "results" / "pruning" / "20261124-092151-vm.json"
    run.parent.mkdir(parents=True)
    machine = {"profile": "cpu", "cpu": "Other CPU", "gpus": ["NVIDIA H100 80GB HBM3"], "date": "2026-11-24 09:21 UTC"}
    run.write_text(json.dumps({"benchmark": "pruning", "machine": machine, "figures": RUN}))
    (tmp_path / "docs").mkdir()
    template = (
        "| what | figure | where |\n|---|---|---|\n"
        "| DDP | {{lab04: tokens/s, 1 rank | ,.0f}} vs {{lab04: tokens/s, 2 ranks | ,.0f}} tokens/s, "
        "{{lab04: tokens/s, 2 ranks ÷ tokens/s, 1 rank | .2f}}× | {{sources}} |\n"
        "| Wanda | {{bench/pruning: runs[method=wanda,sparsity=50%].ppl | ~3}} vs {{lab04: tokens/s, 1 rank | .0f}} "
        "| {{sources}} |\n"
        "| typed | 3.14 | by hand |\n"
        "| checked | equal | `tests/test_x.py` |\n"
    )
    (tmp_path / "docs" / "measured.md").write_text(template)
    (tmp_path / "README.md").write_text(f"# course\n\n{README_BEGIN}\nold table\n{figures.END}\n\nmore prose\n")
    (tmp_path / "docs" / "times.md").write_text(
        "| lab | cpu | by |\n|---|---|---|\n| 04 | {{lab04: executed seconds}} s | {{sources}} |\n"
    )
    guide = f"# guide\n{figures.begin(Path('docs/times.md'))}\n{figures.END}\n"
    (tmp_path / "docs" / "instructor.md").write_text(guide)
    (tmp_path / "docs" / "start.md").write_text(
        "| lab | title | builds on | by |\n|---|---|---|---|\n"
        "| [04](04_data.ipynb) | {{lab04: title}} | {{lab04: needs}} | {{sources}} |\n"
    )
    start = f"# start\n{figures.begin(Path('docs/start.md'))}\n{figures.END}\n"
    (tmp_path / "labs" / "START_HERE.md").write_text(start)
    return tmp_path


def test_a_template_renders_each_figure_from_its_source_with_links(tmp_path):
    root = make_repo(tmp_path)
    assert figures.update(root) == [Path("README.md"), Path("docs/instructor.md"), Path("labs/START_HERE.md")]
    readme = (root / "README.md").read_text()
    lab = "[lab 04](labs/04_data.ipynb) (`cpu`, Test CPU [avx2/avx512_bf16], 2026-11-25)"
    bench = (
        "[benchmarks/pruning.py](results/pruning/20261124-092151-vm.json) (`cpu`, NVIDIA H100 80GB HBM3, 2026-11-24)"
    )
    assert readme == (
        f"# course\n\n{README_BEGIN}\n| what | figure | where |\n|---|---|---|\n"
        f"| DDP | 450 vs 829 tokens/s, 1.84× | {lab} |\n"
        f"| Wanda | 46.3 vs 450 | {bench}; {lab} |\n"
        f"| typed | 3.14 | by hand |\n| checked | equal | `tests/test_x.py` |\n{figures.END}\n\nmore prose\n"
    )
    guide = (root / "docs" / "instructor.md").read_text()  # its links start from docs/
    assert guide.endswith(
        "| 04 | 61.5 s | [lab 04](../labs/04_data.ipynb) (`cpu`, Test CPU [avx2/avx512_bf16], 2026-11-25) |\n"
        + figures.END
        + "\n"
    )
    start = (root / "labs" / "START_HERE.md").read_text()  # title and prerequisites read from the lab's first cell
    assert "| [04](04_data.ipynb) | Data parallelism | 02, 03 | [lab 04](04_data.ipynb) (`cpu`, Test CPU" in start
    assert figures.update(root) == [] and figures.stale(root) == []  # rendering again changes nothing
    assert figures.typed_rows((root / "docs" / "measured.md").read_text()) == ["| typed | 3.14 | by hand |"]


def test_errors_name_the_line_and_what_is_missing(tmp_path):
    root = make_repo(tmp_path)
    template = root / "docs" / "measured.md"
    template.write_text("| a | {{lab04: tokens/s, 3 ranks}} |\n")
    with pytest.raises(figures.FigureError, match=r"docs/measured.md, line 1: .*no figure 'tokens/s, 3 ranks'"):
        figures.rendered(Path("README.md"), root)
    template.write_text("\n| a | {{lab07: perplexity}} |\n")
    with pytest.raises(figures.FigureError, match=r"line 2: lab07: no notebook labs/07_\*.ipynb"):
        figures.rendered(Path("README.md"), root)
    template.write_text("| a | {{bench/missing: x}} |\n")
    with pytest.raises(FileNotFoundError, match="run benchmarks/missing.py"):
        figures.rendered(Path("README.md"), root)
    template.write_text("| a | {{perplexity}} |\n")
    with pytest.raises(figures.FigureError, match=r"write \{\{source: figure \| format\}\}"):
        figures.rendered(Path("README.md"), root)
    (root / "README.md").write_text("# no markers\n")
    with pytest.raises(figures.FigureError, match="needs exactly one"):
        figures.rendered(Path("README.md"), root)


def test_a_labs_header_gives_its_title_and_the_labs_it_builds_on(tmp_path):
    path = tmp_path / "00.ipynb"
    for first, header in (
        (
            "# Lab 00 — Your machine\n\n**Prerequisites:** none — start here.",
            {"title": "Your machine", "needs": "none"},
        ),
        (
            "# Lab 07 — GPTQ\n**Prerequisites:** lab 00 (perplexity); lab 06 helps, 2:4 not.",
            {"title": "GPTQ", "needs": "00, 06"},
        ),
        ("no heading at all", {}),
        (  # a wrapped paragraph, an aside in parentheses and a number that is no lab
            "# Lab 09 — Memory\n\n**Prerequisites:** lab 03 (about 10 minutes), lab 04\n(DDP), and labs 05\nand 06.\n\n"
            "**Time:** 20 minutes; lab 11 is elsewhere.",
            {"title": "Memory", "needs": "03, 04, 05, 06"},
        ),
    ):
        path.write_text(json.dumps(new_notebook(cells=[new_code_cell("# setup"), new_markdown_cell(first)])))
        assert figures.lab_header(path) == header  # read from the first markdown cell, not a code cell before it


def test_a_lab_not_written_by_make_execute_is_no_source(tmp_path):
    root = make_repo(tmp_path, executed=False)
    with pytest.raises(figures.FigureError, match="04_data.ipynb was not written by `make execute`"):
        figures.rendered(Path("README.md"), root)


def test_the_committed_readme_and_guide_are_what_make_figures_renders():
    assert figures.stale() == [], "differs from its template's rendering: run make figures"


def test_a_benchmark_source_can_pick_the_newest_run_with_given_settings(tmp_path):
    root = make_repo(tmp_path)
    for stamp, vocab, speed in (("20261124-000000", 16384, 0.71), ("20261125-000000", 4096, 1.09)):
        run = root / "results" / "tok" / f"{stamp}-vm.json"
        run.parent.mkdir(exist_ok=True)
        figures_ = {"vocab_size": vocab, "train MB/s": [speed, 3.41]}
        run.write_text(json.dumps({"benchmark": "tok", "machine": {"profile": "cpu"}, "figures": figures_}))
    line = "| {{bench/tok: train MB/s.0}} / {{bench/tok[vocab_size=16384]: train MB/s.0}} | {{sources}} |"
    assert figures.render_line(line, figures.Sources(root)) == (
        "| 1.09 / 0.71 | [benchmarks/tok.py](results/tok/20261125-000000-vm.json) (`cpu`, unknown machine, ?); "
        "[benchmarks/tok.py](results/tok/20261124-000000-vm.json) (`cpu`, unknown machine, ?) |"
    )
    with pytest.raises(figures.FigureError, match=r"no saved run whose figures match \[vocab_size=8\]"):
        figures.render_line("{{bench/tok[vocab_size=8]: documents}}", figures.Sources(root))


def test_a_benchmark_source_can_pick_the_newest_run_made_on_a_kind_of_machine(tmp_path):
    root = make_repo(tmp_path)
    runs = (("20261125-000000", "cpu", [], 1.28), ("20261126-000000", "gpu", ["H100"], 0.027))
    for stamp, profile, gpus, dense in runs:
        run = root / "results" / "speed" / f"{stamp}-vm.json"
        run.parent.mkdir(exist_ok=True)
        machine = {"profile": profile, "gpus": gpus, "date": stamp[:8]}
        run.write_text(json.dumps({"benchmark": "speed", "machine": machine, "figures": {"dense_s": dense}}))
    sources = figures.Sources(root)
    assert figures.render_line("{{bench/speed: dense_s}}", sources) == "0.027"  # the newest, whatever it ran on
    assert figures.render_line("{{bench/speed[machine.profile=cpu]: dense_s}}", sources) == "1.28"
    assert figures.render_line("{{bench/speed[machine.profile=gpu,dense_s=0.027]: dense_s}}", sources) == "0.027"
    with pytest.raises(figures.FigureError, match=r"no saved run whose figures match \[machine.profile=smoke\]"):
        figures.render_line("{{bench/speed[machine.profile=smoke]: dense_s}}", sources)


def test_a_fallback_stands_where_no_run_or_no_figure_exists_and_only_there(tmp_path):
    root = make_repo(tmp_path)
    line = "| {{bench/gpu_labs: labs.00_gpu_setup.core_seconds | min || not measured yet}} | {{sources}} |"
    assert figures.render_line(line, figures.Sources(root)) == "| not measured yet |  |"  # no gpu_labs run at all
    with pytest.raises(FileNotFoundError, match="no saved run of benchmark 'gpu_labs'"):  # without a fallback
        figures.render_line(line.replace(" || not measured yet", ""), figures.Sources(root))
    run = root / "results" / "gpu_labs" / "20261127-100000-node.json"
    run.parent.mkdir()
    labs = {"00_gpu_setup": {"status": "passed", "core_seconds": 95.0}, "01_data": {"status": "timed out"}}
    labs["02_mixed"] = {"status": "failed", "core_seconds": None}
    machine = {"profile": "gpu", "gpus": ["NVIDIA H100 80GB HBM3"], "date": "2026-11-27 10:00 UTC"}
    run.write_text(json.dumps({"benchmark": "gpu_labs", "machine": machine, "figures": {"labs": labs}}))
    assert figures.render_line(line, figures.Sources(root)).startswith("| 1 min 35 s | [`make gpu-check`](results/")
    for stem in ("01_data", "02_mixed"):  # no figure; stored as null
        assert (
            figures.render_line(line.replace("00_gpu_setup", stem), figures.Sources(root)) == "| not measured yet |  |"
        )
    with pytest.raises(figures.FigureError, match="cannot format 95.0 with '.1x'"):  # a wrong format is still an error
        figures.render_line(line.replace("| min ||", "| .1x ||"), figures.Sources(root))


def test_the_labs_times_gpu_check_saves_render_with_their_gpu_named(tmp_path):
    root = make_repo(tmp_path)
    run = root / "results" / "gpu_labs" / "20261127-100000-node.json"
    run.parent.mkdir()
    labs = {"00_gpu_setup": {"status": "passed", "core_seconds": 95.0}}
    machine = {"profile": "gpu", "gpus": ["NVIDIA H100 80GB HBM3"], "date": "2026-11-27 10:00 UTC"}
    run.write_text(json.dumps({"benchmark": "gpu_labs", "machine": machine, "figures": {"labs": labs}}))
    line = "| {{bench/gpu_labs: labs.00_gpu_setup.core_seconds ÷ 60 | .1f}} min | {{sources}} |"
    assert figures.render_line(line, figures.Sources(root)) == (
        "| 1.6 min | [`make gpu-check`](results/gpu_labs/20261127-100000-node.json) "
        "(`gpu`, NVIDIA H100 80GB HBM3, 2026-11-27) |"
    )
