"""Lab 05's exercise checks: the 1F1B order, the bubble."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labcourse.checks.core import CheckFailed, as_rows, call_answer, goes_on_with, report_passed
from labkit.parallel import pipeline


def _one_f_one_b(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """labkit's answer to exercise 05.1, in the exercise's signature."""
    return pipeline.schedule_order("1f1b", stage, stages, microbatches)


@goes_on_with(_one_f_one_b, 'pipeline.schedule_order("1f1b", ...)')
def check_1f1b_order(fn: Callable[[int, int, int], list[tuple[str, int]]]) -> Callable:
    """Lab 05: fn(stage, stages, microbatches) is the (kind, micro-batch) order one stage runs under 1F1B."""
    exercise = "exercise 05.1 (the 1F1B order)"
    cases = [(0, 2, 4), (1, 2, 4), (0, 4, 8), (2, 4, 8), (3, 4, 8), (0, 4, 2), (0, 1, 3)]
    for stage, stages, m in cases:
        expected = _one_f_one_b(stage, stages, m)
        got = call_answer(exercise, fn, stage, stages, m)
        got = as_rows(got, tuple)
        if got != expected:
            if got == pipeline.schedule_order("gpipe", stage, stages, m):
                hint = "that is GPipe (all forwards first); 1F1B starts backwards after a few warm-up forwards"
            elif isinstance(got, list) and sorted(got) != sorted(expected):
                hint = f"every micro-batch runs exactly one forward ('F', i) and one backward ('B', i), i < {m}"
            else:
                hint = (
                    f"stage s of p warms up with min(m, p − s) forwards (here {min(m, stages - stage)}), then "
                    "alternates one backward and one forward, then runs the remaining backwards"
                )
            raise CheckFailed(
                f"{exercise}: stage {stage} of {stages}, {m} micro-batches: expected {expected}, "
                f"got {got}; hint: {hint}"
            )
    return report_passed(exercise, len(cases))


@goes_on_with(pipeline.bubble_fraction, "pipeline.bubble_fraction")
def check_bubble_fraction(fn: Callable[[list[dict[str, Any]]], float]) -> Callable:
    """Lab 05: fn(events) is the idle share 1 − busy / (ranks × span) of a pipeline timeline."""
    exercise = "exercise 05.2 (measuring the bubble)"
    two_stages = [
        {"rank": 0, "kind": "F", "microbatch": 0, "start": 0.0, "end": 1.0},
        {"rank": 1, "kind": "F", "microbatch": 0, "start": 1.0, "end": 2.0},
        {"rank": 1, "kind": "B", "microbatch": 0, "start": 2.0, "end": 4.0},
        {"rank": 0, "kind": "B", "microbatch": 0, "start": 4.0, "end": 6.0},
    ]
    shifted = [{**e, "start": e["start"] + 100.0, "end": e["end"] + 100.0} for e in two_stages]
    busy = [{"rank": r, "kind": "F", "microbatch": 0, "start": 0.0, "end": 3.0} for r in range(3)]
    cases = [two_stages, shifted, busy]
    for events in cases:
        expected = pipeline.bubble_fraction(events)
        got = call_answer(exercise, fn, [dict(e) for e in events])
        if not isinstance(got, (int, float)) or not abs(got - expected) <= 1e-9:  # NaN is no answer
            ranks = len({e["rank"] for e in events})
            span = max(e["end"] for e in events) - min(e["start"] for e in events)
            busy_time = sum(e["end"] - e["start"] for e in events)
            if isinstance(got, (int, float)) and abs(got - (1 - busy_time / span)) < 1e-9:
                hint = f"the timeline has {ranks} ranks, each idle or busy for the whole span: divide by ranks × span"
            elif (
                isinstance(got, (int, float))
                and abs(got - (1 - busy_time / (ranks * max(e["end"] for e in events)))) < 1e-9
            ):
                hint = "the span runs from the first start to the last end, not from time 0"
            else:
                hint = "1 − (sum of event durations) / (number of ranks × (last end − first start))"
            raise CheckFailed(f"{exercise}: expected {expected:.4f}, got {got!r}; hint: {hint}")
    return report_passed(exercise, len(cases))
