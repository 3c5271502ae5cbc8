"""`labcourse slides` / `make slides`: a reveal.js deck per lab, made from the executed notebook itself by
nbconvert's slides exporter and Jupyter's slideshow metadata (`metadata.slideshow.slide_type`).

The rule (`mark_slides`) works on a copy at build time; the tracked notebooks are never modified:

* A cell whose metadata already sets `slideshow.slide_type` keeps it and stays whole: the author's choice wins, so an
  instructor curates a deck in JupyterLab's property inspector (a code cell's input is hidden by the `remove-input`
  tag).
* A markdown cell is cut at its `#`, `##` and `###` heading lines (not inside fenced code). A section under `#` or
  `##` starts a slide (`slide`: a column of its own, the lab's table of contents), one under `###` a slide below it
  (`subslide`). The slide shows the heading and the first paragraph after it; a paragraph holding a prediction
  prompt (`**Predict`) follows as a `fragment`, shown on the next click; the section's other paragraphs become the
  speaker notes (`notes`: press `s` in the deck).
* A section without a heading that holds a prediction prompt is a `subslide` showing the prompt (its other paragraphs
  are notes); any other markdown goes to the notes.
* A code cell with an image among its outputs is a `subslide` showing the images alone: its input is hidden
  (`remove-input`) and its other outputs dropped. Every other code cell, and every raw cell, is `skip`.

Offline: the deck loads reveal.js (5.2, shipped by PyPI's sphinx-revealjs, pinned in the dev extra) and MathJax 2.7
(jupyter-server-mathjax) from copies written beside it, `reveal.js/` and `mathjax/`; the reveal template's
require.js, jQuery and mermaid (CDN links) are left out, as its footer's require.js call is replaced by script tags.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from labkit import fileio

PREDICTION = "**Predict"  # the labs' prediction prompt: "**Predict before you run.** ..."
IMAGE_TYPES = ("image/png", "image/jpeg", "image/svg+xml", "image/gif")
HIDE_INPUT = "remove-input"  # a cell tag: the deck shows the cell's outputs without its code
# Where the decks find their scripts: the package that ships them, the files under it, the PyPI name to install.
REVEAL = ("sphinx_revealjs", "_static/revealjs", "sphinx-revealjs")
MATHJAX = ("jupyter_server_mathjax", "static", "jupyter-server-mathjax")
REVEAL_FILES = (  # what a deck uses from reveal.js: the theme's fonts are local (the white theme imports no web font)
    "LICENSE",
    "dist/reveal.js",
    "dist/reveal.css",
    "dist/theme/white.css",
    "dist/theme/fonts/source-sans-pro",
    "plugin/notes/notes.js",
)
THEME = "white"
MATHJAX_URL = "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full,Safe"

# nbconvert gives a figure without alt text a generic one and warns about each deck: noise on `make slides`' output
_LOG = logging.getLogger(__name__)
_LOG.addFilter(lambda record: not record.getMessage().startswith("Alternative text is missing"))

_HEADING = re.compile(r"(#{1,3})\s+\S")
_FENCE = re.compile(r"\s*(```|~~~)")

# The course's reveal template: nbconvert's, with every script loaded from beside the deck.
_TEMPLATE = """{%- extends 'reveal/index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}
<script type="text/x-mathjax-config">
MathJax.Hub.Config({
  tex2jax: {inlineMath: [["$", "$"], ["\\\\(", "\\\\)"]], displayMath: [["$$", "$$"], ["\\\\[", "\\\\]"]],
            processEscapes: true, processEnvironments: true},
  "HTML-CSS": {availableFonts: [], webFont: "STIX-Web", imageFont: null, preferredFont: null},
  messageStyle: "none"
});
</script>
<script src="{{ resources.mathjax_url }}"></script>
{%- endblock html_head_js_mathjax -%}
{%- block html_head_css -%}
<style type="text/css">
.reveal .slides section { text-align: left; }
.reveal .jp-OutputArea-output img { display: block; margin: 0 auto; max-width: 100%; max-height: 600px; }
</style>
{%- endblock html_head_css -%}
{%- block footer_js -%}
<script src="{{ resources.reveal.url_prefix }}/dist/reveal.js"></script>
<script src="{{ resources.reveal.url_prefix }}/plugin/notes/notes.js"></script>
<script>
// A slide whose text runs past the slide's height gets a smaller font, down to 12 px, instead of being cut off.
function fit(slide) {
  for (let px = 20; px >= 12 && slide.scrollHeight > Reveal.getConfig().height; px -= 1) {
    slide.style.setProperty("--jp-content-font-size1", px + "px");
    slide.style.setProperty("--jp-code-font-size", px - 1 + "px");
  }
  Reveal.layout();
}
Reveal.initialize({
  controls: true, progress: true, hash: true, plugins: [RevealNotes],
  transition: "{{ resources.reveal.transition }}", slideNumber: "{{ resources.reveal.number }}",
  width: {{ resources.reveal.width or 960 }}, height: {{ resources.reveal.height or 700 }}
}).then(function () { fit(Reveal.getCurrentSlide()); });
Reveal.on("slidechanged", function (event) {
  if (window.MathJax && MathJax.Hub) {
    MathJax.Hub.Queue(["Rerender", MathJax.Hub, event.currentSlide], [fit, event.currentSlide]);
  } else {
    fit(event.currentSlide);
  }
});
</script>
{%- endblock footer_js -%}
"""


def _blocks(source: str) -> list[str]:
    """The paragraphs of a markdown text: runs of lines between blank lines; a heading line is a block of its own and
    a fenced code block stays whole."""
    blocks: list[str] = []
    current: list[str] = []
    fence = None
    for line in source.splitlines():
        if fence:
            current.append(line)
            fence = None if line.strip().startswith(fence) else fence
        elif match := _FENCE.match(line):
            fence = match.group(1)
            current.append(line)
        elif line.strip() and not _HEADING.match(line):
            current.append(line)
        else:
            if current:
                blocks.append("\n".join(current))
            current = []
            if line.strip():
                blocks.append(line)
    if current:
        blocks.append("\n".join(current))
    return blocks


def _markdown_parts(source: str) -> list[tuple[str, str]]:
    """(text, slide type) for each part a markdown cell becomes under the rule."""
    sections: list[list[str]] = [[]]
    for block in _blocks(source):
        if _HEADING.match(block):
            sections.append([])
        sections[-1].append(block)
    parts: list[tuple[list[str], str]] = []
    for blocks in filter(None, sections):
        predictions = [b for b in blocks if PREDICTION in b]
        others = [b for b in blocks if PREDICTION not in b]
        heading = _HEADING.match(blocks[0])
        if heading:
            kind = "slide" if len(heading.group(1)) <= 2 else "subslide"
            parts += [(others[:2], kind), (others[2:], "notes"), (predictions, "fragment")]
        elif predictions:
            parts += [(predictions, "subslide"), (others, "notes")]
        else:
            parts.append((others, "notes"))
    return [("\n\n".join(blocks), kind) for blocks, kind in parts if blocks] or [(source, "skip")]


def _images(cell: Any) -> list[Any]:
    """The outputs of a code cell that hold an image."""
    return [o for o in cell.get("outputs", []) if any(t in o.get("data", {}) for t in IMAGE_TYPES)]


def slide_type(cell: Any) -> str | None:
    """The slide type a cell's own metadata sets, or None."""
    return cell.get("metadata", {}).get("slideshow", {}).get("slide_type")


def mark_slides(nb: Any) -> Any:
    """A copy of the notebook `nb` cut into slides by the rule in this module's docstring: every cell of the copy has
    `metadata.slideshow.slide_type` set (a markdown cell may become several); `nb` is not modified."""
    deck = copy.deepcopy(nb)
    cells, deck.cells = deck.cells, []
    for cell in cells:
        if slide_type(cell) is not None:
            deck.cells.append(cell)
            continue
        if cell.cell_type == "markdown":
            parts = _markdown_parts(cell.source)
            for number, (text, kind) in enumerate(parts):
                part = copy.deepcopy(cell)
                part.source = text
                if len(parts) > 1 and "id" in part:
                    part.id = f"{cell.id[:56]}-{number}"
                part.metadata["slideshow"] = {"slide_type": kind}
                deck.cells.append(part)
            continue
        images = _images(cell) if cell.cell_type == "code" else []
        if images:
            cell.outputs = images
            cell.metadata["tags"] = [*cell.metadata.get("tags", []), HIDE_INPUT]
        cell.metadata["slideshow"] = {"slide_type": "subslide" if images else "skip"}
        deck.cells.append(cell)
    return deck


def count_slides(deck: Any) -> int:
    """How many slides reveal.js shows for a marked notebook: one per `slide` or `subslide` cell (the first shown cell
    always starts one)."""
    shown = [slide_type(c) or "-" for c in deck.cells if slide_type(c) not in ("skip", "notes")]
    return sum(t in ("slide", "subslide") for t in shown) + (bool(shown) and shown[0] not in ("slide", "subslide"))


def _assets(spec: tuple[str, str, str]) -> Path:
    """The folder of scripts a deck needs, from the package that ships it: a clear error where it is not installed."""
    package, folder, pip_name = spec
    found = importlib.util.find_spec(package)  # located, not imported (sphinx_revealjs would import Sphinx)
    root = Path(found.origin).parent / folder if found and found.origin else None
    if root is None or not root.is_dir():
        raise FileNotFoundError(
            f"{pip_name} is not installed: the decks load {package}'s copy of its scripts offline; "
            "run `pip install -e .[dev]` (or `make setup`)"
        )
    return root


def _exporter() -> Any:
    """nbconvert's slides exporter with the course's template, prompts left out and `remove-input` honoured."""
    from jinja2 import DictLoader
    from nbconvert import SlidesExporter
    from traitlets.config import Config

    config = Config()
    config.TagRemovePreprocessor.enabled = True
    config.TagRemovePreprocessor.remove_input_tags = {HIDE_INPUT}
    return SlidesExporter(
        config=config,
        log=_LOG,
        extra_loaders=[DictLoader({"labcourse-reveal.html.j2": _TEMPLATE})],
        template_file="labcourse-reveal.html.j2",
        reveal_url_prefix="reveal.js",
        reveal_theme=THEME,
        reveal_number="c/t",
        mathjax_url=MATHJAX_URL,
        exclude_input_prompt=True,
        exclude_output_prompt=True,
    )


def render_deck(path: str | Path) -> tuple[str, int]:
    """(the HTML of the deck of the notebook at `path`, its number of slides); a missing or malformed notebook raises
    OSError or ValueError naming it."""
    from labcourse.execute import read_notebook

    path = Path(path)
    deck = mark_slides(read_notebook(path))
    if not any(slide_type(c) not in ("skip", "notes") for c in deck.cells):
        raise ValueError(f"{path} has nothing to show: every cell is skipped or a note")
    title = next((c.source.lstrip("# ") for c in deck.cells if c.cell_type == "markdown" and c.source[:2] == "# "), "")
    if title and "title" not in deck.metadata:
        deck.metadata["title"] = title.splitlines()[0]
    html, _ = _exporter().from_notebook_node(
        deck, resources={"metadata": {"name": path.stem, "path": str(path.parent)}}
    )
    return html, count_slides(deck)


def write_decks(notebooks: Iterable[str | Path], output: str | Path) -> dict[Path, int]:
    """Write `<output>/<name>.slides.html` for each notebook, with the reveal.js and MathJax it loads and the course
    pages it links (the `*.md` beside the notebooks) beside it, and return each deck's number of slides. Every deck
    is made before any file is written: bad input writes nothing."""
    reveal, mathjax = _assets(REVEAL), _assets(MATHJAX)
    notebooks, output = [Path(p) for p in notebooks], Path(output)
    if not notebooks:
        raise ValueError("no notebooks given")
    if same := sorted({p.stem for p in notebooks if [q.stem for q in notebooks].count(p.stem) > 1}):
        raise ValueError(f"two notebooks would write the same deck: {', '.join(same)}")
    decks = {output / f"{p.stem}.slides.html": render_deck(p) for p in notebooks}
    for name in REVEAL_FILES:
        source, target = reveal / name, output / "reveal.js" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            shutil.copyfile(source, target)
    shutil.copytree(mathjax, output / "mathjax", dirs_exist_ok=True)
    for page in {q for p in notebooks for q in p.parent.glob("*.md")}:  # what the decks link: glossary, reading list
        fileio.atomic_write_text(output / page.name, page.read_text(encoding="utf-8"))
    for path, (html, _) in decks.items():
        fileio.atomic_write_text(path, html)
    return {path: count for path, (_, count) in decks.items()}
