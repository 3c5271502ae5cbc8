"""labkit.checks.lab05: the 1F1B order and the pipeline bubble; each check passes the reference answer and fails
the usual wrong answers with a message that says what to fix."""

from __future__ import annotations

import pytest

from labkit.checks import core, lab05
from labkit.parallel import pipeline


def test_1f1b_check_passes_the_reference():
    answer = lambda s, p, m: pipeline.schedule_order("1f1b", s, p, m)  # noqa: E731
    assert lab05.check_1f1b_order(answer) is answer


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda s, p, m: pipeline.schedule_order("gpipe", s, p, m), "that is GPipe"),
        (lambda s, p, m: pipeline.schedule_order("1f1b", min(s + 1, p - 1), p, m), "min\\(m, p − s\\) forwards"),
        (lambda s, p, m: [("F", i) for i in range(m)], "exactly one forward"),
    ],
)
def test_1f1b_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab05.check_1f1b_order(wrong)


def test_bubble_fraction_check_passes_the_reference():
    assert lab05.check_bubble_fraction(pipeline.bubble_fraction) is pipeline.bubble_fraction


def bubble_one_rank(events):
    span = max(e["end"] for e in events) - min(e["start"] for e in events)
    return 1 - sum(e["end"] - e["start"] for e in events) / span


def bubble_from_zero(events):
    ranks = len({e["rank"] for e in events})
    return 1 - sum(e["end"] - e["start"] for e in events) / (ranks * max(e["end"] for e in events))


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (bubble_one_rank, "divide by ranks × span"),
        (bubble_from_zero, "from the first start"),
        (lambda events: 0.5, "sum of event durations"),
    ],
)
def test_bubble_fraction_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab05.check_bubble_fraction(wrong)
