"""Lab 01's exercise checks: one BPE merge, blocks."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from labcourse.checks.core import CheckFailed, as_rows, call_answer, goes_on_with, report_passed
from labkit import bpe, data


def _merge_overlapping(word: tuple[int, ...], a: int, b: int, new: int) -> tuple[int, ...]:
    """The usual wrong answer: after a match, step one token instead of two."""
    return tuple(new if (x, y) == (a, b) else x for x, y in zip(word, word[1:] + (None,)))


def _merge_right_to_left(word: tuple[int, ...], a: int, b: int, new: int) -> tuple[int, ...]:
    return bpe.merge_pair(word[::-1], b, a, new)[::-1]


@goes_on_with(bpe.merge_pair, "bpe.merge_pair")
def check_merge_pair(fn: Callable[[tuple[int, ...], int, int, int], tuple[int, ...]]) -> Callable:
    """Lab 01: fn(word, a, b, new) replaces each (a, b) in `word`, left to right, without overlaps, by `new`."""
    exercise = "exercise 01.1 (one BPE merge)"
    cases = [
        ((1, 2, 3), 1, 2, 9),
        ((1, 2, 1, 2), 1, 2, 9),
        ((2, 1), 1, 2, 9),
        ((), 1, 2, 9),
        ((1,), 1, 2, 9),
        ((3, 1, 2, 4, 1, 2), 1, 2, 7),
        ((5, 5, 5), 5, 5, 9),
        ((5, 5, 5, 5), 5, 5, 9),
    ]
    mistakes = {
        _merge_overlapping: "a merged pair uses up both tokens: jump past b before looking for the next pair",
        _merge_right_to_left: "scan left to right: in (5, 5, 5) the first two 5s merge",
    }
    for word, a, b, new in cases:
        expected = bpe.merge_pair(word, a, b, new)
        got = call_answer(exercise, fn, word, a, b, new)
        got = tuple(got) if isinstance(got, (tuple, list)) else got
        if got != expected:
            hint = next(
                (h for wrong, h in mistakes.items() if wrong(word, a, b, new) == got),
                "every (a, b) in that order becomes `new`; everything else is copied; return a tuple",
            )
            raise CheckFailed(
                f"{exercise}: merging {(a, b)} -> {new} in {word} should give {expected}, got {got}; hint: {hint}"
            )
    return report_passed(exercise, len(cases))


def _pack_blocks(stream: list[int], size: int) -> list[list[int]]:
    """labkit's answer to exercise 01.2, in the exercise's signature."""
    return data.pack_blocks(np.array(stream), size).tolist()


@goes_on_with(_pack_blocks, "data.pack_blocks")
def check_pack_blocks(fn: Callable[[list[int], int], list[list[int]]]) -> Callable:
    """Lab 01: fn(stream, block_size) cuts a token stream into full blocks, dropping the tail."""
    exercise = "exercise 01.2 (packing a stream into blocks)"
    cases = [(list(range(10)), 4), (list(range(8)), 4), (list(range(5)), 5), (list(range(7)), 1)]
    for stream, size in cases:
        expected = _pack_blocks(stream, size)
        got = call_answer(exercise, fn, list(stream), size)
        got = as_rows(got, list)
        if got != expected:
            if isinstance(got, list) and got[: len(expected)] == expected and len(got) > len(expected):
                hint = (
                    "drop the tail that does not fill a block: a short or padded last block would put "
                    "padding (or a different length) into every epoch"
                )
            else:
                hint = "block i is stream[i · block_size : (i + 1) · block_size], one after the other, no overlap"
            raise CheckFailed(
                f"{exercise}: a stream of {len(stream)} tokens in blocks of {size}: expected "
                f"{expected}, got {got}; hint: {hint}"
            )
    return report_passed(exercise, len(cases))
