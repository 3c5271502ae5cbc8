"""labkit.checks: every exercise check passes the reference answer, and fails the stub and the usual
wrong answers with a message that says what to fix."""

from __future__ import annotations

import statistics

import pytest
import torch

from labkit import bench, checks, distributed, evaluate, pipeline, precision, prune, tokenizer, train
from labkit.quant.checkpoint import pack_rows
from labkit.quant.gptq import quantize_column


def stub(*args):
    raise NotImplementedError


# ----------------------------------------------------------------------------- lab 01


def test_merge_pair_check_passes_the_reference():
    assert "passed" in checks.check_merge_pair(tokenizer.merge_pair)


def merge_overlapping(word, a, b, new):
    out, i = [], 0
    while i < len(word):
        out.append(new if word[i : i + 2] == (a, b) else word[i])
        i += 1  # the mistake: a match should skip two tokens
    return tuple(out)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (merge_overlapping, "uses up both tokens"),
        (lambda w, a, b, n: tokenizer.merge_pair(w[::-1], b, a, n)[::-1], "left to right"),
        (lambda w, a, b, n: tokenizer.merge_pair(w, b, a, n), "in that order"),
        (lambda w, a, b, n: list(tokenizer.merge_pair(w, a, b, n)) + [0], "return a tuple"),
    ],
)
def test_merge_pair_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.check_merge_pair(wrong)


def test_a_stub_is_reported_as_not_written_yet():
    with pytest.raises(checks.CheckFailed, match="not written yet"):
        checks.check_merge_pair(stub)
    with pytest.raises(checks.CheckFailed, match="expected a function"):
        checks.check_merge_pair(None)


# ----------------------------------------------------------------------------- lab 02


def test_loss_scale_check_passes_the_reference():
    assert "passed" in checks.check_update_loss_scale(precision.update_loss_scale)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (
            lambda s, g, inf, up, down, n: (
                (s * down, g) if inf else precision.update_loss_scale(s, g, inf, up, down, n)
            ),
            "restarts the count",
        ),
        (lambda s, g, inf, up, down, n: (s * down, 0) if inf else (s * up, 0), "only adds 1"),  # grows every step
        (lambda s, g, inf, up, down, n: (s * down, 0) if inf else (s, g + 1), "grows by growth_factor"),  # never grows
        (lambda s, g, inf, up, down, n: s, "new_scale, new_good_steps"),
        (stub, "not written yet"),
    ],
)
def test_loss_scale_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.check_update_loss_scale(wrong)


# ----------------------------------------------------------------------------- lab 03


def test_loss_divisors_check_passes_the_reference():
    assert "passed" in checks.check_loss_divisors(train.loss_divisors)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda counts: [n * len(counts) for n in counts], "per-micro-batch means"),
        (lambda counts: [sum(counts)], "one divisor per micro-batch"),
        (stub, "not written yet"),
    ],
)
def test_loss_divisors_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.check_loss_divisors(wrong)


# ----------------------------------------------------------------------------- lab 06


def test_nm_mask_check_passes_the_reference():
    assert "passed" in checks.check_nm_mask(lambda w, n, m: prune.nm_masks({"w": w}, n, m)["w"])


def signed_topk(w, n, m):
    groups = w.reshape(w.shape[0], -1, m)
    return torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.topk(n, dim=-1).indices, True).view_as(w)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda w, n, m: prune.nm_masks({"w": w}, n, m)["w"].float(), "bool"),
        (signed_topk, "magnitude"),
        (
            lambda w, n, m: torch.zeros_like(w, dtype=torch.bool).scatter_(  # the largest of the whole row
                -1, w.abs().topk(w.shape[1] // m * n, dim=-1).indices, True
            ),
            "within each group",
        ),
        (lambda w, n, m: torch.ones(3, dtype=torch.bool), "shape"),
        (stub, "not written yet"),
    ],
)
def test_nm_mask_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.check_nm_mask(wrong)


# ----------------------------------------------------------------------------- lab 08


def reference_lora_forward(x, weight, bias, lora_A, lora_B, alpha, r):
    return x @ weight.T + bias + (x @ lora_A.T @ lora_B.T) * (alpha / r)


def test_lora_forward_check_passes_the_reference():
    assert "passed" in checks.check_lora_forward(reference_lora_forward)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda x, w, b, A, B, alpha, r: x @ w.T + b + x @ A.T @ B.T, "alpha / r"),
        (lambda x, w, b, A, B, alpha, r: x @ w.T + (x @ A.T @ B.T) * (alpha / r), "plus the base"),  # no bias
        (lambda x, w, b, A, B, alpha, r: (x @ A.T @ B.T) * (alpha / r), "plus the base"),
        (lambda x, w, b, A, B, alpha, r: (x @ w.T)[..., :1], "shape"),
        (stub, "not written yet"),
    ],
)
def test_lora_forward_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.check_lora_forward(wrong)


# ----------------------------------------------------------------------------- lab 00


def median_time(work, sync, clock, warmup, repeats):
    return bench.time_fn(work, warmup=warmup, repeats=repeats, clock=clock, sync=sync).median


def test_median_time_check_passes_the_reference():
    assert "passed" in checks.check_median_time(median_time)


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
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.check_median_time(wrong)


# ----------------------------------------------------------------------------- lab 04


def test_reduce_scatter_check_passes_the_reference():
    assert "passed" in checks.check_reduce_scatter_step(distributed.ring_step)


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
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.check_reduce_scatter_step(wrong)


# ----------------------------------------------------------------------------- lab 05


def test_1f1b_check_passes_the_reference():
    assert "passed" in checks.check_1f1b_order(lambda s, p, m: pipeline.schedule_order("1f1b", s, p, m))


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda s, p, m: pipeline.schedule_order("gpipe", s, p, m), "that is GPipe"),
        (lambda s, p, m: pipeline.schedule_order("1f1b", min(s + 1, p - 1), p, m), "min\\(m, p − s\\) forwards"),
        (lambda s, p, m: [("F", i) for i in range(m)], "exactly one forward"),
    ],
)
def test_1f1b_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.check_1f1b_order(wrong)


# ----------------------------------------------------------------------------- lab 07


def test_gptq_column_check_passes_the_reference():
    assert "passed" in checks.check_gptq_column(quantize_column)


def column_variant(clamp=True, pivot=True, update=True, sign=-1):
    def fn(block, i, u, scale, zero, maxq):
        q = torch.round(block[:, i] / scale) + zero
        if clamp:
            q = q.clamp(0, maxq)
        err = block[:, i] - scale * (q - zero)
        if pivot:
            err = err / u[i, i]
        if update:
            block[:, i + 1 :] += sign * torch.outer(err, u[i, i + 1 :])
        return q, err

    return fn


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (column_variant(clamp=False), "clamp the codes"),
        (column_variant(pivot=False), "divide the rounding error by the pivot"),
        (column_variant(update=False), "update the columns after i in place"),
        (column_variant(sign=+1), "you added it"),
        (lambda *args: quantize_column(*args)[0], "return a pair"),
    ],
)
def test_gptq_column_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.check_gptq_column(wrong)


@pytest.mark.parametrize(
    "check",
    [checks.check_median_time, checks.check_reduce_scatter_step, checks.check_1f1b_order, checks.check_gptq_column],
)
def test_new_checks_report_a_stub_as_not_written_yet(check):
    with pytest.raises(checks.CheckFailed, match="not written yet"):
        check(stub)


# ----------------------------------------------------------------------------- second exercises: labs 03, 04, 07, 08


def lr_reference(step, steps, warmup, lr, min_lr):
    return train.lr_at(
        step, train.TrainConfig(steps=steps, warmup_steps=warmup, lr=lr, min_lr=min_lr, schedule="cosine")
    )


def test_lr_at_check_passes_the_reference():
    assert "passed" in checks.check_lr_at(lr_reference)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda *a: checks._cosine(*a, warmup_from_zero=True), "step 0 already trains"),
        (lambda *a: checks._cosine(*a, floor=0.0), "decay to min_lr, not to 0"),
        (lambda *a: checks._cosine(*a, span_offset=0), "the last step must reach min_lr"),
        (lambda step, steps, w, lr, mn: lr, "linear warm-up to lr, then"),
    ],
)
def test_lr_at_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.check_lr_at(wrong)


def all_gather_reference(chunks, step):
    return distributed.ring_step(chunks, len(chunks) - 1 + step)


def gather_adding(chunks, step):
    world = len(chunks)
    out = [list(row) for row in chunks]
    for r in range(world):
        c = (r + 1 - step) % world
        out[(r + 1) % world][c] = chunks[(r + 1) % world][c] + chunks[r][c]
    return out


def test_all_gather_check_passes_the_reference():
    assert "passed" in checks.check_all_gather_step(all_gather_reference)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (gather_adding, "replaces its copy, it does not add"),
        (lambda chunks, step: chunks, "sends the finished chunk \\(r \\+ 1 − s\\) mod p"),
        (lambda chunks, step: chunks[1:], "one list of"),
    ],
)
def test_all_gather_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.check_all_gather_step(wrong)


def test_pack_nibbles_check_passes_the_reference_signed_or_unsigned():
    signed = lambda codes: pack_rows(torch.tensor(codes)[:, None], 4)[:, 0].tolist()  # noqa: E731
    unsigned = lambda codes: [sum(c << 4 * j for j, c in enumerate(codes[k : k + 8])) for k in range(0, len(codes), 8)]  # noqa: E731
    assert "passed" in checks.check_pack_nibbles(signed)
    assert "passed" in checks.check_pack_nibbles(unsigned)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (
            lambda codes: [
                sum(c << 4 * (7 - j) for j, c in enumerate(codes[k : k + 8])) for k in range(0, len(codes), 8)
            ],
            "nibbles in reverse",
        ),
        (lambda codes: [sum(codes[k : k + 8]) for k in range(0, len(codes), 8)], "word k = "),
        (lambda codes: codes, "make"),
    ],
)
def test_pack_nibbles_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.check_pack_nibbles(wrong)


def test_lora_merge_check_passes_the_reference():
    assert "passed" in checks.check_lora_merge(lambda w, a, b, alpha, r: w + (alpha / r) * b @ a)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda w, a, b, alpha, r: w + b @ a, "scale the update by alpha / r"),
        (lambda w, a, b, alpha, r: w + (alpha / r) * (b @ a).T if w.shape[0] == w.shape[1] else w, "B @ A"),
        (lambda w, a, b, alpha, r: (alpha / r) * b @ a[:, :1], "shape"),
    ],
)
def test_lora_merge_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.check_lora_merge(wrong)


@pytest.mark.parametrize(
    "check", [checks.check_lr_at, checks.check_all_gather_step, checks.check_pack_nibbles, checks.check_lora_merge]
)
def test_second_exercise_checks_report_a_stub_as_not_written_yet(check):
    with pytest.raises(checks.CheckFailed, match="not written yet"):
        check(stub)


# ---------------------------------------------------------------------------- second exercises: labs 00, 01, 02, 05, 06


def test_windows_check_passes_the_reference():
    assert "passed" in checks.check_windows(evaluate.windows)


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
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.check_windows(wrong)


def test_pack_blocks_check_passes_the_reference():
    assert "passed" in checks.check_pack_blocks(lambda s, b: [s[i : i + b] for i in range(0, len(s) - b + 1, b)])


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda s, b: [s[i : i + b] for i in range(0, len(s), b)], "drop the tail"),
        (lambda s, b: [s[i : i + b] for i in range(0, len(s) - b + 1)], "no overlap"),
    ],
)
def test_pack_blocks_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.check_pack_blocks(wrong)


def test_kept_fraction_check_passes_the_reference():
    assert "passed" in checks.check_kept_fraction(precision.kept_fraction)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda v, dtype, scale: ((v * scale).to(dtype) != 0).float().mean().item(), "drop the exact zeros"),
        (lambda v, dtype, scale: precision.kept_fraction(v, dtype), "multiply by the loss scale"),
        (lambda v, dtype, scale: 1.0, "cast \\(values · scale\\)"),
    ],
)
def test_kept_fraction_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.check_kept_fraction(wrong)


def test_kept_fraction_counts_non_zero_values_and_refuses_all_zeros():
    assert precision.kept_fraction(torch.tensor([1e-10, 1.0, 0.0]), torch.float16) == 0.5
    assert precision.kept_fraction(torch.tensor([1e-10, 1.0]), torch.float16, scale=2.0**16) == 1.0
    with pytest.raises(ValueError, match="no non-zero"):
        precision.kept_fraction(torch.zeros(3), torch.float16)


def test_bubble_fraction_check_passes_the_reference():
    assert "passed" in checks.check_bubble_fraction(pipeline.bubble_fraction)


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
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.check_bubble_fraction(wrong)


def test_overall_sparsity_check_passes_the_reference():
    assert "passed" in checks.check_overall_sparsity(
        lambda layers: sum(z for z, _ in layers) / sum(p for _, p in layers)
    )


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda layers: sum(z / p for z, p in layers) / len(layers), "mean of per-layer sparsities"),
        (lambda layers: 0.0, "total zeros / total weights"),
    ],
)
def test_overall_sparsity_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(checks.CheckFailed, match=hint):
        checks.check_overall_sparsity(wrong)


@pytest.mark.parametrize(
    "check",
    [
        checks.check_windows,
        checks.check_pack_blocks,
        checks.check_kept_fraction,
        checks.check_bubble_fraction,
        checks.check_overall_sparsity,
    ],
)
def test_more_checks_report_a_stub_as_not_written_yet(check):
    with pytest.raises(checks.CheckFailed, match="not written yet"):
        check(stub)
