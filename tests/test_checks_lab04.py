"""labkit.checks.lab04: one reduce-scatter and one all-gather step of the ring; each check passes the reference
answer and fails the usual wrong answers with a message that says what to fix."""

from __future__ import annotations

import pytest

from labkit.checks import core, lab04
from labkit.parallel import ring


def test_reduce_scatter_check_passes_the_reference():
    assert lab04.check_reduce_scatter_step(ring.ring_step) is ring.ring_step


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


def all_gather_reference(chunks, step):
    return ring.ring_step(chunks, len(chunks) - 1 + step)


def gather_adding(chunks, step):
    world = len(chunks)
    out = [list(row) for row in chunks]
    for r in range(world):
        c = (r + 1 - step) % world
        out[(r + 1) % world][c] = chunks[(r + 1) % world][c] + chunks[r][c]
    return out


def test_all_gather_check_passes_the_reference():
    assert lab04.check_all_gather_step(all_gather_reference) is all_gather_reference


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
