"""`labcourse slides`: the rule that cuts a notebook into slides (on a small notebook, hand-checked), a real lab's deck
(its headings, predictions and figures, offline), bad input, and the deck in headless Chromium."""

from __future__ import annotations

import copy
import json
import re
import time
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output, new_raw_cell

from labcourse import cli, slides
from tests.test_browser import CHROMEDRIVER, CHROMIUM, SCREENSHOTS, browser  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "labs" / "02_mixed_precision.ipynb"  # math, predictions inside heading cells and alone, six figures
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg=="


def _small_notebook() -> nbformat.NotebookNode:
    figure = [
        new_output("stream", name="stdout", text="printed beside the figure\n"),
        new_output("display_data", data={"image/png": PNG, "text/plain": "<Figure>"}),
    ]
    cells = [
        new_markdown_cell("# Title\n\nLead.\n\nMore prose."),
        new_code_cell("x = 1", outputs=[new_output("stream", name="stdout", text="1\n")]),
        new_markdown_cell("## Section\n\nIntro.\n\n**Predict before you run.** How much?\n\nAfter the run."),
        new_code_cell("plot_marker()", outputs=copy.deepcopy(figure)),
        new_markdown_cell("Loose prose.\n\n### Sub\nSub lead.\n\n```python\n# a comment, not a heading\n```"),
        new_markdown_cell("**Predict before you run.** Which is faster?\n\nSome context."),
        new_markdown_cell("## Curated away\n\nText.", metadata={"slideshow": {"slide_type": "skip"}}),
        new_code_cell(
            "author_kept_source()", outputs=copy.deepcopy(figure), metadata={"slideshow": {"slide_type": "fragment"}}
        ),
        new_raw_cell("raw text"),
    ]
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


# (cell type, source, slide type) of each cell of the small notebook's deck, worked out by hand from the rule
EXPECTED = [
    ("markdown", "# Title\n\nLead.", "slide"),
    ("markdown", "More prose.", "notes"),
    ("code", "x = 1", "skip"),
    ("markdown", "## Section\n\nIntro.", "slide"),
    ("markdown", "After the run.", "notes"),
    ("markdown", "**Predict before you run.** How much?", "fragment"),
    ("code", "plot_marker()", "subslide"),
    ("markdown", "Loose prose.", "notes"),
    ("markdown", "### Sub\n\nSub lead.", "subslide"),
    ("markdown", "```python\n# a comment, not a heading\n```", "notes"),
    ("markdown", "**Predict before you run.** Which is faster?", "subslide"),
    ("markdown", "Some context.", "notes"),
    ("markdown", "## Curated away\n\nText.", "skip"),
    ("code", "author_kept_source()", "fragment"),
    ("raw", "raw text", "skip"),
]


def test_the_rule_on_a_small_notebook():
    nb = _small_notebook()
    before = copy.deepcopy(nb)
    deck = slides.mark_slides(nb)
    assert nb == before  # the notebook itself is not modified
    assert [(c.cell_type, c.source, slides.slide_type(c)) for c in deck.cells] == EXPECTED
    nbformat.validate(deck)
    assert len({c.id for c in deck.cells}) == len(deck.cells)
    figure, kept = deck.cells[6], deck.cells[13]
    assert figure.metadata["tags"] == [slides.HIDE_INPUT]  # only the figure shows
    assert [o.output_type for o in figure.outputs] == ["display_data"]
    assert "tags" not in kept.metadata and len(kept.outputs) == 2  # the author's cell stays as the author left it
    assert slides.count_slides(deck) == 5  # Title, Section, the figure, Sub, the lone prediction


def test_count_slides_counts_a_first_shown_cell_that_sets_no_slide():
    nb = new_notebook(cells=[new_markdown_cell("a", metadata={"slideshow": {"slide_type": "-"}})])
    assert slides.count_slides(nb) == 1
    nb.cells.append(new_markdown_cell("b", metadata={"slideshow": {"slide_type": "subslide"}}))
    assert slides.count_slides(nb) == 2


def _body(html: str) -> str:
    return html[html.index("<body") :]


def _input_areas(html: str) -> int:
    """How many cells show their code in a deck."""
    return len(re.findall(r'class="[^"]*\bjp-InputArea-editor\b', _body(html)))


def test_the_small_notebooks_deck_hides_the_figures_code_and_keeps_the_authors_choice(tmp_path):
    source = tmp_path / "small.ipynb"
    nbformat.write(_small_notebook(), source)
    counts = slides.write_decks([source], tmp_path / "out")
    html = (tmp_path / "out" / "small.slides.html").read_text()
    assert counts == {tmp_path / "out" / "small.slides.html": 5}
    assert "plot_marker" not in html and "x = 1" not in html and "Curated away" not in html
    assert "author_kept_source" in html and _input_areas(html) == 1  # the author's fragment shows its code
    assert html.count(f"data:image/png;base64,{PNG}") == 2
    assert _body(html).count("printed beside the figure") == 1  # the author's cell's, not the marked figure's
    assert _body(html).index('<aside class="notes">') < _body(html).index("More prose.")


class _Page(HTMLParser):
    """What a deck loads (src of any element, href of <link>, url() and @import in CSS), its images, its headings' text
    and the number of slides reveal.js shows (sections that hold no section)."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.loads, self.images, self.headings, self.leaves = [], [], [], 0
        self._heading, self._style, self._sections = None, False, [False]
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.loads += [attrs["src"]] if attrs.get("src") else []
        self.images += [attrs.get("src", "")] if tag == "img" else []
        self.loads += [attrs["href"]] if tag == "link" and attrs.get("href") else []
        self.loads += _css_loads(attrs.get("style") or "")
        if tag == "section":
            self._sections[-1] = True  # the enclosing section holds one
            self._sections.append(False)
        self._style = tag == "style"
        self._heading = "" if tag in ("h1", "h2", "h3") else self._heading

    def handle_endtag(self, tag):
        if tag == "section":
            self.leaves += not self._sections.pop()
        if tag in ("h1", "h2", "h3") and self._heading is not None:
            self.headings.append(self._heading.replace("¶", "").strip())
            self._heading = None

    def handle_data(self, data):
        if self._heading is not None:
            self._heading += data
        if self._style:
            self.loads += _css_loads(data)


def _css_loads(css: str) -> list[str]:
    """What a style sheet loads: its url(...) and its @import "..." targets."""
    pairs = re.findall(r"url\(([^)]*)\)|@import\s+[\"']([^\"']+)", css)
    return [(url or imported).strip("'\" ") for url, imported in pairs]


def _remote(loads: list[str]) -> list[str]:
    return [u for u in loads if re.match(r"(https?:)?//", u.strip(), re.I)]


def test_the_remote_check_finds_planted_loads_and_passes_links_a_reader_clicks():
    html = (
        "<link rel='stylesheet' href='https://cdn.example/x.css'><script src='//cdn.example/x.js'></script>"
        "<style>@import url(https://fonts.example/f.css); b {background: url('img/x.png')}</style>"
        "<p style='background: url(http://a.example/b.png)'><a href='https://arxiv.org/abs/1'>paper</a></p>"
        "<img src='data:image/png;base64,AA'><script src='reveal.js/dist/reveal.js'></script>"
    )
    assert _remote(_Page(html).loads) == [
        "https://cdn.example/x.css",
        "//cdn.example/x.js",
        "https://fonts.example/f.css",
        "http://a.example/b.png",
    ]


def _markdown_headings(nb) -> list[str]:
    """The `#` to `###` headings of a notebook's markdown, outside fenced code."""
    found, fence = [], False
    for cell in nb.cells:
        for line in cell.source.splitlines() if cell.cell_type == "markdown" else []:
            fence ^= line.lstrip().startswith("```")
            if not fence and (m := re.match(r"#{1,3}\s+(.*)", line)):
                found.append(m.group(1).strip())
    return found


@pytest.fixture(scope="module")
def lab_deck(tmp_path_factory):
    out = tmp_path_factory.mktemp("slides")
    counts = slides.write_decks([LAB], out)
    return out, counts[out / f"{LAB.stem}.slides.html"], (out / f"{LAB.stem}.slides.html").read_text()


def test_a_labs_deck_shows_its_headings_predictions_and_figures(lab_deck):
    out, count, html = lab_deck
    nb = nbformat.read(LAB, as_version=4)
    page = _Page(html)
    assert page.headings == _markdown_headings(nb)  # every heading, in order, and nothing else
    assert 10 <= count <= 40 and page.leaves == count
    assert html.count('class="fragment"') >= 3 and html.count("Predict before you run.") == 4
    images = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    assert images >= 1 and sum(u.startswith("data:image/png;base64,") for u in page.images) == images
    assert _input_areas(html) == 0  # no code: the figures show without theirs
    for page in LAB.parent.glob("*.md"):  # the glossary and reading list the deck links, beside it
        assert (out / page.name).read_text() == page.read_text()
    assert "$2^{-24}" in html  # math is left to MathJax, which the deck loads from beside it


def test_a_labs_deck_loads_nothing_from_the_network(lab_deck):
    out, _, html = lab_deck
    loads = _Page(html).loads
    assert not _remote(loads), _remote(loads)
    for load in loads:  # everything else is written beside the deck (or inline)
        if not load.startswith(("data:", "#")):
            assert (out / load.split("?")[0]).is_file(), load
    for css in (out / "reveal.js").rglob("*.css"):  # the theme's fonts are local too
        assert not _remote(_css_loads(css.read_text())), css


def _written(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_bad_input_is_a_clear_error_and_writes_nothing(tmp_path, monkeypatch):
    out = tmp_path / "out"
    (tmp_path / "list.ipynb").write_text("[]")
    (tmp_path / "text.ipynb").write_text("not json")
    silent = new_notebook(cells=[new_code_cell("x = 1")])
    nbformat.write(silent, tmp_path / "silent.ipynb")
    with pytest.raises(FileNotFoundError, match="missing.ipynb"):
        slides.write_decks([LAB, tmp_path / "missing.ipynb"], out)  # a good lab before it: not written either
    with pytest.raises(ValueError, match="list.ipynb is not a notebook"):
        slides.write_decks([tmp_path / "list.ipynb"], out)
    with pytest.raises(ValueError, match="text.ipynb is not a notebook: it is not UTF-8 JSON"):
        slides.write_decks([tmp_path / "text.ipynb"], out)
    with pytest.raises(ValueError, match="silent.ipynb has nothing to show"):
        slides.write_decks([tmp_path / "silent.ipynb"], out)
    with pytest.raises(ValueError, match="no notebooks given"):
        slides.write_decks([], out)
    with pytest.raises(ValueError, match="two notebooks would write the same deck: 02_mixed_precision"):
        slides.write_decks([LAB, tmp_path / LAB.name], out)
    monkeypatch.setattr(slides, "REVEAL", ("no_such_package_here", "static", "sphinx-revealjs"))
    with pytest.raises(FileNotFoundError, match=r"sphinx-revealjs is not installed.*pip install -e \.\[dev\]"):
        slides.write_decks([LAB], out)
    assert _written(tmp_path) == ["list.ipynb", "silent.ipynb", "text.ipynb"]


def test_the_command_writes_a_deck_and_says_how_many_slides(tmp_path, capsys):
    source = tmp_path / "small.ipynb"
    nbformat.write(_small_notebook(), source)
    assert cli.main(["slides", str(source), "--output", str(tmp_path / "decks")]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'decks' / 'small.slides.html'}: 5 slides\n"
    assert {"small.slides.html", "reveal.js", "mathjax"} <= {p.name for p in (tmp_path / "decks").iterdir()}


# The deck in a browser: reveal.js starts from the files beside the deck, with no network. Lab 08 has the course's
# longest slide text after its heading (section 1), which must be fitted to the slide, and figures.
BROWSER_LAB = ROOT / "labs" / "08_lora_finetuning.ipynb"

_DECK_STATE = """
const ready = typeof Reveal !== 'undefined' && Reveal.isReady();
return {
  ready: ready,
  slides: ready ? Reveal.getTotalSlides() : null,
  current: ready ? Reveal.getIndices() : null,
  mathjax: typeof MathJax !== 'undefined' && !!MathJax.Hub,
  remote: performance.getEntriesByType('resource').map(e => e.name).filter(n => !/^(file|data):/.test(n)),
};
"""

_SLIDES = """
return [...document.querySelectorAll('.reveal .slides section')].filter(s => !s.querySelector('section'))
  .map(s => [Reveal.getIndices(s).h, Reveal.getIndices(s).v, !!s.querySelector('img')]);
"""

_SHOWN = """
Reveal.slide(arguments[0], arguments[1], 99);  // every fragment shown
const slide = Reveal.getCurrentSlide(), img = slide.querySelector('img');
const box = img ? img.getBoundingClientRect() : null;
return {fits: slide.scrollHeight <= Reveal.getConfig().height, height: slide.scrollHeight,
        image: box && {complete: img.complete, natural: img.naturalWidth, width: box.width,
                       inside: box.top >= 0 && box.bottom <= window.innerHeight}};
"""


def _deck_failure(driver, why: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOTS / "slides_failure.png"
    driver.save_screenshot(str(shot))
    state = driver.execute_script(_DECK_STATE)
    pytest.fail(f"{why}; deck state {json.dumps(state)}. Screenshot {shot.relative_to(ROOT)}", pytrace=False)


def _until(driver, script: str, args: tuple, done, timeout: float):
    """Run `script` until `done(result)` or `timeout` seconds; the last result."""
    deadline = time.monotonic() + timeout
    while not done(result := driver.execute_script(script, *args)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return result


@pytest.mark.slow
@pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs Debian's chromium and chromium-driver (apt install chromium chromium-driver)",
)
def test_a_deck_renders_offline_in_headless_chromium(tmp_path, browser):  # noqa: F811 (the fixture)
    deck = tmp_path / f"{BROWSER_LAB.stem}.slides.html"
    count = slides.write_decks([BROWSER_LAB], tmp_path)[deck]
    browser.get(deck.as_uri())
    state = _until(browser, _DECK_STATE, (), lambda s: s["ready"], 60)
    if not state["ready"]:
        _deck_failure(browser, "reveal.js was not ready within 60 s")
    if state["slides"] != count or count < 10:
        _deck_failure(browser, f"the deck shows {state['slides']} slides, the rule made {count}")
    figures = 0
    for h, v, has_image in browser.execute_script(_SLIDES):  # each slide fits; each figure shows whole, once in place
        shown = _until(browser, _SHOWN, (h, v), lambda s: s["fits"] and (s["image"] or {"inside": True})["inside"], 10)
        if not shown["fits"] or (has_image and not (shown["image"]["complete"] and shown["image"]["inside"])):
            _deck_failure(browser, f"slide {h}/{v} does not show whole: {shown}")
        figures += has_image
    state = browser.execute_script(_DECK_STATE)
    if not figures or not state["mathjax"] or state["remote"]:
        _deck_failure(
            browser, f"{figures} figures, MathJax loaded {state['mathjax']}, loaded remotely {state['remote']}"
        )
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SCREENSHOTS / "slides_last.png"))
