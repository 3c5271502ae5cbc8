"""Exercise checks: each compares a student's function with labkit's own implementation of the same step.

A check runs the function on a few cases chosen to catch the usual mistakes, and raises `CheckFailed`
(an AssertionError, so a notebook cell stops there) with the smallest failing case, what was
expected, what came back, and a hint. A function that still raises NotImplementedError (the stub of
the student build) gets a message saying which exercise is left, not a traceback.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from labkit import bench, distributed, evaluate, lora, pipeline, precision, prune, quant, shards, tokenizer, train


class CheckFailed(AssertionError):
    """An exercise answer that does not match the reference; the message says how."""


def _call(exercise: str, fn: Callable, *args: Any) -> Any:
    if not callable(fn):
        raise CheckFailed(f"{exercise}: expected a function, got {type(fn).__name__}")
    try:
        return fn(*args)
    except NotImplementedError:
        raise CheckFailed(
            f"{exercise}: not written yet — replace the `raise NotImplementedError` in the "
            "exercise cell with your code, run that cell, then this one"
        ) from None


def _rows(got: Any, kind: type) -> Any:
    """A list of sequences as a list of `kind` (tuple or list), for comparing; anything else unchanged."""
    if isinstance(got, (list, tuple)) and all(isinstance(x, (list, tuple)) for x in got):
        return [kind(x) for x in got]
    return got


def _passed(exercise: str, cases: int) -> str:
    message = f"{exercise}: passed ({cases} cases)"
    print(message)
    return message


# ------------------------------------------------------------------------ lab 00: timing done right, perplexity windows


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


def check_median_time(fn: Callable[..., float]) -> str:
    """Lab 00: fn(work, sync, clock, warmup, repeats) returns the median seconds of `repeats` timed calls."""
    exercise = "exercise 00.1 (timing done right)"
    # (durations of successive calls, warmup, repeats): a slow first call (compilation, allocation),
    # then one outlier, so warm-up, synchronization and median vs mean each change the answer.
    cases = [([5.0, 0.2, 0.1, 0.3, 4.0, 0.2], 1, 5), ([0.5, 0.5, 0.25], 2, 1), ([1.0, 2.0, 3.0, 40.0], 0, 4)]
    for durations, warmup, repeats in cases:
        reference = _SimulatedGPU(durations)
        expected = bench.time_fn(
            reference.fn, warmup=warmup, repeats=repeats, clock=reference.clock, sync=reference.sync
        ).median
        device = _SimulatedGPU(durations)
        got = _call(exercise, fn, device.fn, device.sync, device.clock, warmup, repeats)
        if device.calls != warmup + repeats:
            raise CheckFailed(
                f"{exercise}: call the work warmup + repeats = {warmup + repeats} times, "
                f"it was called {device.calls} times"
            )
        if not isinstance(got, (int, float)) or abs(got - expected) > 1e-9:
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
    return _passed(exercise, len(cases))


def check_windows(fn: Callable[[int, int, int], list[tuple[int, int, int]]]) -> str:
    """Lab 00: fn(n_tokens, max_length, stride) lists (begin, end, n_scored) windows that score each token at most
    once, each window scoring only its last n_scored tokens (as `evaluate.windows`)."""
    exercise = "exercise 00.2 (perplexity windows)"
    cases = [(10, 4, 4), (10, 4, 2), (9, 4, 3), (3, 8, 8), (12, 6, 1), (2, 2, 2)]
    for n, max_length, stride in cases:
        expected = evaluate.windows(n, max_length, stride)
        got = _call(exercise, fn, n, max_length, stride)
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
    return _passed(exercise, len(cases))


# ----------------------------------------------------------------------------- lab 01: one BPE merge, blocks


def _merge_overlapping(word: tuple[int, ...], a: int, b: int, new: int) -> tuple[int, ...]:
    """The usual wrong answer: after a match, step one token instead of two."""
    return tuple(new if (x, y) == (a, b) else x for x, y in zip(word, word[1:] + (None,)))


def _merge_right_to_left(word: tuple[int, ...], a: int, b: int, new: int) -> tuple[int, ...]:
    return tokenizer.merge_pair(word[::-1], b, a, new)[::-1]


def check_merge_pair(fn: Callable[[tuple[int, ...], int, int, int], tuple[int, ...]]) -> str:
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
        expected = tokenizer.merge_pair(word, a, b, new)
        got = _call(exercise, fn, word, a, b, new)
        got = tuple(got) if isinstance(got, (tuple, list)) else got
        if got != expected:
            hint = next(
                (h for wrong, h in mistakes.items() if wrong(word, a, b, new) == got),
                "every (a, b) in that order becomes `new`; everything else is copied; return a tuple",
            )
            raise CheckFailed(
                f"{exercise}: merging {(a, b)} -> {new} in {word} should give {expected}, got {got}; hint: {hint}"
            )
    return _passed(exercise, len(cases))


def check_pack_blocks(fn: Callable[[list[int], int], list[list[int]]]) -> str:
    """Lab 01: fn(stream, block_size) cuts a token stream into full blocks, dropping the tail."""
    exercise = "exercise 01.2 (packing a stream into blocks)"
    cases = [(list(range(10)), 4), (list(range(8)), 4), (list(range(5)), 5), (list(range(7)), 1)]
    for stream, size in cases:
        expected = shards.pack_blocks(np.array(stream), size).tolist()
        got = _call(exercise, fn, list(stream), size)
        got = _rows(got, list)
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
    return _passed(exercise, len(cases))


# ------------------------------------------------------------------- lab 02: the loss-scale update, what a format keeps


def check_update_loss_scale(fn: Callable[[float, int, bool, float, float, int], tuple[float, int]]) -> str:
    """Lab 02: fn(scale, good_steps, found_inf, growth_factor, backoff_factor, growth_interval) -> (scale, steps)."""
    exercise = "exercise 02.1 (dynamic loss scaling)"
    flags = [False, False, False, True, False, False, False, False, True, True, False, False, False]
    scale, good = 2.0**16, 0
    for step, found_inf in enumerate(flags):
        expected = precision.update_loss_scale(scale, good, found_inf, 2.0, 0.5, 3)
        got = _call(exercise, fn, scale, good, found_inf, 2.0, 0.5, 3)
        if not isinstance(got, tuple) or len(got) != 2:
            raise CheckFailed(f"{exercise}: return (new_scale, new_good_steps), got {got!r}")
        if (float(got[0]), int(got[1])) != expected:
            if found_inf:
                hint = "an overflow multiplies the scale by backoff_factor and restarts the count at 0"
            elif expected[0] != scale:
                hint = "after growth_interval = 3 good steps in a row the scale grows by growth_factor, count back to 0"
            else:
                hint = "a good step that does not complete the interval only adds 1 to the count"
            raise CheckFailed(
                f"{exercise}: step {step}, scale {scale:g}, good steps {good}, found_inf {found_inf}: "
                f"expected {expected}, got {got}; hint: {hint}"
            )
        scale, good = expected
    return _passed(exercise, len(flags))


def check_kept_fraction(fn: Callable[[torch.Tensor, torch.dtype, float], float]) -> str:
    """Lab 02: fn(values, dtype, scale) is the share of non-zero values still non-zero after scaling and casting."""
    exercise = "exercise 02.2 (what a format keeps)"
    values = torch.tensor([1e-3, 1e-6, 1e-8, 3e-9, 1e-10, 2.0, 0.0, -5e-8])
    cases = [(torch.float16, 1.0), (torch.float16, 2.0**10), (torch.bfloat16, 1.0), (torch.float16, 2.0**20)]
    for dtype, scale in cases:
        expected = precision.kept_fraction(values, dtype, scale)
        got = _call(exercise, fn, values.clone(), dtype, scale)
        if not isinstance(got, (int, float)) or abs(got - expected) > 1e-9:
            unscaled = precision.kept_fraction(values, dtype, 1.0)
            with_zero = ((values * scale).to(dtype) != 0).float().mean().item()
            if isinstance(got, (int, float)) and abs(got - with_zero) < 1e-9:
                hint = "count among the values that were non-zero to begin with (drop the exact zeros first)"
            elif isinstance(got, (int, float)) and abs(got - unscaled) < 1e-9:
                hint = "multiply by the loss scale before casting: that is what the scale is for"
            else:
                hint = "cast (values · scale) to the dtype and count what is still non-zero"
            raise CheckFailed(
                f"{exercise}: {dtype}, scale {scale:g}: expected {expected:.4f}, got {got!r}; hint: {hint}"
            )
    return _passed(exercise, len(cases))


# ----------------------------------------------------------------------------- lab 03: accumulation and the schedule


def check_loss_divisors(fn: Callable[[list[int]], list[int]]) -> str:
    """Lab 03: fn(token_counts) gives, per micro-batch, the divisor of its summed loss (token-normalized)."""
    exercise = "exercise 03.1 (token-normalized accumulation)"
    cases = [[100, 100], [300, 20, 80, 1], [7], [0, 5, 5]]
    for counts in cases:
        expected = train.loss_divisors(counts)
        got = _call(exercise, fn, list(counts))
        if list(got) != expected:
            wrong = train.loss_divisors(counts, "per_microbatch_mean")
            hint = (
                "that is the mean of per-micro-batch means: it weights the tokens of short micro-batches "
                "more. Divide every summed loss by the same number: all target tokens of the window"
                if list(got) == wrong
                else "one divisor per micro-batch; the big batch's loss is a mean over all of its target tokens"
            )
            raise CheckFailed(f"{exercise}: token counts {counts} need divisors {expected}, got {got}; hint: {hint}")
    return _passed(exercise, len(cases))


def _cosine(
    step: int,
    steps: int,
    warmup: int,
    lr: float,
    min_lr: float,
    *,
    warmup_from_zero: bool = False,
    floor: float | None = None,
    span_offset: int = 1,
) -> float:
    """The warm-up + cosine schedule with the usual mistakes as switches (the check's wrong answers)."""
    if step < warmup:
        return lr * (step if warmup_from_zero else step + 1) / warmup
    low = min_lr if floor is None else floor
    progress = min(1.0, (step - warmup) / max(1, steps - warmup - span_offset))
    return low + 0.5 * (lr - low) * (1 + math.cos(math.pi * progress))


def check_lr_at(fn: Callable[[int, int, int, float, float], float]) -> str:
    """Lab 03: fn(step, steps, warmup_steps, lr, min_lr) is the warm-up + cosine learning rate at 0-based `step`."""
    exercise = "exercise 03.2 (warm-up and cosine decay)"
    configs = [(10, 3, 1e-3, 1e-4), (100, 10, 2e-3, 1e-4), (5, 0, 1.0, 0.5), (4, 4, 1.0, 0.1)]
    mistakes = {
        "warm up so that step 0 already trains: lr · (step + 1) / warmup_steps, which reaches lr at "
        "the last warm-up step": {"warmup_from_zero": True},
        "decay to min_lr, not to 0": {"floor": 0.0},
        "the last step must reach min_lr: progress = (step − warmup_steps) / (steps − warmup_steps − 1)": {
            "span_offset": 0
        },
    }
    for steps, warmup, lr, min_lr in configs:
        cfg = train.TrainConfig(steps=steps, warmup_steps=warmup, lr=lr, min_lr=min_lr, schedule="cosine")
        expected = [train.lr_at(step, cfg) for step in range(steps)]
        got = [_call(exercise, fn, step, steps, warmup, lr, min_lr) for step in range(steps)]
        bad = [
            i
            for i, (g, e) in enumerate(zip(got, expected))
            if not isinstance(g, (int, float)) or abs(g - e) > 1e-9 * lr
        ]
        if bad:
            hint = next(
                (
                    h
                    for h, switch in mistakes.items()
                    if all(
                        isinstance(g, (int, float))
                        and abs(g - _cosine(i, steps, warmup, lr, min_lr, **switch)) <= 1e-9 * lr
                        for i, g in enumerate(got)
                    )
                ),
                "linear warm-up to lr, then min_lr + (lr − min_lr) · (1 + cos(π · progress)) / 2",
            )
            i = bad[0]
            raise CheckFailed(
                f"{exercise}: steps={steps}, warmup_steps={warmup}, lr={lr:g}, min_lr={min_lr:g}: "
                f"step {i} should get {expected[i]:.6g}, got {got[i]!r}; hint: {hint}"
            )
    return _passed(exercise, len(configs))


# ----------------------------------------------------------------------------- lab 04: ring steps


def _chunks(world: int, seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 100, (2,), generator=g).double() for _ in range(world)] for _ in range(world)]


def _step_overwriting(chunks: list[list[torch.Tensor]], step: int) -> list[list[torch.Tensor]]:
    """The usual wrong answer: the receiver replaces its copy (all-gather's move) instead of adding to it."""
    world = len(chunks)
    out = [list(row) for row in chunks]
    for rank in range(world):
        c = distributed.ring_send_chunk(rank, world, step)
        out[(rank + 1) % world][c] = chunks[rank][c]
    return out


def _first_wrong_chunk(
    exercise: str, fn: Callable, chunks: list[list[torch.Tensor]], step: int, expected: list[list[torch.Tensor]]
) -> tuple[Any, tuple[int, int] | None]:
    """Run a ring-step answer on a copy of `chunks`; return its result and the first (rank, chunk) it got wrong."""
    world = len(chunks)
    got = _call(exercise, fn, [[t.clone() for t in row] for row in chunks], step)
    if (
        not isinstance(got, (list, tuple))
        or len(got) != world
        or any(not isinstance(row, (list, tuple)) or len(row) != world for row in got)
    ):
        raise CheckFailed(f"{exercise}: return a list with one list of {world} chunks per rank ({world} ranks)")
    bad = [(r, c) for r in range(world) for c in range(world) if not torch.equal(got[r][c], expected[r][c])]
    return got, (bad[0] if bad else None)


def check_reduce_scatter_step(fn: Callable[[list[list[torch.Tensor]], int], list[list[torch.Tensor]]]) -> str:
    """Lab 04: fn(chunks, step) is one reduce-scatter step of a ring all-reduce (chunks[r][c]: rank r, chunk c)."""
    exercise = "exercise 04.1 (a ring reduce-scatter step)"
    cases = [(2, 0), (3, 0), (3, 1), (4, 2), (5, 1)]
    for world, step in cases:
        chunks = _chunks(world, seed=world * 10 + step)
        expected = distributed.ring_step(chunks, step)
        got, wrong_at = _first_wrong_chunk(exercise, fn, chunks, step, expected)
        if wrong_at:
            r, c = wrong_at
            wrong = _step_overwriting(chunks, step)
            if all(torch.equal(got[q][k], wrong[q][k]) for q in range(world) for k in range(world)):
                hint = (
                    "reduce-scatter adds the incoming chunk to the receiver's own copy; replacing it is "
                    "the all-gather phase"
                )
            else:
                hint = (
                    f"at step s rank r sends chunk (r − s) mod p to rank (r + 1) mod p, which adds it to its "
                    f"own copy; here rank {(r - 1) % world} sends chunk "
                    f"{distributed.ring_send_chunk((r - 1) % world, world, step)}"
                )
            raise CheckFailed(
                f"{exercise}: {world} ranks, step {step}: rank {r}'s chunk {c} should be "
                f"{expected[r][c].tolist()}, got {got[r][c].tolist()}; hint: {hint}"
            )
    return _passed(exercise, len(cases))


def check_all_gather_step(fn: Callable[[list[list[torch.Tensor]], int], list[list[torch.Tensor]]]) -> str:
    """Lab 04: fn(chunks, step) is one all-gather step of a ring all-reduce (step 0 … p − 2 of that phase)."""
    exercise = "exercise 04.2 (a ring all-gather step)"
    cases = [(2, 0), (3, 0), (3, 1), (4, 2), (5, 3)]
    for world, step in cases:
        chunks = _chunks(world, seed=world * 10 + step)
        for s in range(world - 1 + step):  # the reduce-scatter, then the all-gather steps before this one
            chunks = distributed.ring_step(chunks, s)
        expected = distributed.ring_step(chunks, world - 1 + step)
        got, wrong_at = _first_wrong_chunk(exercise, fn, chunks, step, expected)
        if wrong_at:
            r, c = wrong_at
            sent = distributed.ring_send_chunk((r - 1) % world, world, world - 1 + step)
            hint = (
                "all-gather passes finished sums along: the receiver replaces its copy, it does not add"
                if torch.equal(got[r][c], chunks[r][c] + chunks[(r - 1) % world][c])
                else f"at all-gather step s rank r sends the finished chunk (r + 1 − s) mod p to rank r + 1; "
                f"here rank {(r - 1) % world} sends chunk {sent}"
            )
            raise CheckFailed(
                f"{exercise}: {world} ranks, all-gather step {step}: rank {r}'s chunk {c} should be "
                f"{expected[r][c].tolist()}, got {got[r][c].tolist()}; hint: {hint}"
            )
    return _passed(exercise, len(cases))


# ----------------------------------------------------------------------------- lab 05: the 1F1B order, the bubble


def check_1f1b_order(fn: Callable[[int, int, int], list[tuple[str, int]]]) -> str:
    """Lab 05: fn(stage, stages, microbatches) is the (kind, micro-batch) order one stage runs under 1F1B."""
    exercise = "exercise 05.1 (the 1F1B order)"
    cases = [(0, 2, 4), (1, 2, 4), (0, 4, 8), (2, 4, 8), (3, 4, 8), (0, 4, 2), (0, 1, 3)]
    for stage, stages, m in cases:
        expected = pipeline.schedule_order("1f1b", stage, stages, m)
        got = _call(exercise, fn, stage, stages, m)
        got = _rows(got, tuple)
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
    return _passed(exercise, len(cases))


def check_bubble_fraction(fn: Callable[[list[dict[str, Any]]], float]) -> str:
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
        got = _call(exercise, fn, [dict(e) for e in events])
        if not isinstance(got, (int, float)) or abs(got - expected) > 1e-9:
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
    return _passed(exercise, len(cases))


# ----------------------------------------------------------------------------- lab 06: a 2:4 mask, counting sparsity


def _groups_topk(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    groups = scores.reshape(scores.shape[0], -1, m)
    return torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.topk(n, dim=-1).indices, True).view_as(scores)


def _row_topk(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    k = scores.shape[1] // m * n
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, scores.topk(k, dim=-1).indices, True)


def check_nm_mask(fn: Callable[[torch.Tensor, int, int], torch.Tensor]) -> str:
    """Lab 06: fn(weight, n, m) is a bool keep-mask with the n largest |w| of every m consecutive inputs per row."""
    exercise = "exercise 06.1 (an N:M mask)"
    g = torch.Generator().manual_seed(0)
    cases = [
        (torch.tensor([[0.1, -0.9, 0.5, 0.2, 3.0, -4.0, 0.0, 1.0]]), 2, 4),
        (torch.randn(6, 16, generator=g), 2, 4),
        (torch.randn(4, 16, generator=g), 4, 8),
        (torch.randn(3, 12, generator=g), 1, 4),
    ]
    mistakes = {
        "rank by magnitude |w|: a large negative weight matters as much as a large positive one": lambda w, n, m: (
            _groups_topk(w, n, m)
        ),
        "choose within each group of m consecutive inputs, not across the whole row": lambda w, n, m: _row_topk(
            w.abs(), n, m
        ),
    }
    for weight, n, m in cases:
        expected = prune.nm_masks({"w": weight}, n, m)["w"]
        got = _call(exercise, fn, weight.clone(), n, m)
        if not isinstance(got, torch.Tensor) or got.shape != weight.shape:
            raise CheckFailed(
                f"{exercise}: return a mask of the weight's shape {tuple(weight.shape)}, "
                f"got {getattr(got, 'shape', type(got).__name__)}"
            )
        if got.dtype != torch.bool:
            raise CheckFailed(f"{exercise}: return a bool mask (True = keep), got dtype {got.dtype}")
        if not torch.equal(got, expected):
            row = int((got != expected).any(dim=1).nonzero()[0])
            hint = next(
                (h for h, wrong in mistakes.items() if torch.equal(wrong(weight, n, m), got)),
                f"keep exactly n = {n} weights, the largest |w|, in every group of m = {m}",
            )
            raise CheckFailed(
                f"{exercise}: {n}:{m} mask of row {row} = {[round(v, 3) for v in weight[row].tolist()]} "
                f"should be {expected[row].int().tolist()}, got {got[row].int().tolist()}; hint: {hint}"
            )
    return _passed(exercise, len(cases))


def check_overall_sparsity(fn: Callable[[list[tuple[int, int]]], float]) -> str:
    """Lab 06: fn([(zeros, params), ...]) is the share of zeros over all weights of the layers listed."""
    exercise = "exercise 06.2 (counting sparsity)"
    cases = [[(50, 100), (0, 100)], [(10, 10), (0, 990)], [(0, 7)], [(3, 4), (1, 4), (0, 8)]]
    for layers in cases:
        report = [prune.LayerSparsity(f"w{i}", (params,), zeros) for i, (zeros, params) in enumerate(layers)]
        expected = prune.overall_sparsity(report)
        got = _call(exercise, fn, list(layers))
        if not isinstance(got, (int, float)) or abs(got - expected) > 1e-12:
            mean_of_layers = sum(z / p for z, p in layers) / len(layers)
            hint = (
                "that is the mean of per-layer sparsities: a small layer counts as much as a big one. "
                "Divide all zeros by all weights"
                if isinstance(got, (int, float)) and abs(got - mean_of_layers) < 1e-12
                else "total zeros / total weights"
            )
            raise CheckFailed(
                f"{exercise}: layers (zeros, params) {layers}: expected {expected:.4f}, got {got!r}; hint: {hint}"
            )
    return _passed(exercise, len(cases))


# ----------------------------------------------------------------------------- lab 07: one GPTQ column, packed codes


def _column_case(seed: int, rows: int = 6, cols: int = 5, bits: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(cols, 64, generator=g)
    x[1] += 0.9 * x[0]  # correlated inputs: the error update matters
    u = quant.inverse_hessian_factor(2 * x @ x.T / 64, 0.01)
    block = torch.randn(rows, cols, generator=g)
    scale, zero = quant.grid(block, quant.QuantConfig(bits=bits, group_size=-1))
    block[0, 0] = 3 * block[0].abs().max()  # beyond the grid: the code must be clamped
    return block, u, scale, zero, 2**bits - 1


def check_gptq_column(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> str:
    """Lab 07: fn(block, i, u, scale, zero, maxq) rounds column i, updates the columns after it in place,
    and returns (codes, error / u[i, i])."""
    exercise = "exercise 07.1 (one GPTQ column)"
    cases = [(0, 0), (1, 1), (2, 4), (3, 2)]  # (seed, column); column 4 is the last: nothing to update
    for seed, i in cases:
        block, u, scale, zero, maxq = _column_case(seed)
        expected_block = block.clone()
        expected_q, expected_err = quant.quantize_column(expected_block, i, u, scale, zero, maxq)
        got_block = block.clone()
        result = _call(exercise, fn, got_block, i, u, scale.clone(), zero.clone(), maxq)
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise CheckFailed(f"{exercise}: return a pair (codes, error), got {type(result).__name__}")
        q, err = result
        where = f"column {i} of a {tuple(block.shape)} block, {maxq + 1}-level grid"
        if not torch.equal(torch.as_tensor(q, dtype=expected_q.dtype), expected_q):
            hint = (
                "clamp the codes to [0, maxq]: a weight beyond the grid's range takes the end code"
                if torch.equal(torch.as_tensor(q, dtype=expected_q.dtype), torch.round(block[:, i] / scale) + zero)
                else "code = round(w / scale) + zero, clamped to [0, maxq], from column i as updated so far"
            )
            raise CheckFailed(
                f"{exercise}: {where}: codes should be {expected_q.tolist()}, got "
                f"{torch.as_tensor(q).tolist()}; hint: {hint}"
            )
        if not torch.allclose(torch.as_tensor(err), expected_err, atol=1e-6):
            hint = (
                "divide the rounding error by the pivot u[i, i]"
                if torch.allclose(torch.as_tensor(err), expected_err * u[i, i], atol=1e-6)
                else "the error is w minus its dequantized value scale · (code − zero), divided by u[i, i]"
            )
            raise CheckFailed(
                f"{exercise}: {where}: error should be {expected_err.tolist()}, got "
                f"{torch.as_tensor(err).tolist()}; hint: {hint}"
            )
        if not torch.allclose(got_block, expected_block, atol=1e-6):
            if torch.allclose(got_block[:, i + 1 :], block[:, i + 1 :]):
                hint = "update the columns after i in place: block[:, i+1:] -= outer(error, u[i, i+1:])"
            elif torch.allclose(
                got_block[:, i + 1 :] - block[:, i + 1 :], block[:, i + 1 :] - expected_block[:, i + 1 :], atol=1e-6
            ):
                hint = "subtract the error's share from the later columns; you added it"
            else:
                hint = "weight the error by row i of u, from column i + 1 on: u[i, i+1:]"
            raise CheckFailed(
                f"{exercise}: {where}: the columns after {i} are wrong (largest difference "
                f"{(got_block - expected_block).abs().max():.3g}); hint: {hint}"
            )
    return _passed(exercise, len(cases))


def check_pack_nibbles(fn: Callable[[list[int]], list[int]]) -> str:
    """Lab 07: fn(codes) packs 4-bit codes into 32-bit words, eight per word, code j of a word in bits 4j … 4j+3."""
    exercise = "exercise 07.2 (packing 4-bit codes)"
    g = torch.Generator().manual_seed(0)
    cases = [list(range(8)), [15] * 8, [0] * 16, torch.randint(0, 16, (32,), generator=g).tolist()]
    for codes in cases:
        expected = [w % 2**32 for w in quant.pack_rows(torch.tensor(codes)[:, None], 4)[:, 0].tolist()]
        got = _call(exercise, fn, list(codes))
        if not isinstance(got, (list, tuple)) or len(got) != len(codes) // 8:
            raise CheckFailed(
                f"{exercise}: {len(codes)} codes make {len(codes) // 8} words, got "
                f"{len(got) if isinstance(got, (list, tuple)) else type(got).__name__}"
            )
        got = [int(w) % 2**32 for w in got]  # signed int32 or unsigned: the same 32 bits
        if got != expected:
            k = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
            reversed_order = sum(c << (4 * (7 - j)) for j, c in enumerate(codes[8 * k : 8 * k + 8]))
            hint = (
                "that is the nibbles in reverse: code j of the word goes to bits 4j … 4j+3, so the first "
                "code is the lowest nibble (0x76543210 for codes 0 … 7)"
                if got[k] == reversed_order
                else "word k = Σ_j code[8k + j] << 4j for j = 0 … 7"
            )
            raise CheckFailed(
                f"{exercise}: codes {codes[8 * k : 8 * k + 8]} should pack to {expected[k]:#010x}, got "
                f"{got[k]:#010x}; hint: {hint}"
            )
    return _passed(exercise, len(cases))


# ----------------------------------------------------------------------------- lab 08: the LoRA forward and merge


def check_lora_forward(fn: Callable[..., torch.Tensor]) -> str:
    """Lab 08: fn(x, weight, bias, lora_A, lora_B, alpha, r) = x Wᵀ + b + (alpha / r) · x Aᵀ Bᵀ."""
    exercise = "exercise 08.1 (the LoRA forward)"
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 8, 5, 2), (2, 4, 16, 12, 4), (1, 6, 6, 1)]  # (*batch, in, out, r)
    for *batch, d_in, d_out, r in shapes:
        base = torch.nn.Linear(d_in, d_out)
        layer = lora.LoRALinear(base, r=r, alpha=2.0 * r + 1)  # alpha / r != 1, so a missing scale shows
        with torch.no_grad():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g))
        x = torch.randn(*batch, d_in, generator=g)
        expected = layer(x).detach()
        got = _call(
            exercise,
            fn,
            x,
            base.weight.detach(),
            base.bias.detach(),
            layer.lora_A.detach(),
            layer.lora_B.detach(),
            layer.alpha,
            r,
        )
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            raise CheckFailed(
                f"{exercise}: for x of shape {tuple(x.shape)} the output has shape "
                f"{tuple(expected.shape)}, got {getattr(got, 'shape', type(got).__name__)}"
            )
        if not torch.allclose(got, expected, rtol=1e-5, atol=1e-5):
            without_scale = (x @ base.weight.T + base.bias + x @ layer.lora_A.T @ layer.lora_B.T).detach()
            hint = (
                "the update must be scaled by alpha / r"
                if torch.allclose(got, without_scale, atol=1e-5)
                else "A is [r, in] and B is [out, r]: the update is x @ A.T @ B.T (A first), plus the base x @ W.T + b"
            )
            raise CheckFailed(
                f"{exercise}: wrong output for x {tuple(x.shape)}, in={d_in}, out={d_out}, r={r} "
                f"(largest difference {(got - expected).abs().max():.3g}); hint: {hint}"
            )
    return _passed(exercise, len(shapes))


def check_lora_merge(fn: Callable[..., torch.Tensor]) -> str:
    """Lab 08: fn(weight, lora_A, lora_B, alpha, r) is the merged weight W + (alpha / r) · B A."""
    exercise = "exercise 08.2 (merging an adapter)"
    g = torch.Generator().manual_seed(1)
    for d_in, d_out, r in [(8, 5, 2), (16, 12, 4), (6, 6, 1)]:
        layer = lora.LoRALinear(torch.nn.Linear(d_in, d_out), r=r, alpha=2.0 * r + 1)
        with torch.no_grad():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g))
        weight, a, b = layer.base.weight.detach(), layer.lora_A.detach(), layer.lora_B.detach()
        expected = layer.merged().weight.detach()
        got = _call(exercise, fn, weight.clone(), a, b, layer.alpha, r)
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            raise CheckFailed(
                f"{exercise}: the merged weight has the base weight's shape {tuple(expected.shape)}, "
                f"got {getattr(got, 'shape', type(got).__name__)}"
            )
        if not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
            hint = (
                "scale the update by alpha / r"
                if torch.allclose(got, weight + b @ a, atol=1e-6)
                else "ΔW = (alpha / r) · B @ A, of shape [out, in]; add it to W"
            )
            raise CheckFailed(
                f"{exercise}: in={d_in}, out={d_out}, r={r}: wrong merged weight (largest difference "
                f"{(got - expected).abs().max():.3g}); hint: {hint}"
            )
    return _passed(exercise, 3)
