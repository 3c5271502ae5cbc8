"""labkit.checks.lab01: one BPE merge and packing a stream into blocks; each check passes the reference answer and
fails the usual wrong answers with a message that says what to fix."""

from __future__ import annotations

import pytest

from labkit import tokenizer
from labkit.checks import core, lab01


def test_merge_pair_check_passes_the_reference():
    assert lab01.check_merge_pair(tokenizer.merge_pair) is tokenizer.merge_pair


def merge_overlapping(word, a, b, new):
    out, i = [], 0
    while i < len(word):
        out.append(new if word[i : i + 2] == (a, b) else word[i])
        i += 1  # the mistake: a match should skip two tokens
    return tuple(out)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (merge_overlapping, "uses up both tokens"),
        (lambda w, a, b, n: tokenizer.merge_pair(w[::-1], b, a, n)[::-1], "left to right"),
        (lambda w, a, b, n: tokenizer.merge_pair(w, b, a, n), "in that order"),
        (lambda w, a, b, n: list(tokenizer.merge_pair(w, a, b, n)) + [0], "return a tuple"),
    ],
)
def test_merge_pair_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab01.check_merge_pair(wrong)


def test_pack_blocks_check_passes_the_reference():
    answer = lambda s, b: [s[i : i + b] for i in range(0, len(s) - b + 1, b)]  # noqa: E731
    assert lab01.check_pack_blocks(answer) is answer


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda s, b: [s[i : i + b] for i in range(0, len(s), b)], "drop the tail"),
        (lambda s, b: [s[i : i + b] for i in range(0, len(s) - b + 1)], "no overlap"),
    ],
)
def test_pack_blocks_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab01.check_pack_blocks(wrong)
