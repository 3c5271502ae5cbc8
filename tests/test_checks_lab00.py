"""labcourse.checks.lab00: timing done right (sync, warm-up, median) and perplexity windows; each check passes the
answer written here from the definition (not labkit's), whose values on small inputs are computed by hand, and fails
the usual wrong answers with a message that says what to fix."""

from __future__ import annotations

import statistics

import pytest

from labcourse.checks import core, lab00
from labkit import bench, evaluate


def median_time(work, sync, clock, warmup, repeats):
    return bench.time_fn(work, warmup=warmup, repeats=repeats, clock=clock, sync=sync).median


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


def test_hand_written_timer_measures_the_simulated_device_by_hand():
    device = lab00._SimulatedGPU([5.0, 0.2, 0.1, 0.3, 4.0, 0.2])
    # the 5 s warm-up is left out; each timed call takes its duration plus the 1 µs launch: median of
    # 0.2, 0.1, 0.3, 4.0, 0.2 is 0.2
    assert timer_variant()(device.fn, device.sync, device.clock, 1, 5) == pytest.approx(0.2 + 1e-6, abs=1e-12)


def test_median_time_check_passes_a_hand_written_answer():
    answer = timer_variant()
    assert lab00.check_median_time(answer) is answer


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


def windows_by_hand(n_tokens, max_length, stride):
    """Token 0 has no context; every later token is scored once, by the first window that reaches it."""
    out, scored_before, begin = [], 1, 0
    while begin < n_tokens:
        end = min(begin + max_length, n_tokens)
        first = max(scored_before, begin + 1)  # a window's own first token has no context in it
        if end > first:
            out.append((begin, end, end - first))
        scored_before = max(scored_before, end)
        if end == n_tokens:
            break
        begin += stride
    return out


def test_hand_written_windows_by_hand():
    assert windows_by_hand(10, 4, 4) == [(0, 4, 3), (4, 8, 3), (8, 10, 1)]  # tokens 4 and 8 start a window
    assert windows_by_hand(10, 4, 2) == [(0, 4, 3), (2, 6, 2), (4, 8, 2), (6, 10, 2)]  # 9 = every token after 0
    assert windows_by_hand(3, 8, 8) == [(0, 3, 2)]


def test_windows_check_passes_a_hand_written_answer():
    assert lab00.check_windows(windows_by_hand) is windows_by_hand


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
