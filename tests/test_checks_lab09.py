"""labcourse.checks.lab09: bytes per rank under ZeRO stage k and one ZeRO-1 step; each check passes answers written
here from the definitions (not labkit's) and fails the usual wrong answers with a message that says what to fix."""

from __future__ import annotations

import math

import pytest
import torch

from labcourse.checks import core, lab09


def zero_bytes_by_hand(n, stage, world):
    shard = math.ceil(n / world)
    weights = 4 * (shard if stage >= 3 else n)
    grads = 4 * (shard if stage >= 2 else n)
    moments = 8 * (shard if stage >= 1 else n)
    return weights + grads + moments


def test_hand_counts_match_the_zero_paper_arithmetic():
    assert zero_bytes_by_hand(1000, 0, 8) == 16_000  # DDP: 16 bytes per parameter everywhere
    assert zero_bytes_by_hand(1000, 1, 8) == 8_000 + 1_000  # 125 parameters' moments
    assert zero_bytes_by_hand(1000, 3, 8) == 2_000
    assert zero_bytes_by_hand(7, 3, 2) == 16 * 4  # a shard of 7 over 2 ranks is 4 parameters


def test_zero_bytes_check_passes_a_hand_written_answer():
    assert lab09.check_zero_bytes(zero_bytes_by_hand) is zero_bytes_by_hand


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda n, stage, world: 16 * n, "one more kind"),
        (lambda n, stage, world: 16 * n if stage == 0 else 5, "shard what the stage shards"),
        (lambda n, stage, world: 16 * n if stage == 0 else 16 * n // world, "only stage 3 shards everything"),
        (lambda n, stage, world: zero_bytes_by_hand(n, max(0, stage - 1), world), "one more kind"),
        (lambda n, stage, world: 8 * n if stage == 0 else zero_bytes_by_hand(n, stage, world), "stage 0 is DDP"),
        (  # exact division instead of padded shards: right for 1000 over 1, 2, 8 ranks, wrong for 7 over 2
            lambda n, stage, world: sum(s * n / (world if stage >= k else 1) for k, s in ((3, 4), (2, 4), (1, 8))),
            "ceil",
        ),
    ],
)
def test_zero_bytes_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab09.check_zero_bytes(wrong)


def zero1_step_by_hand(params, grads, rank, world, lr):
    size = -(-params.numel() // world)
    padded_p = torch.cat([params, params.new_zeros(size * world - params.numel())])
    padded_g = torch.cat([grads, grads.new_zeros(size * world - grads.numel())])
    return padded_p[rank * size : (rank + 1) * size] - lr * padded_g[rank * size : (rank + 1) * size]


def test_zero1_step_check_passes_a_hand_written_answer():
    assert lab09.check_zero1_step(zero1_step_by_hand) is zero1_step_by_hand


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda p, g, rank, world, lr: p - lr * g, "only this rank's slice"),
        (lambda p, g, rank, world, lr: (p - lr * g).chunk(world)[rank] if world > 1 else p - lr * g, "ceil"),
        (lambda p, g, rank, world, lr: zero1_step_by_hand(p, -g, rank, world, lr), "params - lr"),
        (lambda p, g, rank, world, lr: zero1_step_by_hand(p, g, world - 1 - rank, world, lr), "rank r owns"),
    ],
)
def test_zero1_step_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab09.check_zero1_step(wrong)
