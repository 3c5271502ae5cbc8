"""Lab 10's exercise checks: the matmul share of a profiled step, and energy per token from a power series."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from labcourse.checks.core import CheckFailed, call_answer, goes_on_with, report_passed
from labkit.monitor import energy_per_token, integrate
from labkit.profiler import MATMUL


def _matmul_share(operators: list[dict[str, Any]]) -> float:
    """labkit's answer to exercise 10.1: the share of all self time spent in matrix products."""
    total = sum(row["self_s"] for row in operators)
    return sum(row["self_s"] for row in operators if re.search(MATMUL, row["name"])) / total if total else 0.0


def _joules_per_token(times: list[float], watts: list[float], tokens: int) -> float:
    """labkit's answer to exercise 10.2: power integrated by the trapezoid rule, per token."""
    return energy_per_token(integrate(times, watts), tokens)


def _operator_rows(*pairs: tuple[str, float]) -> list[dict[str, Any]]:
    return [{"name": name, "calls": 1.0, "self_s": s, "total_s": s} for name, s in pairs]


@goes_on_with(_matmul_share, "profiler.MATMUL")
def check_matmul_share(fn: Callable[[list[dict[str, Any]]], float]) -> Callable:
    """Lab 10: fn(operators) = share of the operators' summed self time spent in aten::mm, addmm, bmm, baddbmm."""
    exercise = "exercise 10.1 (the matmul share of a step)"
    cases = [  # hand-computed: 3 of 4 s; 0 of 2; linear and matmul are wrappers whose self time is not a product's
        (_operator_rows(("aten::mm", 2.0), ("aten::addmm", 1.0), ("aten::mul", 1.0)), 0.75),
        (_operator_rows(("aten::add", 1.5), ("aten::copy_", 0.5)), 0.0),
        (
            _operator_rows(
                ("aten::linear", 0.5), ("aten::matmul", 0.5), ("aten::bmm", 3.0), ("aten::mm_backward", 1.0)
            ),
            0.6,
        ),
        (_operator_rows(("aten::baddbmm", 1.0)), 1.0),
    ]
    for rows, expected in cases:
        got = call_answer(exercise, fn, rows)
        if isinstance(got, (int, float)) and abs(got - expected) < 1e-9:
            continue
        names = [r["name"] for r in rows]
        if isinstance(got, (int, float)) and abs(got - expected * 100) < 1e-6:
            hint = "return a fraction between 0 and 1, not a percentage"
        elif "aten::linear" in names or "aten::mm_backward" in names:
            hint = "count the operators that do the product (mm, addmm, bmm, baddbmm) by exact name, not wrappers"
        else:
            hint = "divide the matmuls' summed self_s by every operator's summed self_s"
        raise CheckFailed(f"{exercise}: operators {names}: expected {expected}, got {got!r}; hint: {hint}")
    return report_passed(exercise, len(cases))


@goes_on_with(_joules_per_token, "monitor.integrate")
def check_joules_per_token(fn: Callable[[list[float], list[float], int], float]) -> Callable:
    """Lab 10: fn(times, watts, tokens) = joules per token, the power series integrated by the trapezoid rule."""
    exercise = "exercise 10.2 (energy per token)"
    cases = [  # hand-computed joules: 100 W for 4 s; a ramp 0 -> 200 W over 2 s; uneven samples 1 s and 3 s apart
        ([0.0, 1.0, 3.0, 4.0], [100.0, 100.0, 100.0, 100.0], 400, 1.0),
        ([0.0, 2.0], [0.0, 200.0], 100, 2.0),
        ([0.0, 1.0, 4.0], [300.0, 100.0, 100.0], 50, (200 + 300) / 50),
    ]
    for times, watts, tokens, expected in cases:
        got = call_answer(exercise, fn, list(times), list(watts), tokens)
        if isinstance(got, (int, float)) and abs(got - expected) < 1e-9:
            continue
        rectangles = sum(w * (b - a) for w, a, b in zip(watts, times, times[1:])) / tokens
        mean_power = sum(watts) / len(watts) * (times[-1] - times[0]) / tokens
        if isinstance(got, (int, float)) and abs(got - rectangles) < 1e-9:
            hint = "a sample's power holds halfway to the next: average each pair of neighbours (trapezoids)"
        elif isinstance(got, (int, float)) and abs(got - mean_power) < 1e-9 and got != expected:
            hint = "samples are not evenly spaced: weight each interval by its own length"
        else:
            hint = "joules = sum over intervals of (t[i+1] - t[i]) * (w[i] + w[i+1]) / 2; then divide by tokens"
        raise CheckFailed(
            f"{exercise}: times {times}, watts {watts}, {tokens} tokens: expected {expected}, got {got!r}; hint: {hint}"
        )
    return report_passed(exercise, len(cases))
