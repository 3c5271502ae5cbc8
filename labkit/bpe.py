"""Byte-level BPE from scratch: train merges, encode, decode, and save as a standard tokenizer.json.

The algorithm is GPT-2's. Text is split into pre-tokens by a regex (words with their leading space,
numbers, punctuation runs, whitespace); each pre-token is a sequence of bytes; training repeatedly
merges the most frequent adjacent pair into a new token. Encoding replays the merges in the order
they were learned. Because the alphabet is all 256 bytes, every string is encodable and decoding is
exactly lossless.

It is written to match Hugging Face `tokenizers` (ByteLevel pre-tokenizer + BpeTrainer): same split
regex, same id order (special tokens, then the 256 bytes sorted by their printable stand-in), same
tie-break between equally frequent pairs (the smaller pair of ids wins), so the two learn the same
merges on the same corpus; `tests/test_bpe.py` checks it.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import operator
from collections import Counter, defaultdict
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

import regex
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers import models as hf_models
from tqdm.auto import tqdm

from labkit.fileio import atomic_write_text

GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_split = regex.compile(GPT2_SPLIT)
DEFAULT_SPECIALS = ("<|endoftext|>",)
Pair = tuple[int, int]  # two adjacent token ids


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (so vocab files hold readable strings)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def to_unicode(token: bytes) -> str:
    """A token's bytes as its printable tokenizer.json string ('Ġthe' for b' the')."""
    table = bytes_to_unicode()
    return "".join(table[b] for b in token)


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def from_unicode(text: str) -> bytes:
    """Inverse of to_unicode."""
    table = _unicode_to_bytes()
    try:
        return bytes(table[c] for c in text)
    except KeyError as err:
        raise ValueError(f"{text!r} is not a byte-level token string (bad character {err.args[0]!r})") from None


def pretokenize(text: str) -> list[str]:
    """Split text into pre-tokens with GPT-2's regex; merges never cross their boundaries."""
    return _split.findall(text)


def _utf8(text: str) -> bytes:
    if not isinstance(text, str):
        raise TypeError(f"expected str, got {type(text).__name__}; decode bytes to str (UTF-8) first")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"text contains an unpaired surrogate {text[err.start]!r} at index {err.start}: it is not "
            "valid Unicode and has no UTF-8 encoding"
        ) from None


def merge_pair(word: tuple[int, ...], a: int, b: int, new: int) -> tuple[int, ...]:
    """One BPE merge in one word: each non-overlapping (a, b), left to right, becomes new."""
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


class BPETokenizer:
    """A byte-level BPE tokenizer: special tokens, 256 byte tokens, then one token per merge."""

    def __init__(self, merges: list[tuple[bytes, bytes]], special_tokens: Iterable[str] = DEFAULT_SPECIALS):
        self.special_tokens = list(special_tokens)
        if len(set(self.special_tokens)) != len(self.special_tokens) or "" in self.special_tokens:
            raise ValueError(f"special tokens must be distinct and non-empty: {self.special_tokens}")
        table = bytes_to_unicode()
        byte_order = sorted(range(256), key=lambda b: table[b])
        self.vocab: list[bytes] = [s.encode("utf-8") for s in self.special_tokens]
        self.vocab += [bytes([b]) for b in byte_order]
        self.byte_id = {b: len(self.special_tokens) + i for i, b in enumerate(byte_order)}
        ids = {tok: i for i, tok in enumerate(self.vocab)}
        self.merges: list[tuple[bytes, bytes]] = []
        self.ranks: dict[tuple[int, int], tuple[int, int]] = {}  # (a, b) -> (rank, merged id)
        for a, b in merges:
            if a not in ids or b not in ids:
                raise ValueError(f"merge {a!r} + {b!r} uses a token not defined by an earlier merge")
            new = ids.get(a + b)
            if new is None:
                new = ids[a + b] = len(self.vocab)
                self.vocab.append(a + b)
            self.ranks[(ids[a], ids[b])] = (len(self.merges), new)
            self.merges.append((a, b))
        self.special_ids = {s: i for i, s in enumerate(self.special_tokens)}
        longest_first = sorted(self.special_tokens, key=len, reverse=True)
        self._special_split = (
            regex.compile("(" + "|".join(map(regex.escape, longest_first)) + ")") if self.special_tokens else None
        )
        self._cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)

    @property
    def fingerprint(self) -> str:
        """Short digest of the merges and special tokens: shards record it to detect a tokenizer mismatch."""
        payload = json.dumps([self.special_tokens, [to_unicode(a) + " " + to_unicode(b) for a, b in self.merges]])
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ encode / decode

    def _encode_pretoken(self, piece: str) -> list[int]:
        cached = self._cache.get(piece)
        if cached is not None:
            return cached
        word = [self.byte_id[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            # The pair learned earliest (lowest rank) is merged first, as in training.
            rank, pair = min((self.ranks.get(p, (float("inf"), 0))[0], p) for p in zip(word, word[1:]))
            if rank == float("inf"):
                break
            word = list(merge_pair(tuple(word), *pair, self.ranks[pair][1]))
        if len(self._cache) < 200_000:
            self._cache[piece] = word
        return word

    def encode(self, text: str) -> list[int]:
        """Token ids of text; special-token strings in the text become their special ids."""
        _utf8(text)  # reject unpaired surrogates up front, with their position
        parts = self._special_split.split(text) if self._special_split else [text]
        ids: list[int] = []
        for part in parts:
            if part in self.special_ids:
                ids.append(self.special_ids[part])
            elif part:
                for piece in pretokenize(part):
                    ids += self._encode_pretoken(piece)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids; exact inverse of encode. Invalid UTF-8 from arbitrary ids becomes U+FFFD."""
        checked = []
        for i in ids:  # Python, NumPy or 0-d torch integers
            index = operator.index(i) if hasattr(i, "__index__") and not isinstance(i, bool) else None
            if index is None or not 0 <= index < self.vocab_size:
                raise ValueError(f"token id {i!r} is not in the vocabulary: ids are ints in [0, {self.vocab_size})")
            checked.append(index)
        return b"".join(self.vocab[i] for i in checked).decode("utf-8", errors="replace")

    def tokens(self, text: str) -> list[str]:
        """The pieces text is split into, as readable strings (to see how a rare word splits)."""
        return [self.vocab[i].decode("utf-8", errors="backslashreplace") for i in self.encode(text)]

    # ------------------------------------------------------------------ tokenizer.json

    def to_hf(self):
        """The same tokenizer as a Hugging Face `tokenizers.Tokenizer` (ByteLevel BPE)."""
        vocab = {
            to_unicode(tok) if i >= len(self.special_tokens) else self.special_tokens[i]: i
            for i, tok in enumerate(self.vocab)
        }
        merges = [(to_unicode(a), to_unicode(b)) for a, b in self.merges]
        tok = Tokenizer(hf_models.BPE(vocab=vocab, merges=merges))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in self.special_tokens])
        return tok

    def save(self, path: str | Path) -> Path:
        """Write tokenizer.json (atomically) in the format `tokenizers` and transformers read."""
        return atomic_write_text(path, self.to_hf().to_str(pretty=True))

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        """Read a byte-level BPE tokenizer.json (ours, or one made by `tokenizers` the same way)."""
        spec = json.loads(Path(path).read_text(encoding="utf-8"))
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or (spec.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
            raise ValueError(f"{path}: not a byte-level BPE tokenizer.json")
        merges = [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
        specials = [t["content"] for t in sorted(spec.get("added_tokens", []), key=lambda t: t["id"])]
        tok = cls([(from_unicode(a), from_unicode(b)) for a, b in merges], specials)
        if tok.to_hf().get_vocab() != model["vocab"]:
            raise ValueError(f"{path}: vocabulary ids do not follow from the merges (not made by this recipe)")
        return tok


def train_bpe(
    texts: Iterable[str], vocab_size: int, special_tokens: Iterable[str] = DEFAULT_SPECIALS, progress: bool = True
) -> BPETokenizer:
    """Learn merges until the vocabulary (specials + 256 bytes + merges) reaches vocab_size."""
    special_tokens = _check_training_input(texts, vocab_size, special_tokens)
    base = BPETokenizer([], special_tokens)  # the special tokens and the 256 bytes, no merge yet
    counts = count_pretokens(texts)
    words = [tuple(base.byte_id[b] for b in w.encode("utf-8")) for w in counts]
    merges = learn_merges(words, list(counts.values()), base.vocab, vocab_size, progress)
    return BPETokenizer(merges, special_tokens)


def _check_training_input(texts: Iterable[str], vocab_size: int, special_tokens: Iterable[str]) -> list[str]:
    if isinstance(texts, (str, bytes)):
        raise TypeError("texts must be an iterable of strings (documents), not one string: pass [text]")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):  # torchutil.is_int, without torch
        raise TypeError(f"vocab_size must be an int, got {vocab_size!r}")
    special_tokens = [special_tokens] if isinstance(special_tokens, str) else list(special_tokens)
    if vocab_size < 256 + len(special_tokens):
        raise ValueError(
            f"vocab_size {vocab_size} is too small: byte-level BPE needs 256 byte tokens plus "
            f"{len(special_tokens)} special token(s) = {256 + len(special_tokens)} before any merge"
        )
    return special_tokens


def count_pretokens(texts: Iterable[str]) -> Counter[str]:
    """How often each pre-token occurs in the documents: training handles each distinct one once, weighted."""
    counts: Counter[str] = Counter()
    for text in texts:
        _utf8(text)
        counts.update(pretokenize(text))
    if not counts:
        raise ValueError("cannot train a tokenizer on an empty corpus")
    return counts


def learn_merges(
    words: list[tuple[int, ...]], freqs: list[int], vocab: list[bytes], vocab_size: int, progress: bool = True
) -> list[tuple[bytes, bytes]]:
    """The BPE loop: merge the most frequent pair of ids into a new token until there are vocab_size tokens."""
    words, vocab = list(words), list(vocab)
    ids = {tok: i for i, tok in enumerate(vocab)}
    pair_counts, where = count_pairs(words, freqs)
    # Max-heap by count; among equal counts the smaller pair of ids comes first (as in `tokenizers`).
    heap = [(-c, p) for p, c in pair_counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[bytes, bytes]] = []
    bar = tqdm(total=vocab_size - len(vocab), desc="BPE merges", disable=not progress, leave=False)
    while len(ids) < vocab_size and (pair := pop_most_frequent(heap, pair_counts)) is not None:
        a, b = pair
        merged = vocab[a] + vocab[b]
        new = ids.get(merged)
        if new is None:  # two different pairs can spell the same bytes: reuse the token
            new = ids[merged] = len(vocab)
            vocab.append(merged)
            bar.update(1)
        merges.append((vocab[a], vocab[b]))
        for p in merge_words(words, freqs, pair, new, pair_counts, where):
            if pair_counts.get(p, 0) > 0:
                heapq.heappush(heap, (-pair_counts[p], p))
    bar.close()
    return merges


def count_pairs(
    words: list[tuple[int, ...]], freqs: list[int]
) -> tuple[defaultdict[Pair, int], defaultdict[Pair, set[int]]]:
    """How often each adjacent pair occurs (each word counted freqs times), and the indices of the words holding it."""
    pair_counts: defaultdict[Pair, int] = defaultdict(int)
    where: defaultdict[Pair, set[int]] = defaultdict(set)
    for i, w in enumerate(words):
        for p in zip(w, w[1:]):
            pair_counts[p] += freqs[i]
            where[p].add(i)
    return pair_counts, where


def pop_most_frequent(heap: list[tuple[int, Pair]], pair_counts: dict[Pair, int]) -> Pair | None:
    """Pop the most frequent pair (the smaller one on a tie) off the heap of (-count, pair); None once it is empty."""
    while heap:
        neg, pair = heapq.heappop(heap)
        count = pair_counts.get(pair, 0)
        if -neg == count:
            return pair
        if count > 0:  # stale entry, its count changed since it was pushed: push it back at its count now
            heapq.heappush(heap, (-count, pair))
    return None


def merge_words(
    words: list[tuple[int, ...]],
    freqs: list[int],
    pair: Pair,
    new: int,
    pair_counts: defaultdict[Pair, int],
    where: defaultdict[Pair, set[int]],
) -> set[Pair]:
    """Merge pair into new in every word that holds it, keeping pair_counts and where current; the pairs it touched."""
    touched = set()
    for i in where.pop(pair):  # only the words that hold the pair are revisited
        old, f = words[i], freqs[i]
        updated = merge_pair(old, *pair, new)
        if updated == old:
            continue
        for p in zip(old, old[1:]):
            pair_counts[p] -= f
            touched.add(p)
        for p in zip(updated, updated[1:]):
            pair_counts[p] += f
            where[p].add(i)
            touched.add(p)
        words[i] = updated
    pair_counts.pop(pair, None)
    return touched


def train_hf_bpe(texts: Iterable[str], vocab_size: int, special_tokens: Iterable[str] = DEFAULT_SPECIALS):
    """The library baseline: Hugging Face `tokenizers` BPE, configured exactly like train_bpe."""
    tok = Tokenizer(hf_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def hf_merges(tok) -> list[tuple[bytes, bytes]]:
    """The merges of a `tokenizers` ByteLevel BPE, as byte pairs (to compare with BPETokenizer.merges)."""
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(from_unicode(x) for x in (m.split(" ") if isinstance(m, str) else m)) for m in merges]
