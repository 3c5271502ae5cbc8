"""Byte-level BPE: exact parity with `tokenizers`, lossless round trips, tokenizer.json, clear errors."""

import heapq
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit import bpe as T
from labkit.data import load_corpus
from tests.permissions import UMASK_CASES, modes, umask


@pytest.fixture(scope="module")
def corpus():
    return load_corpus("wiki", "train")[:300]


@pytest.fixture(scope="module")
def bpe(corpus):
    return T.train_bpe(corpus, 700, progress=False)


def test_merges_equal_huggingface_tokenizers(corpus, bpe):
    hf = T.train_hf_bpe(corpus, 700)
    assert len(bpe.merges) == 700 - 257
    assert bpe.merges == T.hf_merges(hf)
    assert bpe.to_hf().get_vocab() == hf.get_vocab()


unicode_text = st.lists(
    st.one_of(
        st.text(st.characters(blacklist_categories=("Cs",)), max_size=20),  # any code point but surrogates
        st.sampled_from(
            ["é", "e\u0301", "🦙", "👩\u200d👩\u200d👧", "中文", "  ", "\n\n", "\t", "'s", "<|endoftext|>"]
            + ["\x00", "\x1b[0m", "\r\n", "\u200b", "\ufeff", "ǅ", "\U0010fffd"]  # controls, invisibles, planes
        ),
    ),
    max_size=12,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=unicode_text)
def test_encode_decode_is_lossless_and_matches_the_library(bpe, text):
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert ids == bpe.to_hf().encode(text).ids


def test_special_tokens_are_atomic(bpe):
    ids = bpe.encode("end.<|endoftext|>Next")
    assert ids.count(bpe.special_ids["<|endoftext|>"]) == 1
    assert bpe.decode(ids) == "end.<|endoftext|>Next"


def test_rare_words_split_into_known_pieces(bpe):
    assert bpe.tokens(" the") == [" the"]
    pieces = bpe.tokens(" Zyzzyva")
    assert len(pieces) > 1 and "".join(pieces) == " Zyzzyva"


def test_save_load_round_trip_and_transformers_reads_it(tmp_path, bpe):
    from transformers import PreTrainedTokenizerFast

    path = bpe.save(tmp_path / "tokenizer.json")
    loaded = T.BPETokenizer.load(path)
    assert loaded.merges == bpe.merges and loaded.special_tokens == bpe.special_tokens
    assert loaded.fingerprint == bpe.fingerprint
    text = "Tokenizers turn text into integers: naïve café 🦙."
    fast = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")
    assert fast(text)["input_ids"] == bpe.encode(text)
    assert fast.decode(bpe.encode(text)) == text


def test_fingerprint_tells_tokenizers_apart(corpus, bpe):
    other = T.train_bpe(corpus, 600, progress=False)
    assert other.fingerprint != bpe.fingerprint


def test_load_rejects_foreign_and_tampered_files(tmp_path, bpe):
    wordpiece = tmp_path / "wp.json"
    wordpiece.write_text(json.dumps({"model": {"type": "WordPiece"}, "pre_tokenizer": None}))
    with pytest.raises(ValueError, match="not a byte-level BPE"):
        T.BPETokenizer.load(wordpiece)
    spec = json.loads(bpe.to_hf().to_str())
    first = next(k for k, v in spec["model"]["vocab"].items() if v == 300)
    spec["model"]["vocab"][first] = 301
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="do not follow from the merges"):
        T.BPETokenizer.load(tampered)


def test_bad_input_is_rejected_clearly(bpe):
    with pytest.raises(ValueError, match=r"unpaired surrogate '\\ud800' at index 2"):
        bpe.encode("ab\ud800c")
    with pytest.raises(TypeError, match="decode bytes"):
        bpe.encode(b"bytes")
    with pytest.raises(TypeError, match="decode bytes"):
        T.train_bpe([b"caf\xe9"], 300)  # raw (here Latin-1) bytes: decode to str first
    with pytest.raises(ValueError, match=r"too small.*257"):
        T.train_bpe(["text"], 256)
    with pytest.raises(ValueError, match="empty corpus"):
        T.train_bpe([], 300)
    with pytest.raises(ValueError, match="empty corpus"):
        T.train_bpe(["", ""], 300)
    with pytest.raises(ValueError, match=r"token id 1000000000 is not in the vocabulary.*\[0, "):
        bpe.decode([10**9])
    with pytest.raises(ValueError, match="token id -1 is not in the vocabulary"):
        bpe.decode([5, -1])  # not the last token, as Python's negative indexing would give
    ids = bpe.encode("hello")
    assert bpe.decode(np.array(ids)) == bpe.decode(torch.tensor(ids)) == "hello"  # NumPy and torch integers
    with pytest.raises(ValueError, match="distinct"):
        T.BPETokenizer([], ["<s>", "<s>"])


def test_training_stops_when_no_pair_is_left():
    tok = T.train_bpe(["ab ab"], 1000, progress=False)  # pre-tokens "ab" and " ab"
    assert tok.merges == [(b"a", b"b"), (b" ", b"ab")] == T.hf_merges(T.train_hf_bpe(["ab ab"], 1000))
    assert tok.vocab_size == 257 + 2  # each pre-token is one token: nothing left to merge


def test_merge_words_keeps_the_pair_counts_equal_to_a_recount():
    words, freqs = [(1, 2, 1, 2, 3), (2, 1, 2), (1, 2), (3, 3)], [2, 5, 1, 4]
    pair_counts, where = T.count_pairs(words, freqs)
    assert dict(pair_counts) == {(1, 2): 2 * 2 + 5 + 1, (2, 1): 2 + 5, (2, 3): 2, (3, 3): 4}  # by hand
    touched = T.merge_words(words, freqs, (1, 2), 9, pair_counts, where)
    assert words == [(9, 9, 3), (2, 9), (9,), (3, 3)]
    recount, rewhere = T.count_pairs(words, freqs)
    assert {p: c for p, c in pair_counts.items() if c} == dict(recount)  # the incremental counts, and a recount
    assert all(rewhere[p] <= where[p] for p in rewhere)  # every word holding a pair is still found under it
    assert touched == {(1, 2), (2, 1), (2, 3), (9, 9), (9, 3), (2, 9)}


def test_pop_most_frequent_skips_stale_entries_and_breaks_ties_by_the_smaller_pair():
    counts = {(5, 6): 3, (1, 2): 3, (0, 9): 1}
    heap = [(-7, (5, 6)), (-3, (1, 2)), (-1, (0, 9)), (-4, (8, 8))]  # (5, 6) was 7 and (8, 8) is gone
    heapq.heapify(heap)
    assert [T.pop_most_frequent(heap, counts) for _ in range(4)] == [(1, 2), (5, 6), (0, 9), None]


@pytest.mark.parametrize("mask, file_mode, dir_mode", UMASK_CASES)
def test_saved_tokenizers_get_the_modes_the_umask_gives(tmp_path, mask, file_mode, dir_mode):
    bpe = T.train_bpe(["hello world"] * 3, 270, progress=False)
    with umask(mask):
        bpe.save(tmp_path / "tok" / "tokenizer.json")
    assert modes(tmp_path / "tok") == {".": dir_mode, "tokenizer.json": file_mode}
