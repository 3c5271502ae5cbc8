"""`labcourse figures` / `make figures`: the README's measured table rendered from where its figures were measured.

The table's template (`docs/measured.md`) is Markdown with placeholders, each naming a source and a figure:

    {{lab04: tokens/s, 2 ranks | ,.0f}}             a figure lab 04's `expected.check` published (results.publish)
    {{bench/perplexity: perplexity | .2f}}          a figure of the newest run in results/perplexity/ (save_run)
    {{bench/pruning_calibrated: runs[method=wanda,sparsity=50%].ppl | ~3}}   a path into that run's JSON
    {{bench/quant_landscape: nf4_parity.labkit_s ÷ nf4_parity.bitsandbytes_s | .2f}}   a ratio (also: a − b)
    {{bench/tokenizer[vocab_size=16384]: train MB/s.0 | .2f}}   the newest run whose figures match
    {{bench/pruning_speed[machine.profile=gpu]: tokens}}     the newest run made under the gpu profile
    {{bench/make_test: ci_seconds | min}}          a fresh clone's `.ci/run` (tests/durations.py saves it)

After `|` comes a Python format spec, `~N` for N significant digits (thousands separated), or `min` (M min S s).
`{{sources}}` in a row becomes a link to each source the row used, with the machine, profile and date it ran on.
`docs/times.md` renders the instructor guide's time per lab the same way, and `docs/start.md` the start page's table
of labs (`TARGETS`; a lab's source also gives its `title` and the labs it `needs`, read from its first cell). Each
rendering replaces the lines between its file's markers; a test fails when a committed file differs from its
rendering.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labcourse import core, results
from labkit import fileio
from labkit.torchutil import as_path, check_int, is_number

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {  # file -> its template; the rendering replaces the lines between the file's markers
    Path("README.md"): Path("docs/measured.md"),
    Path("docs/instructor.md"): Path("docs/times.md"),
    Path("labs/START_HERE.md"): Path("docs/start.md"),
}
END = "<!-- figures: end -->"
RUN_LABELS = {  # saved runs that no script in benchmarks/ makes
    "make_test": "a fresh clone's `.ci/run`",
    "gpu_labs": "`make gpu-check`",  # each lab's core path under the gpu profile (labcourse.gpucheck)
}


def begin(template: Path) -> str:
    """The line after which a rendered template starts."""
    return f"<!-- figures: begin (rendered by `make figures` from {template.as_posix()}; edit there) -->"


PLACEHOLDER = re.compile(r"\{\{(.*?)\}\}")
_STEP = re.compile(r"\[([^\]]*)\]|([^.\[\]]+)")


class FigureError(ValueError):
    """A placeholder that names no source or no figure, or a figure that cannot be formatted."""


@dataclass(frozen=True)
class Source:
    """Where a row's figures came from: the file to link and the machine it ran on."""

    label: str
    link: str
    machine: str


def _real(value: Any) -> bool:
    """An int or float (inf and nan included), not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def significant(value: float, digits: int) -> str:
    """`value` rounded to `digits` significant digits, thousands separated: 10612 -> '10,600', 46.31 -> '46.3'."""
    if not _real(value):
        raise TypeError(f"value must be a number, got {value!r}")
    check_int("digits", digits, minimum=1)
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = digits - 1 - math.floor(math.log10(abs(value)))
    rounded = round(value, decimals)
    if decimals > 0 and math.floor(math.log10(abs(rounded))) - math.floor(math.log10(abs(value))) == 1:
        decimals -= 1  # 9.996 -> 10.0 at 3 digits: one decimal fewer
    return f"{rounded:,.{max(decimals, 0)}f}"


def fmt(value: Any, spec: str) -> str:
    """A figure as text: a Python format spec, '~N' for N significant digits, or 'min' for seconds as 'M min S s'."""
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a str (a format spec, '~N' or 'min'), got {spec!r}")
    value = results.number(value)
    if spec in ("", ",") and isinstance(value, float) and value.is_integer():
        value = int(value)  # a count that passed through a float (expected.check publishes floats)
    if not spec:
        return str(value)
    if spec == "min":
        if not is_number(value):
            raise FigureError(f"cannot format {value!r} with 'min': it takes a finite number of seconds")
        minutes, seconds = divmod(round(float(value)), 60)
        return f"{minutes} min {seconds} s"
    if spec.startswith("~"):
        if not spec[1:].isdigit() or int(spec[1:]) < 1:
            raise FigureError(f"'~' takes a number of significant digits, got {spec!r}")
        if not _real(value):
            raise FigureError(f"cannot format {value!r} with {spec!r}: it takes a number")
        return significant(float(value), int(spec[1:]))
    try:
        return format(value, spec)
    except (ValueError, TypeError) as err:
        raise FigureError(f"cannot format {value!r} with {spec!r}: {err}") from None


def _wanted(selector: str) -> dict[str, str]:
    """A selector `key=value[,key=value...]` as a dict."""
    parts = selector.split(",")
    wanted = dict(part.split("=", 1) for part in parts if "=" in part)
    if len(wanted) != len(parts):  # a part without '=', or a key given twice
        raise FigureError(f"[{selector}]: a selector is key=value[,key=value...]")
    return wanted


def _matches(item: Any, wanted: dict[str, str]) -> bool:
    return isinstance(item, dict) and all(str(item.get(k)) == v for k, v in wanted.items())


def _select(items: list[Any], selector: str) -> Any:
    """The one dict in `items` whose fields equal every `key=value` of the selector (compared as text)."""
    wanted = _wanted(selector)
    found = [x for x in items if _matches(x, wanted)]
    if len(found) != 1:
        raise FigureError(f"[{selector}] matches {len(found)} of {len(items)} entries, not one")
    return found[0]


def lookup(data: Any, path: str) -> Any:
    """Follow a path through nested JSON: keys (`a.b`, or `a[b.c]` for a key with dots), list indices, and
    [key=value] selectors of the one matching dict in a list."""
    if not isinstance(path, str):
        raise TypeError(f"path must be a str such as 'runs[method=wanda].ppl', got {path!r}")
    for match in _STEP.finditer(path.strip()):
        selector, key = match.groups()
        if selector is not None and isinstance(data, dict):  # [a key with dots or brackets]
            key = selector
        elif selector is not None:
            if not isinstance(data, list):
                raise FigureError(f"[{selector}] applied to {type(data).__name__}, not a list or dict")
            data = _select(data, selector)
            continue
        if isinstance(data, list) and key.isdigit() and int(key) < len(data):
            data = data[int(key)]
        elif isinstance(data, dict) and key in data:
            data = data[key]
        else:
            keys = ", ".join(map(str, data)) if isinstance(data, dict) else type(data).__name__
            raise FigureError(f"no {key!r} (there: {keys})")
    return data


def _operand(figures: dict[str, Any], text: str, by_name: bool) -> Any:
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    if not by_name:
        value = lookup(figures, text)
    elif text not in figures:
        raise FigureError(f"no figure {text!r}; there are: {', '.join(figures)}")
    else:
        value = figures[text]
    if value is None:
        raise FigureError(f"{text!r} was not measured in this run (stored as null)")
    return value


def evaluate(figures: dict[str, Any], expression: str, *, by_name: bool) -> Any:
    """One figure (a lab's by its name, a benchmark's by its path), or a ratio 'a ÷ b' or difference 'a − b' of
    two figures or numbers."""
    if not isinstance(figures, dict):
        raise TypeError(f"figures must be a dict of name -> value, got {type(figures).__name__}")
    if not isinstance(expression, str):
        raise TypeError(f"expression must be a str such as 'a ÷ b', got {expression!r}")
    for op in ("÷", "−"):
        if f" {op} " in expression:
            left, right = (results.number(_operand(figures, t, by_name)) for t in expression.split(f" {op} ", 1))
            try:
                return left / right if op == "÷" else left - right
            except (TypeError, ZeroDivisionError) as err:
                raise FigureError(f"{expression.strip()}: {err}") from None
    return _operand(figures, expression, by_name)


def _newest_matching(found: list[tuple[Path, dict[str, Any]]], selector: str, name: str) -> tuple[Path, dict[str, Any]]:
    wanted = _wanted(selector)  # `machine.<field>` keys match the run's machine (profile, cpu), the rest its figures
    on_machine = {k.removeprefix("machine."): v for k, v in wanted.items() if k.startswith("machine.")}
    on_figures = {k: v for k, v in wanted.items() if not k.startswith("machine.")}
    hits = [(p, r) for p, r in found if _matches(r["figures"], on_figures) and _matches(r["machine"], on_machine)]
    if not hits:
        raise FigureError(f"{name}: no saved run whose figures match [{selector}]")
    return hits[-1]


def read_cells(path: Path) -> list[dict[str, Any]]:
    """A notebook's cells as stored, each source joined into one string (nbformat keeps lists of lines)."""
    cells = json.loads(as_path("path", path).read_text(encoding="utf-8")).get("cells") or []
    cells = [c for c in cells if isinstance(c, dict)]
    for cell in cells:
        source = cell.get("source", "")
        cell["source"] = "".join(source) if isinstance(source, list) else str(source)
    return cells


def lab_header(path: Path) -> dict[str, str]:
    """What a lab's first markdown cell says of it, for the start page: its `title` (the heading after "Lab NN — ")
    and the labs it `needs` (the numbers after "lab"/"labs" in its **Prerequisites:** paragraph, or "none"); each
    only if present."""
    return _header(read_cells(path))


def _header(cells: list[dict[str, Any]]) -> dict[str, str]:
    first = next((c for c in cells if c.get("cell_type") == "markdown"), {})
    text = first.get("source", "")
    found = {}
    if heading := re.search(r"^# (?:Lab \d+ — )?(.+)$", text, re.MULTILINE):
        found["title"] = heading.group(1).strip()
    if needs := re.search(r"^\*\*Prerequisites:\*\*(.*?)(?:\n\s*\n|\Z)", text, re.MULTILINE | re.DOTALL):
        plain = re.sub(r"\([^()]*\)", "", needs.group(1))  # "labs 00 (perplexity) and 03": the asides out
        runs = re.findall(r"\blabs?\s+(\d\d(?:\s*(?:,|and|or)\s*\d\d)*)", plain)
        numbers = sorted({n for run in runs for n in re.findall(r"\d\d", run)})
        found["needs"] = ", ".join(numbers) or "none"
    return found


class Sources:
    """The figures of every lab and benchmark a template names, read once each from the repository at `root`."""

    def __init__(self, root: Path = ROOT) -> None:
        self.root = as_path("root", root)
        self._cache: dict[str, tuple[dict[str, Any], Source]] = {}

    def _machine(self, fp: dict[str, Any]) -> str:
        """`profile`, the GPUs or else the CPU with its vector features (which tell two "AMD EPYC" VMs apart and
        say whether bf16 ran natively), and the date."""
        cpu = fp.get("cpu", "unknown machine")
        if fp.get("cpu_features"):
            cpu += f" [{'/'.join(map(str, fp['cpu_features']))}]"
        where = ", ".join(map(str, fp.get("gpus") or [])) or cpu
        return f"`{fp.get('profile', '?')}`, {where}, {str(fp.get('date', '?'))[:10]}"

    def _load(self, name: str) -> tuple[dict[str, Any], Source]:
        if name.startswith("lab") and name[3:].isdigit():
            found = sorted((self.root / "labs").glob(f"{name[3:]}_*.ipynb"))
            if len(found) != 1:
                raise FigureError(f"{name}: no notebook labs/{name[3:]}_*.ipynb")
            nb = found[0]
            link = nb.relative_to(self.root).as_posix()
            recorded, payloads = results.saved_notebook(nb)
            executed = recorded.get("executed")
            if not executed:
                raise FigureError(f"{name}: {link} was not written by `make execute` (no machine recorded)")
            if not isinstance(executed, dict):
                raise FigureError(
                    f"{name}: {link}: metadata.labkit.executed is a {type(executed).__name__}, not an object"
                )
            figures: dict[str, Any] = {"executed seconds": executed.get("seconds")}  # `make execute`'s whole run
            cells = read_cells(nb)
            try:  # the core path's share of that run: its cells' recorded times, the deep dives' left out
                figures["core seconds"], figures["deep-dive seconds"] = core.split_seconds(cells)
            except ValueError:
                pass  # a cell without its recorded time (not run by nbclient): the two figures are absent
            figures |= _header(cells)
            for payload in payloads:
                if not isinstance(payload.get("figures", {}), dict):
                    raise FigureError(f"{name}: {link} published 'figures' that are not an object: {payload}")
                figures.update(payload.get("figures", {}))
            return figures, Source(f"lab {name[3:]}", link, self._machine(executed))
        if match := re.fullmatch(r"bench/(\w+)(?:\[(.*)\])?", name):
            benchmark, selector = match.groups()
            folder = self.root / results.RESULTS
            if selector:  # the newest run made with these settings
                path, record = _newest_matching(results.runs(benchmark, folder), selector, name)
            else:
                path, record = results.latest(benchmark, folder)
            link = path.relative_to(self.root).as_posix()
            label = RUN_LABELS.get(benchmark, f"benchmarks/{benchmark}.py")
            return record["figures"], Source(label, link, self._machine(record["machine"]))
        raise FigureError(f"unknown source {name!r}: labNN or bench/<benchmark>")

    def get(self, name: str) -> tuple[dict[str, Any], Source]:
        """The figures of one source ('labNN' or 'bench/<benchmark>[selector]') and where they came from, read once."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a source such as 'lab04' or 'bench/perplexity', got {name!r}")
        if name not in self._cache:
            self._cache[name] = self._load(name)
        return self._cache[name]


def render_line(line: str, sources: Sources, base: str = ".") -> str:
    """One template line with its figures filled in and `{{sources}}` linked (relative to the folder `base`)."""
    _check_render("line", line, sources, base)
    used: list[Source] = []

    def fill(match: re.Match[str]) -> str:
        body = match.group(1)
        if body.strip() == "sources":
            return match.group(0)  # after the figures, once the row's sources are known
        body, otherwise, fallback = body.partition("||")  # `|| text`: shown where the source has no such figure
        name, sep, rest = body.partition(":")
        if not sep:
            raise FigureError(f"{{{{{body}}}}}: write {{{{source: figure | format}}}}")
        figure, _, spec = rest.rpartition("|") if "|" in rest else (rest, "", "")
        try:
            figures, source = sources.get(name.strip())
        except (FigureError, FileNotFoundError):
            if otherwise:
                return fallback.strip()
            raise
        try:
            value = evaluate(figures, figure, by_name=name.strip().startswith("lab"))
            if value is None and otherwise:
                raise FigureError("stored as null")
        except FigureError as err:
            if otherwise:
                return fallback.strip()
            raise FigureError(f"{{{{{body}}}}}: {err}") from None
        if source not in used:
            used.append(source)
        return fmt(value, spec.strip())

    text = PLACEHOLDER.sub(fill, line)
    links = "; ".join(f"[{s.label}]({posixpath.relpath(s.link, base)}) ({s.machine})" for s in used)
    return text.replace("{{sources}}", links)


def render(template: str, sources: Sources, name: str = "template", base: str = ".") -> str:
    """The whole template rendered, line by line; an error names the line."""
    _check_render("template", template, sources, base)
    out = []
    for number, line in enumerate(template.splitlines(), 1):
        try:
            out.append(render_line(line, sources, base))
        except FigureError as err:
            raise FigureError(f"{name}, line {number}: {err}") from None
    return "\n".join(out) + "\n"


def _check_render(what: str, text: str, sources: Sources, base: str) -> None:
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str (the template's text), got {type(text).__name__}")
    if not isinstance(sources, Sources):
        raise TypeError(f"sources must be a figures.Sources, got {type(sources).__name__}")
    if not isinstance(base, str):
        raise TypeError(f"base must be a folder as a str ('.' or 'docs'), got {base!r}")


def typed_rows(template: str) -> list[str]:
    """Table rows (after the header) with no placeholder at all: figures still typed by hand. A row whose source
    (its last cell) names a test file states a fact the suite checks on every run, not a measurement."""
    if not isinstance(template, str):
        raise TypeError(f"template must be a str (the template's text), got {type(template).__name__}")
    lines = template.splitlines()
    body = lines[next((i + 1 for i, line in enumerate(lines) if line.startswith("|---")), 0) :]
    return [
        row
        for row in body
        if row.startswith("|") and not PLACEHOLDER.search(row) and "`tests/test_" not in row.rstrip(" |").split("|")[-1]
    ]


def rendered(target: Path, root: Path = ROOT, sources: Sources | None = None) -> str:
    """`target` as it should be: the lines between its markers replaced by its rendered template."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(map(str, TARGETS))}, got {target!r}")
    if sources is not None and not isinstance(sources, Sources):
        raise TypeError(f"sources must be None or a figures.Sources, got {type(sources).__name__}")
    root = as_path("root", root)
    template = TARGETS[target]
    text = (root / target).read_text(encoding="utf-8")
    start = begin(template)
    if text.count(start) != 1 or text.count(END) != 1 or text.index(start) > text.index(END):
        raise FigureError(f"{target} needs exactly one {start!r} followed by one {END!r}")
    head, rest = text.split(start)
    _, tail = rest.split(END)
    base = target.parent.as_posix()  # links work from the file they are in
    table = render((root / template).read_text(encoding="utf-8"), sources or Sources(root), template.as_posix(), base)
    return f"{head}{start}\n{table}{END}{tail}"


def stale(root: Path = ROOT) -> list[Path]:
    """The targets whose committed text differs from their rendering."""
    root = as_path("root", root)
    sources = Sources(root)
    return [t for t in TARGETS if rendered(t, root, sources) != (root / t).read_text(encoding="utf-8")]


def update(root: Path = ROOT) -> list[Path]:
    """Write each target that differs from its rendering (atomically); returns those written."""
    root = as_path("root", root)
    sources = Sources(root)
    written = []
    for target in TARGETS:
        new = rendered(target, root, sources)
        if (root / target).read_text(encoding="utf-8") != new:
            fileio.atomic_write_text(root / target, new)
            written.append(target)
    return written
