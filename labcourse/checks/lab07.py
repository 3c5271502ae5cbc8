"""Lab 07's exercise checks: one GPTQ column, packed codes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from labcourse.checks.core import CheckFailed, call_answer, goes_on_with, report_passed
from labkit import quant


def _column_case(seed: int, rows: int = 6, cols: int = 5, bits: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(cols, 64, generator=g)
    x[1] += 0.9 * x[0]  # correlated inputs: the error update matters
    u = quant.inverse_hessian_factor(2 * x @ x.T / 64, 0.01)
    block = torch.randn(rows, cols, generator=g)
    scale, zero = quant.grid(block, quant.QuantConfig(bits=bits, group_size=-1))
    block[0, 0] = 3 * block[0].abs().max()  # beyond the grid: the code must be clamped
    return block, u, scale, zero, 2**bits - 1


@goes_on_with(quant.quantize_column, "quant.quantize_column")
def check_gptq_column(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable:
    """Lab 07: fn(block, i, u, scale, zero, maxq) rounds column i, updates the columns after it in place,
    and returns (codes, error / u[i, i])."""
    exercise = "exercise 07.1 (one GPTQ column)"
    cases = [(0, 0), (1, 1), (2, 4), (3, 2)]  # (seed, column); column 4 is the last: nothing to update
    for seed, i in cases:
        block, u, scale, zero, maxq = _column_case(seed)
        expected_block = block.clone()
        expected_q, expected_err = quant.quantize_column(expected_block, i, u, scale, zero, maxq)
        got_block = block.clone()
        result = call_answer(exercise, fn, got_block, i, u, scale.clone(), zero.clone(), maxq)
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
    return report_passed(exercise, len(cases))


def _pack_nibbles(codes: list[int]) -> list[int]:
    """labkit's answer to exercise 07.2, in the exercise's signature (unsigned 32-bit words)."""
    return [w % 2**32 for w in quant.pack_rows(torch.tensor(codes)[:, None], 4)[:, 0].tolist()]


@goes_on_with(_pack_nibbles, "quant.pack_rows")
def check_pack_nibbles(fn: Callable[[list[int]], list[int]]) -> Callable:
    """Lab 07: fn(codes) packs 4-bit codes into 32-bit words, eight per word, code j of a word in bits 4j … 4j+3."""
    exercise = "exercise 07.2 (packing 4-bit codes)"
    g = torch.Generator().manual_seed(0)
    cases = [list(range(8)), [15] * 8, [0] * 16, torch.randint(0, 16, (32,), generator=g).tolist()]
    for codes in cases:
        expected = _pack_nibbles(codes)
        got = call_answer(exercise, fn, list(codes))
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
    return report_passed(exercise, len(cases))
