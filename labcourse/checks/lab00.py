"""Lab 00's exercise checks: timing done right, perplexity windows."""

from __future__ import annotations

from collections.abc import Callable

from labcourse.checks.core import CheckFailed, call_answer, goes_on_with, report_passed
from labkit import bench, evaluate


class _SimulatedGPU:
    """A device whose work runs asynchronously: fn() only queues its duration, the clock moves when
    sync() waits for the queue. Timing without a sync before each clock read measures nothing."""

    def __init__(self, durations: list[float]) -> None:
        self.durations, self.now, self.queued, self.calls = list(durations), 0.0, 0.0, 0

    def fn(self) -> None:
        self.queued += self.durations[min(self.calls, len(self.durations) - 1)]
        self.now += 1e-6  # launching a kernel takes microseconds
        self.calls += 1

    def sync(self) -> None:
        self.now += self.queued
        self.queued = 0.0

    def clock(self) -> float:
        return self.now


def _median_time(
    work: Callable[[], object], sync: Callable[[], None], clock: Callable[[], float], warmup: int, repeats: int
) -> float:
    """labkit's answer to exercise 00.1, in the exercise's signature."""
    return bench.time_fn(work, warmup=warmup, repeats=repeats, clock=clock, sync=sync).median


@goes_on_with(_median_time, "bench.time_fn(...).median")
def check_median_time(fn: Callable[..., float]) -> Callable:
    """Lab 00: fn(work, sync, clock, warmup, repeats) returns the median seconds of `repeats` timed calls."""
    exercise = "exercise 00.1 (timing done right)"
    # (durations of successive calls, warmup, repeats): a slow first call (compilation, allocation),
    # then one outlier, so warm-up, synchronization and median vs mean each change the answer.
    cases = [([5.0, 0.2, 0.1, 0.3, 4.0, 0.2], 1, 5), ([0.5, 0.5, 0.25], 2, 1), ([1.0, 2.0, 3.0, 40.0], 0, 4)]
    for durations, warmup, repeats in cases:
        reference = _SimulatedGPU(durations)
        expected = _median_time(reference.fn, reference.sync, reference.clock, warmup, repeats)
        device = _SimulatedGPU(durations)
        got = call_answer(exercise, fn, device.fn, device.sync, device.clock, warmup, repeats)
        if device.calls != warmup + repeats:
            raise CheckFailed(
                f"{exercise}: call the work warmup + repeats = {warmup + repeats} times, "
                f"it was called {device.calls} times"
            )
        if not isinstance(got, (int, float)) or not abs(got - expected) <= 1e-9:  # NaN is no answer
            timed = durations[warmup : warmup + repeats]
            if isinstance(got, (int, float)) and got < 1e-3:
                hint = (
                    "you measured how long it takes to *queue* the work: call sync() before reading "
                    "the clock, after the work and before starting"
                )
            elif isinstance(got, (int, float)) and abs(got - sum(timed) / len(timed)) < 1e-4:
                hint = "report the median, not the mean: one slow call should not move the answer"
            else:
                hint = (
                    "sync() before the start too, or the warm-up's queued work lands in the first timing; "
                    "and leave the warm-up calls out of the times"
                )
            raise CheckFailed(
                f"{exercise}: calls taking {durations} s, warmup={warmup}, repeats={repeats}: "
                f"expected median {expected:.6g} s, got {got!r}; hint: {hint}"
            )
    return report_passed(exercise, len(cases))


@goes_on_with(evaluate.windows, "evaluate.windows")
def check_windows(fn: Callable[[int, int, int], list[tuple[int, int, int]]]) -> Callable:
    """Lab 00: fn(n_tokens, max_length, stride) lists (begin, end, n_scored) windows that score each token at most
    once, each window scoring only its last n_scored tokens (as `evaluate.windows`)."""
    exercise = "exercise 00.2 (perplexity windows)"
    cases = [(10, 4, 4), (10, 4, 2), (9, 4, 3), (3, 8, 8), (12, 6, 1), (2, 2, 2)]
    for n, max_length, stride in cases:
        expected = evaluate.windows(n, max_length, stride)
        got = call_answer(exercise, fn, n, max_length, stride)
        triples = isinstance(got, (list, tuple)) and all(isinstance(w, (list, tuple)) and len(w) == 3 for w in got)
        got = [tuple(w) for w in got] if triples else got
        if got != expected:
            scored = sum(w[2] for w in got) if triples else None
            should = sum(w[2] for w in expected)
            if scored is not None and scored > should:
                hint = (
                    f"{scored} tokens scored, {should} expected: score only what no earlier window scored "
                    "(overlapping windows share context, not targets), and never a token without context"
                )
            elif scored is not None and scored < should:
                hint = f"{scored} tokens scored, {should} expected: keep going until a window reaches the last token"
            else:
                hint = "windows start every `stride` tokens and end at min(begin + max_length, n_tokens)"
            raise CheckFailed(
                f"{exercise}: n_tokens={n}, max_length={max_length}, stride={stride}: expected "
                f"{expected}, got {got}; hint: {hint}"
            )
    return report_passed(exercise, len(cases))
