"""Corpus cleaning as a real pipeline does it: normalize, filter by length, drop exact and near duplicates.

Each step returns the documents it keeps; `clean_corpus` runs them in order and reports what each
removed, so a lab can show where the data went.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
import zlib
from dataclasses import dataclass

import numpy as np

_CONTROL = re.compile(r"[^\S\n\t ]|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")  # odd spaces, control chars
_SPACES = re.compile(r"[ \t]+")
_BLANK_LINES = re.compile(r"\n{3,}")


def normalize_text(text: str) -> str:
    """NFC, control characters dropped, unusual spaces made plain, runs of spaces and blank lines collapsed."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub(lambda m: " " if m.group().isspace() else "", text)
    text = _SPACES.sub(" ", text)
    text = "\n".join(line.strip() for line in text.split("\n"))
    return _BLANK_LINES.sub("\n\n", text).strip()


def length_filter(texts: list[str], min_chars: int = 1, max_chars: int | None = None) -> list[str]:
    """Keep documents with min_chars <= len <= max_chars (too short: boilerplate; too long: dumps)."""
    if min_chars < 0 or (max_chars is not None and max_chars < min_chars):
        raise ValueError(f"need 0 <= min_chars <= max_chars, got {min_chars}, {max_chars}")
    return [t for t in texts if len(t) >= min_chars and (max_chars is None or len(t) <= max_chars)]


def exact_dedup(texts: list[str]) -> list[str]:
    """Drop documents identical to an earlier one (after normalization)."""
    seen: set[bytes] = set()
    kept = []
    for t in texts:
        key = hashlib.sha1(t.encode("utf-8")).digest()
        if key not in seen:
            seen.add(key)
            kept.append(t)
    return kept


# ----------------------------------------------------------------------------- MinHash near-duplicates

_PRIME = 4_294_967_291  # largest prime below 2**32: a*x + b stays below 2**64 for 32-bit a, b, x


def shingles(text: str, n: int = 5) -> set[int]:
    """Hashed word n-grams of the lowercased text (the whole text if it has fewer than n words)."""
    words = text.lower().split()
    grams = [" ".join(words[i : i + n]) for i in range(max(1, len(words) - n + 1))]
    return {zlib.crc32(g.encode("utf-8")) for g in grams}


class MinHasher:
    """MinHash signatures: for random hash functions h, P[min h(A) = min h(B)] = Jaccard(A, B)."""

    def __init__(self, num_perm: int = 128, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.a = rng.integers(1, _PRIME, size=num_perm, dtype=np.uint64)
        self.b = rng.integers(0, _PRIME, size=num_perm, dtype=np.uint64)

    def signature(self, hashed: set[int]) -> np.ndarray:
        x = np.fromiter(hashed, dtype=np.uint64, count=len(hashed))[:, None]
        return ((x * self.a + self.b) % _PRIME).min(axis=0)


def estimated_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    """Share of agreeing MinHash values: an unbiased estimate of the Jaccard similarity."""
    return float(np.mean(sig_a == sig_b))


def near_dedup(
    texts: list[str], threshold: float = 0.8, num_perm: int = 128, bands: int = 16, ngram: int = 5, seed: int = 0
) -> list[str]:
    """Drop documents whose shingle Jaccard similarity with an earlier kept one reaches `threshold`.

    Locality-sensitive hashing keeps it near-linear: signatures are cut into `bands` bands, and only
    documents sharing a whole band are compared (likely when similarity > (1/bands)**(bands/num_perm)).
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    if num_perm % bands:
        raise ValueError(f"bands ({bands}) must divide num_perm ({num_perm})")
    hasher, rows = MinHasher(num_perm, seed), num_perm // bands
    buckets: dict[tuple[int, bytes], list[int]] = {}
    kept_sigs: list[np.ndarray] = []
    kept: list[str] = []
    for text in texts:
        sig = hasher.signature(shingles(text, ngram))
        keys = [(band, sig[band * rows : (band + 1) * rows].tobytes()) for band in range(bands)]
        candidates = {j for key in keys for j in buckets.get(key, ())}
        if any(estimated_jaccard(sig, kept_sigs[j]) >= threshold for j in candidates):
            continue
        for key in keys:
            buckets.setdefault(key, []).append(len(kept))
        kept_sigs.append(sig)
        kept.append(text)
    return kept


# ----------------------------------------------------------------------------- the pipeline


@dataclass
class StepReport:
    """What one cleaning step did."""

    step: str
    docs_in: int
    docs_out: int
    chars_in: int
    chars_out: int

    @property
    def docs_removed(self) -> int:
        return self.docs_in - self.docs_out

    def __str__(self) -> str:
        return (
            f"{self.step:<18} {self.docs_in:>7} -> {self.docs_out:>7} documents "
            f"(-{self.docs_removed}), {self.chars_in - self.chars_out:>9,} characters removed"
        )


def clean_corpus(
    texts: list[str], *, min_chars: int = 64, max_chars: int | None = 100_000, near_dup_threshold: float = 0.8
) -> tuple[list[str], list[StepReport]]:
    """Normalize, length-filter, exact-dedup and near-dedup; return the kept texts and a report per step."""
    steps = [
        ("normalize", lambda ts: [normalize_text(t) for t in ts]),
        ("length filter", lambda ts: length_filter(ts, min_chars, max_chars)),
        ("exact duplicates", exact_dedup),
        ("near duplicates", lambda ts: near_dedup(ts, threshold=near_dup_threshold)),
    ]
    reports = []
    for name, step in steps:
        out = step(texts)
        reports.append(StepReport(name, len(texts), len(out), sum(map(len, texts)), sum(map(len, out))))
        texts = out
    return texts, reports


def contaminate(
    texts: list[str], n_exact: int = 20, n_near: int = 20, n_short: int = 20, seed: int = 0
) -> tuple[list[str], dict[str, int]]:
    """Inject known dirt into a clean corpus: exact copies, one-word edits, short stubs, messy Unicode.

    Returns the dirty corpus and how many of each kind went in, so a cleaning run can be scored.
    Near-duplicates are made only from documents of 120+ words, where one changed word keeps the
    5-gram Jaccard similarity near 0.92, clearly above the default 0.8 threshold.
    """
    rng = np.random.default_rng(seed)
    long_docs = [t for t in texts if len(t.split()) >= 120]
    if n_exact > len(texts) or n_near > len(long_docs):
        raise ValueError("not enough documents to copy from")
    dirty = list(texts)
    for i in rng.choice(len(texts), n_exact, replace=False):
        dirty.append(texts[i])
    for i in rng.choice(len(long_docs), n_near, replace=False):
        words = long_docs[i].split(" ")
        words[int(rng.integers(len(words)))] = "CHANGED"
        dirty.append(" ".join(words))
    for k in range(n_short):
        dirty.append(f"Stub article {k}.")
    # The same text, spelled messily: decomposed accents, a no-break space, control characters.
    dirty[:n_exact] = [t.replace("é", "e\u0301").replace(" ", "\u00a0 ", 1) + "\x00\n\n\n" for t in dirty[:n_exact]]
    order = rng.permutation(len(dirty))
    return [dirty[i] for i in order], {"exact": n_exact, "near": n_near, "short": n_short}
