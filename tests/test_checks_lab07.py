"""labkit.checks.lab07: one GPTQ column and packing 4-bit codes; each check passes the reference answer and fails
the usual wrong answers with a message that says what to fix."""

from __future__ import annotations

import pytest
import torch

from labkit import quant
from labkit.checks import core, lab07


def test_gptq_column_check_passes_the_reference():
    assert lab07.check_gptq_column(quant.quantize_column) is quant.quantize_column


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
        (lambda *args: quant.quantize_column(*args)[0], "return a pair"),
    ],
)
def test_gptq_column_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab07.check_gptq_column(wrong)


def test_pack_nibbles_check_passes_the_reference_signed_or_unsigned():
    signed = lambda codes: quant.pack_rows(torch.tensor(codes)[:, None], 4)[:, 0].tolist()  # noqa: E731
    unsigned = lambda codes: [sum(c << 4 * j for j, c in enumerate(codes[k : k + 8])) for k in range(0, len(codes), 8)]  # noqa: E731
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
