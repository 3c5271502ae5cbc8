"""labcourse.checks.lab07: one GPTQ column and packing 4-bit codes; each check passes an answer written here from
the definition (not labkit's), whose values on small inputs are computed by hand, and fails the usual wrong answers
with a message that says what to fix."""

from __future__ import annotations

import pytest
import torch

from labcourse.checks import core, lab07


def column_by_hand(block, i, u, scale, zero, maxq):
    """Round column i to the grid; spread its error, over the pivot u[i, i], along row i of u to the later columns."""
    q = torch.clamp(torch.round(block[:, i] / scale) + zero, 0, maxq)
    err = (block[:, i] - scale * (q - zero)) / u[i, i]
    block[:, i + 1 :] -= err[:, None] * u[i, i + 1 :][None, :]
    return q, err


def test_gptq_column_check_passes_a_hand_written_answer():
    block = torch.tensor([[0.5, 1.0]])
    u = torch.tensor([[2.0, 1.0], [0.0, 1.0]])
    q, err = column_by_hand(block, 0, u, torch.tensor([0.25]), torch.tensor([2.0]), 3)
    # 0.5 / 0.25 + 2 = 4 is clamped to the top code 3, which means 0.25 · (3 − 2) = 0.25: error 0.25, over the
    # pivot 2 = 0.125, taken once (u[0, 1] = 1) from the next column: 1.0 → 0.875
    assert (q.tolist(), err.tolist(), block[0, 1].item()) == ([3.0], [0.125], 0.875)
    assert lab07.check_gptq_column(column_by_hand) is column_by_hand


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
        (lambda *args: column_by_hand(*args)[0], "return a pair"),
    ],
)
def test_gptq_column_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab07.check_gptq_column(wrong)


def test_pack_nibbles_check_passes_a_hand_written_answer_signed_or_unsigned():
    unsigned = lambda codes: [sum(c << 4 * j for j, c in enumerate(codes[k : k + 8])) for k in range(0, len(codes), 8)]  # noqa: E731
    signed = lambda codes: [w - 2**32 if w >= 2**31 else w for w in unsigned(codes)]  # noqa: E731  int32 storage
    assert unsigned(list(range(8))) == [0x76543210]  # code j in bits 4j … 4j+3
    assert signed([15] * 8) == [-1]  # 0xFFFFFFFF as an int32
    assert lab07.check_pack_nibbles(signed) is signed
    assert lab07.check_pack_nibbles(unsigned) is unsigned


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
    with pytest.raises(core.CheckFailed, match=hint):
        lab07.check_pack_nibbles(wrong)
