"""labkit.checks.lab00: timing done right (sync, warm-up, median) and perplexity windows; each check passes the
reference answer and fails the usual wrong answers with a message that says what to fix."""

from __future__ import annotations

import statistics

import pytest

from labkit import bench, evaluate
from labkit.checks import core, lab00


def median_time(work, sync, clock, warmup, repeats):
    return bench.time_fn(work, warmup=warmup, repeats=repeats, clock=clock, sync=sync).median


def test_median_time_check_passes_the_reference():
    assert lab00.check_median_time(median_time) is median_time


def timer_variant(sync_before=True, sync_after=True, reduce=statistics.median):
    def timer(work, sync, clock, warmup, repeats):
        for _ in range(warmup):
            work()
        times = []
        for _ in range(repeats):
            if sync_before:
                sync()
            start = clock()
            work()
            if sync_after:
                sync()
            times.append(clock() - start)
        return reduce(times)

    return timer


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (timer_variant(sync_before=False, sync_after=False), "call sync"),
        (timer_variant(reduce=statistics.mean), "median, not the mean"),
        (timer_variant(sync_before=False), "sync\\(\\) before the start"),
        (lambda work, sync, clock, warmup, repeats: median_time(work, sync, clock, 0, repeats), "times"),
    ],
)
def test_median_time_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab00.check_median_time(wrong)


def test_windows_check_passes_the_reference():
    assert lab00.check_windows(evaluate.windows) is evaluate.windows


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (
            lambda n, L, s: [(b, min(b + L, n), min(b + L, n) - b - 1) for b in range(0, n - 1, s)],
            "score only what no earlier",
        ),
        (lambda n, L, s: evaluate.windows(n, L, s)[:1], "keep going until"),
        (lambda n, L, s: list(reversed(evaluate.windows(n, L, s))), "windows start every"),
        (lambda n, L, s: [n], "windows start every"),
    ],
)
def test_windows_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab00.check_windows(wrong)
