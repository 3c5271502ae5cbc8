"""labcourse.checks.lab01: one BPE merge and packing a stream into blocks; each check passes an answer written here
from the definition (not labkit's), whose values on small inputs are computed by hand, and fails the usual wrong
answers with a message that says what to fix."""

from __future__ import annotations

import pytest

from labcourse.checks import core, lab01


def merge_by_hand(word, a, b, new):
    if len(word) < 2:
        return tuple(word)
    if tuple(word[:2]) == (a, b):  # a match uses up both tokens
        return (new, *merge_by_hand(word[2:], a, b, new))
    return (word[0], *merge_by_hand(word[1:], a, b, new))


def test_hand_written_merge_by_hand():
    assert merge_by_hand((5, 5, 5), 5, 5, 9) == (9, 5)
    assert merge_by_hand((1, 2, 1, 2), 1, 2, 9) == (9, 9)
    assert merge_by_hand((2, 1), 1, 2, 9) == (2, 1)


def test_merge_pair_check_passes_a_hand_written_answer():
    assert lab01.check_merge_pair(merge_by_hand) is merge_by_hand


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
        (lambda w, a, b, n: merge_by_hand(w[::-1], b, a, n)[::-1], "left to right"),
        (lambda w, a, b, n: merge_by_hand(w, b, a, n), "in that order"),
        (lambda w, a, b, n: list(merge_by_hand(w, a, b, n)) + [0], "return a tuple"),
    ],
)
def test_merge_pair_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab01.check_merge_pair(wrong)


def pack_by_hand(stream, size):
    return [stream[i * size : (i + 1) * size] for i in range(len(stream) // size)]


def test_pack_blocks_check_passes_a_hand_written_answer():
    assert pack_by_hand(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the tail 8, 9 is dropped
    assert lab01.check_pack_blocks(pack_by_hand) is pack_by_hand


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
