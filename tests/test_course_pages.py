"""labs/glossary.md and labs/reading.md (and the start page that links them), the pages beside the lab notebooks,
so that a lab's relative link `glossary.md#lora` resolves wherever the notebooks and the pages sit together (on
GitHub, in labs/).

Every local link resolves (the file, and for a Markdown file the heading anchor GitHub gives it); every URL is https
and well formed, an arXiv one the abstract page; the glossary is alphabetical under a letter index, and each entry
names the lab that defines it, whose markdown really uses the term; the reading list has a section per lab, in lab
order, each entry with a link and what to read. The labs' side: each term is linked where the course first uses it,
and each lab ends with a pointer to its reading-list section (a new term or lab needs its link written where the term
first appears). Each check is a function returning its problems, run on the real pages and on planted faults."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import nbformat
import pytest

from labcourse.student import HIDDEN  # cells the student build drops: a link there would vanish

LABS_DIR = Path(__file__).resolve().parents[1] / "labs"
PAGES = ("glossary.md", "reading.md", "START_HERE.md")  # the start page links both, the labs and their runs
ARXIV = re.compile(r"https://arxiv\.org/abs/\d{4}\.\d{4,5}")
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]*)\)")


def labs(folder: Path = LABS_DIR) -> list[Path]:
    """The lab notebooks of a folder, in lab order."""
    return sorted(folder.glob("[0-9][0-9]_*.ipynb"))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading (github-slugger): lower case, every character but letters, digits, spaces,
    hyphens and underscores dropped, spaces turned into hyphens ("Lab 00 — Your machine": "lab-00--your-machine")."""
    kept = (c for c in heading.strip().lower() if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return "".join(kept).replace(" ", "-")


def blank(match: re.Match[str]) -> str:
    """The matched text with everything but newlines turned into spaces (positions kept)."""
    return re.sub(r"[^\n]", " ", match.group(0))


def without_code(markdown: str) -> str:
    """The markdown with fenced code blocks and code spans blanked out."""
    markdown = re.sub(r"^(```|~~~).*?^\1[^\n]*$", blank, markdown, flags=re.M | re.S)
    return re.sub(r"(`+).+?\1", blank, markdown, flags=re.S)


def headings(markdown: str) -> list[tuple[int, str, str]]:
    """(level, text, anchor) of every heading, anchors numbered -1, -2 … on repeats as GitHub does."""
    seen: dict[str, int] = {}
    found = []
    for line in without_code(markdown).splitlines():
        m = re.match(r"(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(2))
            found.append((len(m.group(1)), m.group(2), base if base not in seen else f"{base}-{seen[base]}"))
            seen[base] = seen.get(base, 0) + 1
    return found


def links(markdown: str) -> list[tuple[str, str]]:
    """(text, target) of every inline link or image outside code."""
    return [(m.group(1), m.group(2)) for m in LINK.finditer(without_code(markdown))]


def local_link_problems(markdown: str, here: Path) -> list[str]:
    """Links of a page in folder `here` whose file is missing, or whose #anchor no heading of that Markdown file has."""
    problems = []
    for text, target in links(markdown):
        if urlsplit(target).scheme or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = here / path if path else None
        if file is not None and not file.is_file():
            problems.append(f"[{text}]({target}): no file {path}")
        elif anchor and (file is None or file.suffix == ".md"):
            page = file.read_text(encoding="utf-8") if file else markdown
            if anchor not in {a for _, _, a in headings(page)}:
                problems.append(f"[{text}]({target}): no heading with anchor #{anchor} in {path or 'this page'}")
    return problems


def url_problems(markdown: str) -> list[str]:
    """External links that are not https with a host, or arXiv links that are not an abstract page, and any URL
    written bare instead of as a link."""
    problems = []
    for text, target in links(markdown):
        parts = urlsplit(target)
        if not parts.scheme:
            continue
        if parts.scheme != "https" or "." not in parts.netloc:
            problems.append(f"[{text}]({target}): not an https URL with a host")
        elif parts.netloc.endswith("arxiv.org") and not ARXIV.fullmatch(target):
            problems.append(f"[{text}]({target}): an arXiv link must be https://arxiv.org/abs/NNNN.NNNNN")
    bare = re.findall(r"(?<![(<])\bhttps?://\S+", LINK.sub("", without_code(markdown)))
    return problems + [f"bare URL {url}: write it as a link" for url in bare]


def kept_markdown(notebook: Path) -> list[str]:
    """The sources of the markdown cells the student build keeps, in order."""
    cells = nbformat.read(str(notebook), as_version=4).cells
    return [c.source for c in cells if c.cell_type == "markdown" and HIDDEN not in c.metadata.get("tags", [])]


def lab_title(notebook: Path) -> str:
    """'Lab NN — short title': the lab's first heading up to its first colon."""
    h1 = next(line for source in kept_markdown(notebook) for line in source.splitlines() if line.startswith("# "))
    return h1[2:].split(":")[0].strip()


def letter(heading: str) -> str:
    """The index section an entry belongs in."""
    return heading[0].upper() if heading[0].isalpha() else "0–9"


def case_sensitive(term: str) -> bool:
    """Mixed-case names (ZeRO, LoRA, GPipe) are matched as written; everything else ignores case."""
    return any(c.isupper() for c in term[1:]) and any(c.islower() for c in term)


def term_pattern(terms: tuple[str, ...]) -> re.Pattern[str]:
    """Any of the terms as a whole word (a line may wrap between its words), not part of a longer word, a hyphenated
    word, a path or a file name."""
    words = {t: r"\s+".join(map(re.escape, t.split())) for t in terms}
    alternatives = [words[t] if case_sensitive(t) else f"(?i:{words[t]})" for t in sorted(terms, key=len, reverse=True)]
    return re.compile(r"(?<![\w\-./])(?:" + "|".join(alternatives) + r")(?![\w-]|\.\w)")


NOT_PROSE = [  # in order, each applied to the text with the earlier matches blanked
    re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S),  # fenced code
    re.compile(r"(?:(?<=\n\n)|\A)(?:(?: {4}|\t)[^\n]*(?:\n|\Z))+"),  # indented code after a blank line
    re.compile(r"(`+).+?\1", re.S),  # code spans
    re.compile(r"\$\$.+?\$\$", re.S),  # display LaTeX
    re.compile(r"\$[^$\n]+\$"),  # inline LaTeX
    LINK,  # links and images: their text is another page's already
    re.compile(r"<!--.*?-->", re.S),  # HTML comments
    re.compile(r"<[^>\n]+>"),  # HTML tags and autolinks
    re.compile(r"https?://\S+"),  # bare URLs
    re.compile(r"^#{1,6}\s.*$", re.M),  # headings
    re.compile(r'"[^"]{1,200}"'),  # quoted text: titles, messages, words quoted as words
]


def prose(markdown: str) -> str:
    """The markdown with everything a term link may not go into blanked out (positions kept)."""
    for pattern in NOT_PROSE:
        markdown = pattern.sub(blank, markdown)
    return markdown


def uses(markdown: str, pattern: re.Pattern[str]) -> list[re.Match[str]]:
    """The pattern's matches in the prose of the markdown (none that spans a blanked-out stretch)."""
    return [m for m in pattern.finditer(prose(markdown)) if markdown[m.start() : m.end()] == m.group(0)]


@dataclass(frozen=True)
class Entry:
    heading: str
    anchor: str
    terms: tuple[str, ...]  # the heading (without a trailing parenthesis), then the *Also:* forms
    defined_in: tuple[tuple[str, str], ...]  # (link text, target) of its "Defined in" links
    section: str  # the `##` letter section it sits under


def entries(glossary: str) -> list[Entry]:
    """The `###` entries of the glossary, in page order."""
    anchors = iter(a for level, _, a in headings(glossary) if level == 3)
    found, section = [], ""
    for block in re.split(r"^(?=#{2,3} )", glossary, flags=re.M):
        title, _, body = block.partition("\n")
        if title.startswith("## "):
            section = title[3:].strip()
        elif title.startswith("### "):
            heading = title[4:].strip()
            also = re.search(r"^\*also:\*\s*(.+?)\.?\s*$", body, flags=re.M | re.I)
            terms = [re.sub(r"\s*\([^)]*\)$", "", heading)]
            terms += [t.strip() for t in also.group(1).split(",")] if also else []
            defined = re.search(r"^Defined in (.+)$", body, flags=re.M)
            found.append(
                Entry(heading, next(anchors), tuple(terms), tuple(links(defined.group(1)) if defined else ()), section)
            )
    return found


def glossary_problems(glossary: str, lab_paths: list[Path]) -> list[str]:
    """Entries out of alphabetical order or under the wrong letter, letters missing from the index, repeated anchors,
    and entries that name no lab, a lab that does not exist, a lab under another title, or a lab whose markdown never
    uses the term."""
    found = entries(glossary)
    problems = [
        f"{b.heading!r} comes after {a.heading!r}: entries are sorted alphabetically"
        for a, b in zip(found, found[1:])
        if b.heading.casefold() < a.heading.casefold()
    ]
    problems += [
        f"{e.heading!r} sits under '## {e.section}', not '## {letter(e.heading)}'"
        for e in found
        if e.section != letter(e.heading)
    ]
    index = next((line for line in glossary.splitlines() if "](#" in line), "")  # the letter index
    sections = [text for level, text, _ in headings(glossary) if level == 2]
    problems += [f"the letter index lacks [{s}](#{slug(s)})" for s in sections if f"[{s}](#{slug(s)})" not in index]
    anchors = [e.anchor for e in found]
    problems += [
        f"anchor #{a} repeats: two entries read alike" for a in sorted({a for a in anchors if anchors.count(a) > 1})
    ]
    titles = {p.name: lab_title(p) for p in lab_paths}
    markdown = {p.name: "\n\n".join(kept_markdown(p)) for p in lab_paths}
    for e in found:
        if len(e.defined_in) != 1:
            problems.append(
                f"{e.heading!r} names {len(e.defined_in)} defining labs, not one: 'Defined in [Lab NN — title](…)'"
            )
            continue
        text, target = e.defined_in[0]
        if target not in titles:
            problems.append(f"{e.heading!r} is defined in {target}, which is no lab")
        elif text != titles[target]:
            problems.append(f"{e.heading!r} links {target} as {text!r}, but that lab is {titles[target]!r}")
        elif not term_pattern(e.terms).search(markdown[target]):
            problems.append(f"{e.heading!r}: {target} never uses any of {list(e.terms)}")
    return problems


def reading_problems(reading: str, lab_paths: list[Path]) -> list[str]:
    """A lab without its `## Lab NN — title` section (in lab order), a section without entries, and an entry without
    a link or without a *read:* naming what to read."""
    sections = re.split(r"^## ", reading, flags=re.M)[1:]
    titles = [s.partition("\n")[0].strip() for s in sections]
    expected = [lab_title(p) for p in lab_paths]
    problems = [f"no section '## {t}' for {p.name}" for t, p in zip(expected, lab_paths) if t not in titles]
    problems += [f"section '## {t}' is no lab's title" for t in titles if t not in expected]
    if not problems and titles != expected:
        problems.append(f"sections are not in lab order: {titles}")
    for title, section in zip(titles, sections):
        items = re.findall(r"^- (.*(?:\n  .*)*)", section, flags=re.M)
        if not items:
            problems.append(f"section '## {title}' lists nothing")
        for item in items:
            where = f"'## {title}': {item[:60]!r}"
            if not any(urlsplit(target).scheme == "https" for _, target in links(item)):
                problems.append(f"{where} has no https link")
            if not re.search(r"\bread:", item, flags=re.I):
                problems.append(f"{where} does not say what to read ('read: …')")
    return problems


def lab_link_problems(lab_paths: list[Path]) -> list[str]:
    """Links from the labs' markdown to a missing file or anchor (the glossary's terms, the reading list's sections)."""
    return [
        f"{p.name}: {problem}"
        for p in lab_paths
        for problem in local_link_problems("\n\n".join(kept_markdown(p)), p.parent)
    ]


def unlinked_first_uses(glossary: str, lab_paths: list[Path]) -> list[str]:
    """Terms whose first lab (in lab order) to use them — in prose, or by a link to their entry — has no link to it."""
    problems = []
    cells = {p: kept_markdown(p) for p in lab_paths}
    raw = {p: "\n\n".join(cells[p]) for p in lab_paths}
    for e in entries(glossary):
        pattern, target = term_pattern(e.terms), f"](glossary.md#{e.anchor})"
        first = next((p for p in lab_paths if target in raw[p] or any(uses(s, pattern) for s in cells[p])), None)
        if first is not None and target not in raw[first]:
            problems.append(f"{e.heading!r}: first used in {first.name}, which does not link glossary.md#{e.anchor}")
    return problems


def missing_reading_pointers(lab_paths: list[Path]) -> list[str]:
    """Labs whose last markdown cell does not point to their section of the reading list."""
    return [
        f"{p.name} does not end by linking reading.md#{slug(lab_title(p))}"
        for p in lab_paths
        if f"](reading.md#{slug(lab_title(p))})" not in kept_markdown(p)[-1]
    ]


# --------------------------------------------------------------------------------------------------------- the pages


def test_the_labs_and_pages_are_found():
    assert len(labs()) >= 11, labs()  # an empty glob would check nothing
    assert all((LABS_DIR / page).is_file() for page in PAGES)


@pytest.mark.parametrize("page", PAGES)
def test_every_local_link_resolves(page):
    assert local_link_problems((LABS_DIR / page).read_text(encoding="utf-8"), LABS_DIR) == []


@pytest.mark.parametrize("page", PAGES)
def test_every_url_is_https_and_well_formed(page):
    assert url_problems((LABS_DIR / page).read_text(encoding="utf-8")) == []


def test_the_glossary_is_sorted_indexed_and_names_the_lab_that_uses_each_term():
    glossary = (LABS_DIR / "glossary.md").read_text(encoding="utf-8")
    assert len(entries(glossary)) >= 80
    assert glossary_problems(glossary, labs()) == []


def test_every_lab_has_a_reading_section_with_what_to_read():
    assert reading_problems((LABS_DIR / "reading.md").read_text(encoding="utf-8"), labs()) == []


def test_the_pages_links_resolve_in_a_students_working_copy(tmp_path):
    from labcourse.student import workspace

    workspace(LABS_DIR, tmp_path / "lab")  # what `make lab` serves: JupyterLab's root, nothing above it
    for page in PAGES:
        assert local_link_problems((tmp_path / "lab" / page).read_text(encoding="utf-8"), tmp_path / "lab") == []


def test_the_labs_links_to_the_pages_resolve():
    assert lab_link_problems(labs()) == []


def test_each_term_is_linked_where_the_course_first_uses_it():
    assert unlinked_first_uses((LABS_DIR / "glossary.md").read_text(encoding="utf-8"), labs()) == []


def test_each_lab_ends_with_a_pointer_to_its_reading_list():
    assert missing_reading_pointers(labs()) == []


# ------------------------------------------------------------------------------------------------------ planted faults


def test_slugs_are_githubs():
    assert slug("Lab 00 — Your machine") == "lab-00--your-machine"
    assert slug("N:M sparsity") == "nm-sparsity"
    assert slug("torch.compile") == "torchcompile"
    assert slug("0–9") == "09"
    assert slug("Lab 03 — Gradient accumulation, exactly") == "lab-03--gradient-accumulation-exactly"
    assert [a for _, _, a in headings("# Notes\n## Notes\n```\n# not a heading\n```\n### Notes")] == [
        "notes",
        "notes-1",
        "notes-2",
    ]


def test_term_matching_skips_code_links_headings_latex_and_quotes():
    pattern = term_pattern(("LoRA", "all-reduce", "all-reduces", "activation checkpointing"))
    text = (
        '## LoRA in a heading\n\nThe `LoRA` call, [LoRA](x.md), $LoRA$, "LoRA" quoted, lora in lower case,\n'
        "all-reduce-free, file.all-reduce, LoRALinear, and then activation\ncheckpointing and LoRA's all-reduces."
    )
    found = [m.group(0) for m in uses(text, pattern)]
    assert found == ["activation\ncheckpointing", "LoRA", "all-reduces"]


def _mini_course(tmp_path: Path) -> Path:
    """Two labs, a three-entry glossary and a reading list that pass every check."""
    for name, cells in {
        "00_intro.ipynb": ["# Lab 00 — Intro: start here", "We time a kernel and measure perplexity.", "## Summary"],
        "01_data.ipynb": ["# Lab 01 — Data", "A BPE tokenizer, and perplexity again.", "## Summary"],
    }.items():
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(c) for c in cells])
        nbformat.write(nb, str(tmp_path / name))
    entry = "### {}\n\nA definition.\n\n*Also:* {}.\n\nDefined in [{}]({}).\n"
    (tmp_path / "glossary.md").write_text(
        "# Glossary\n\n[B](#b) · [K](#k) · [P](#p)\n\n"
        + "## B\n\n" + entry.format("BPE", "byte-pair encoding", "Lab 01 — Data", "01_data.ipynb")
        + "\n## K\n\n" + entry.format("Kernel", "kernels", "Lab 00 — Intro", "00_intro.ipynb")
        + "\n## P\n\n" + entry.format("Perplexity", "perplexities", "Lab 00 — Intro", "00_intro.ipynb"),
        encoding="utf-8",
    )  # fmt: skip
    item = "- Someone, 2020: [A paper](https://arxiv.org/abs/2001.00001) — *read:* §2.\n"
    (tmp_path / "reading.md").write_text(
        f"# Reading\n\nSee the [glossary](glossary.md#bpe).\n\n## Lab 00 — Intro\n\n{item}\n## Lab 01 — Data\n\n{item}",
        encoding="utf-8",
    )
    return tmp_path


def _check(folder: Path) -> list[str]:
    glossary, reading = (folder / "glossary.md").read_text(), (folder / "reading.md").read_text()
    return (
        local_link_problems(glossary, folder)
        + local_link_problems(reading, folder)
        + url_problems(glossary + reading)
        + glossary_problems(glossary, labs(folder))
        + reading_problems(reading, labs(folder))
    )


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def test_the_mini_course_passes(tmp_path):
    assert _check(_mini_course(tmp_path)) == []


@pytest.mark.parametrize(
    ("page", "old", "new", "problem"),
    [
        ("reading.md", "(glossary.md#bpe)", "(glossary.md#bpee)", "no heading with anchor #bpee"),
        ("reading.md", "(glossary.md#bpe)", "(glosary.md#bpe)", "no file glosary.md"),
        ("glossary.md", "(01_data.ipynb)", "(02_model.ipynb)", "is defined in 02_model.ipynb, which is no lab"),
        ("glossary.md", "[Lab 01 — Data]", "[Lab 01 — Tokens]", "but that lab is 'Lab 01 — Data'"),
        ("glossary.md", "### Kernel", "### Zkernel", "'Perplexity' comes after 'Zkernel'"),
        ("glossary.md", "### Kernel", "### Attention", "'Attention' sits under '## K'"),
        ("glossary.md", " · [P](#p)", "", "the letter index lacks [P](#p)"),
        ("glossary.md", "[Lab 01 — Data](01_data.ipynb)", "[Lab 00 — Intro](00_intro.ipynb)", "never uses any"),
        ("glossary.md", "Defined in [Lab 01 — Data](01_data.ipynb).", "", "'BPE' names 0 defining labs"),
        ("reading.md", "## Lab 01 — Data", "## Lab 01 — Tokens", "no section '## Lab 01 — Data' for 01_data.ipynb"),
        ("reading.md", " — *read:* §2.\n\n## Lab 01", ".\n\n## Lab 01", "does not say what to read"),
        ("reading.md", "https://arxiv.org/abs/2001.00001) — *read:* §2.\n\n## Lab 01",
         "https://arxiv.org/pdf/2001.00001) — *read:* §2.\n\n## Lab 01", "must be https://arxiv.org/abs/NNNN.NNNNN"),
        ("reading.md", "(https://arxiv.org/abs/2001.00001) — *read:* §2.\n\n## Lab 01",
         "(http://example.org/p) — *read:* §2.\n\n## Lab 01", "not an https URL"),
        ("reading.md", "See the", "See https://example.org and the", "bare URL https://example.org"),
    ],
)  # fmt: skip
def test_a_planted_fault_is_found(tmp_path, page, old, new, problem):
    folder = _mini_course(tmp_path)
    _edit(folder / page, old, new)
    found = _check(folder)
    assert any(problem in p for p in found), found


def test_a_missing_reading_section_for_a_new_lab_is_found(tmp_path):
    folder = _mini_course(tmp_path)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Lab 02 — Model")])
    nbformat.write(nb, str(folder / "02_model.ipynb"))
    assert reading_problems((folder / "reading.md").read_text(), labs(folder)) == [
        "no section '## Lab 02 — Model' for 02_model.ipynb"
    ]


def _set_markdown(notebook: Path, cells: list[str]) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(c) for c in cells])
    nbformat.write(nb, str(notebook))


def test_first_uses_and_reading_pointers_are_checked_in_the_labs(tmp_path):
    folder = _mini_course(tmp_path)
    glossary = (folder / "glossary.md").read_text()
    assert unlinked_first_uses(glossary, labs(folder)) == [
        "'BPE': first used in 01_data.ipynb, which does not link glossary.md#bpe",
        "'Kernel': first used in 00_intro.ipynb, which does not link glossary.md#kernel",
        "'Perplexity': first used in 00_intro.ipynb, which does not link glossary.md#perplexity",
    ]
    assert missing_reading_pointers(labs(folder)) == [
        "00_intro.ipynb does not end by linking reading.md#lab-00--intro",
        "01_data.ipynb does not end by linking reading.md#lab-01--data",
    ]
    _set_markdown(
        folder / "00_intro.ipynb",
        [
            "# Lab 00 — Intro: start here",
            "We time a [kernel](glossary.md#kernel) and measure [perplexity](glossary.md#perplexity).",
            "## Summary\n\nFurther reading: [papers](reading.md#lab-00--intro).",
        ],
    )
    _set_markdown(
        folder / "01_data.ipynb",
        [
            "# Lab 01 — Data",
            "A [BPE](glossary.md#bpe) tokenizer, and perplexity again.",
            "## Summary\n\nFurther reading: [papers](reading.md#lab-01--data).",
        ],
    )
    assert unlinked_first_uses(glossary, labs(folder)) == []
    assert missing_reading_pointers(labs(folder)) == []
    assert lab_link_problems(labs(folder)) == []
    # the link belongs where the term is first used: in lab 00, not only in a later lab
    _set_markdown(
        folder / "00_intro.ipynb",
        [
            "# Lab 00 — Intro: start here",
            "We time a [kernel](glossary.md#kernel); BPE comes next lab.",
            "## Summary\n\nFurther reading: [papers](reading.md#lab-00--intro).",
        ],
    )
    assert unlinked_first_uses(glossary, labs(folder)) == [
        "'BPE': first used in 00_intro.ipynb, which does not link glossary.md#bpe",
        "'Perplexity': first used in 01_data.ipynb, which does not link glossary.md#perplexity",
    ]
    _edit(folder / "00_intro.ipynb", "(glossary.md#kernel)", "(glossary.md#kernels)")
    assert lab_link_problems(labs(folder)) == [
        "00_intro.ipynb: [kernel](glossary.md#kernels): no heading with anchor #kernels in glossary.md"
    ]
