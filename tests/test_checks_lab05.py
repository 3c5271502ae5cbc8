"""labcourse.checks.lab05: the 1F1B order and the pipeline bubble; each check passes an answer written here from the
definition (not labkit's), whose values on small inputs are computed by hand, and fails the usual wrong answers with a
message that says what to fix."""

from __future__ import annotations

import pytest

from labcourse.checks import core, lab05
from labkit.parallel import pipeline


def one_f_one_b_by_hand(stage, stages, m):
    warm = min(m, stages - stage)  # forwards before the first backward
    order, forwards = [("F", i) for i in range(warm)], warm
    for b in range(m):
        order.append(("B", b))
        if forwards < m:
            order.append(("F", forwards))
            forwards += 1
    return order


def test_1f1b_check_passes_a_hand_written_answer():
    # the order torch's Schedule1F1B ran in (README, lab 05): 2 stages, 4 micro-batches
    assert one_f_one_b_by_hand(0, 2, 4) == [
        ("F", 0),
        ("F", 1),
        ("B", 0),
        ("F", 2),
        ("B", 1),
        ("F", 3),
        ("B", 2),
        ("B", 3),
    ]
    assert one_f_one_b_by_hand(1, 2, 4) == [
        ("F", 0),
        ("B", 0),
        ("F", 1),
        ("B", 1),
        ("F", 2),
        ("B", 2),
        ("F", 3),
        ("B", 3),
    ]
    assert lab05.check_1f1b_order(one_f_one_b_by_hand) is one_f_one_b_by_hand


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


def bubble_by_hand(events):
    """Idle time of every rank over the timeline's span, as a share of all ranks' time."""
    start, end = min(e["start"] for e in events), max(e["end"] for e in events)
    busy = {}
    for e in events:
        busy[e["rank"]] = busy.get(e["rank"], 0.0) + e["end"] - e["start"]
    return sum((end - start) - b for b in busy.values()) / (len(busy) * (end - start))


def test_bubble_fraction_check_passes_a_hand_written_answer():
    one_microbatch = [
        {"rank": 0, "kind": "F", "microbatch": 0, "start": 0.0, "end": 1.0},
        {"rank": 1, "kind": "F", "microbatch": 0, "start": 1.0, "end": 2.0},
        {"rank": 1, "kind": "B", "microbatch": 0, "start": 2.0, "end": 4.0},
        {"rank": 0, "kind": "B", "microbatch": 0, "start": 4.0, "end": 6.0},
    ]
    assert bubble_by_hand(one_microbatch) == 0.5  # each rank busy 3 of 6 s: (p − 1) / (m + p − 1) = 1/2
    assert lab05.check_bubble_fraction(bubble_by_hand) is bubble_by_hand


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
