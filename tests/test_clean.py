"""Cleaning: each step does what it says, and the pipeline removes exactly the injected dirt."""

import pytest

from labkit import clean
from labkit.data import load_corpus


def test_normalize_text():
    messy = "  Cafe\u0301\u00a0 au\tlait\x00 \r\n\n\n\nnext  line 👩\u200d👩\u200d👧 "
    assert clean.normalize_text(messy) == "Café au lait\n\nnext line 👩\u200d👩\u200d👧"
    assert clean.normalize_text("already clean.") == "already clean."


def test_length_filter_bounds_and_errors():
    assert clean.length_filter(["a", "abc", "abcdef"], min_chars=2, max_chars=4) == ["abc"]
    with pytest.raises(ValueError, match="min_chars <= max_chars"):
        clean.length_filter([], min_chars=5, max_chars=2)


def test_exact_dedup_keeps_first_occurrence_in_order():
    assert clean.exact_dedup(["b", "a", "b", "c", "a"]) == ["b", "a", "c"]


def test_minhash_estimates_jaccard():
    a, b = set(range(0, 1000)), set(range(500, 1500))  # Jaccard = 500 / 1500 = 1/3
    hasher = clean.MinHasher(num_perm=256, seed=1)
    est = clean.estimated_jaccard(hasher.signature(a), hasher.signature(b))
    assert abs(est - 1 / 3) < 0.1
    assert clean.estimated_jaccard(hasher.signature(a), hasher.signature(a)) == 1.0


def test_near_dedup_drops_edits_keeps_distinct_documents():
    base = " ".join(f"word{i}" for i in range(100))
    edited = base.replace("word50", "other")
    distinct = " ".join(f"term{i}" for i in range(100))
    assert clean.near_dedup([base, edited, distinct]) == [base, distinct]
    with pytest.raises(ValueError, match="threshold"):
        clean.near_dedup([base], threshold=0)
    with pytest.raises(ValueError, match="divide"):
        clean.near_dedup([base], num_perm=100, bands=16)


def test_pipeline_removes_exactly_the_injected_dirt():
    texts = load_corpus("wiki", "validation")
    original, _ = clean.clean_corpus(texts)
    dirty, injected = clean.contaminate(original, seed=3)
    kept, reports = clean.clean_corpus(dirty)
    removed = {r.step: r.docs_removed for r in reports}
    assert removed["length filter"] == injected["short"]
    assert removed["exact duplicates"] == injected["exact"]  # the messy copies match after normalization
    assert removed["near duplicates"] == injected["near"]
    assert len(kept) == len(original)  # one survivor per duplicate group (the first one seen)
    # and the right ones: every original text, except where its one-word edit came first and stands for it
    extra, lost = set(kept) - set(original), set(original) - set(kept)
    assert len(set(kept)) == len(kept) and len(extra) == len(lost) <= injected["near"]
    for edit in extra:
        words = edit.split(" ")
        assert "CHANGED" in words and any(
            sum(a != b for a, b in zip(words, o.split(" "))) == 1 and len(o.split(" ")) == len(words) for o in lost
        ), edit[:80]
    assert not any(t.startswith("Stub article") for t in kept)
    assert [r.docs_out for r in reports][-1] == len(kept)
    assert "normalize" in str(reports[0])


def test_contaminate_is_seeded():
    texts = load_corpus("wiki", "train")[:400]
    assert clean.contaminate(texts, seed=1) == clean.contaminate(texts, seed=1)
    assert clean.contaminate(texts, seed=1)[0] != clean.contaminate(texts, seed=2)[0]
    assert len(clean.contaminate(texts)[0]) == 400 + 60
