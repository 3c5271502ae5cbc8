"""labcourse.checks.lab04: one reduce-scatter and one all-gather step of the ring; each check passes an answer
written here from the definition (not labkit's), whose values on small inputs are computed by hand, and fails the
usual wrong answers with a message that says what to fix."""

from __future__ import annotations

import pytest
import torch

from labcourse.checks import core, lab04


def reduce_scatter_by_hand(chunks, step):
    """Every rank r sends chunk (r − step) mod p to rank r + 1, which adds it to its own copy."""
    world = len(chunks)
    out = [list(row) for row in chunks]
    for r in range(world):
        c = (r - step) % world
        out[(r + 1) % world][c] = chunks[(r + 1) % world][c] + chunks[r][c]
    return out


def all_gather_by_hand(chunks, step):
    """Every rank r passes the finished chunk (r + 1 − step) mod p to rank r + 1, which replaces its copy."""
    world = len(chunks)
    out = [list(row) for row in chunks]
    for r in range(world):
        c = (r + 1 - step) % world
        out[(r + 1) % world][c] = chunks[r][c]
    return out


def test_ring_by_hand_on_two_ranks():
    a0, a1, b0, b1 = (torch.tensor([float(v)]) for v in (1, 2, 10, 20))
    after = reduce_scatter_by_hand([[a0, a1], [b0, b1]], 0)
    assert [[t.item() for t in row] for row in after] == [[1, 22], [11, 20]]  # rank 0 owns chunk 1, rank 1 chunk 0
    done = all_gather_by_hand(after, 0)
    assert [[t.item() for t in row] for row in done] == [[11, 22], [11, 22]]


def test_reduce_scatter_check_passes_a_hand_written_answer():
    assert lab04.check_reduce_scatter_step(reduce_scatter_by_hand) is reduce_scatter_by_hand


def step_overwriting(chunks, step):
    world = len(chunks)
    out = [list(row) for row in chunks]
    for r in range(world):
        c = (r - step) % world
        out[(r + 1) % world][c] = chunks[r][c]
    return out


def step_leftwards(chunks, step):
    world = len(chunks)
    out = [list(row) for row in chunks]
    for r in range(world):
        c = (r - step) % world
        out[(r - 1) % world][c] = chunks[(r - 1) % world][c] + chunks[r][c]
    return out


def step_wrong_chunk(chunks, step):
    world = len(chunks)
    out = [list(row) for row in chunks]
    for r in range(world):
        c = (r + step) % world
        out[(r + 1) % world][c] = chunks[(r + 1) % world][c] + chunks[r][c]
    return out


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (step_overwriting, "adds the incoming chunk"),
        (step_leftwards, "to rank \\(r \\+ 1\\) mod p"),
        (step_wrong_chunk, "sends chunk \\(r − s\\) mod p"),
        (lambda chunks, step: chunks[:-1], "one list of"),
    ],
)
def test_reduce_scatter_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab04.check_reduce_scatter_step(wrong)


def gather_adding(chunks, step):
    world = len(chunks)
    out = [list(row) for row in chunks]
    for r in range(world):
        c = (r + 1 - step) % world
        out[(r + 1) % world][c] = chunks[(r + 1) % world][c] + chunks[r][c]
    return out


def test_all_gather_check_passes_a_hand_written_answer():
    assert lab04.check_all_gather_step(all_gather_by_hand) is all_gather_by_hand


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (gather_adding, "replaces its copy, it does not add"),
        (lambda chunks, step: chunks, "sends the finished chunk \\(r \\+ 1 − s\\) mod p"),
        (lambda chunks, step: chunks[1:], "one list of"),
    ],
)
def test_all_gather_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab04.check_all_gather_step(wrong)
