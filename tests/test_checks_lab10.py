"""labcourse.checks.lab10: the matmul share of a profiled step and energy per token; each check passes answers written
here from the definitions (not labkit's) and fails the usual wrong answers with a message that says what to fix."""

from __future__ import annotations

import pytest

from labcourse.checks import core, lab10

PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}


def matmul_share_by_hand(operators):
    total = sum(r["self_s"] for r in operators)
    return sum(r["self_s"] for r in operators if r["name"] in PRODUCTS) / total if total else 0.0


def joules_per_token_by_hand(times, watts, tokens):
    joules = 0.0
    for i in range(1, len(times)):
        joules += (times[i] - times[i - 1]) * 0.5 * (watts[i] + watts[i - 1])
    return joules / tokens


def test_the_checks_pass_hand_written_answers():
    assert lab10.check_matmul_share(matmul_share_by_hand) is matmul_share_by_hand
    assert lab10.check_joules_per_token(joules_per_token_by_hand) is joules_per_token_by_hand


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda ops: 100 * matmul_share_by_hand(ops), "not a percentage"),
        (
            lambda ops: (
                sum(r["self_s"] for r in ops if "mm" in r["name"] or "linear" in r["name"])
                / sum(r["self_s"] for r in ops)
            ),
            "by exact name",
        ),
        (lambda ops: sum(r["self_s"] for r in ops if r["name"] in PRODUCTS), "divide"),
    ],
)
def test_matmul_share_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab10.check_matmul_share(wrong)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda t, w, n: sum(w[i] * (t[i + 1] - t[i]) for i in range(len(t) - 1)) / n, "trapezoids"),
        (lambda t, w, n: sum(w) / len(w) * (t[-1] - t[0]) / n, "not evenly spaced"),
        (lambda t, w, n: joules_per_token_by_hand(t, w, n) * n, "divide by tokens"),
    ],
)
def test_joules_per_token_check_explains_wrong_answers(wrong, hint):
    with pytest.raises(core.CheckFailed, match=hint):
        lab10.check_joules_per_token(wrong)


def test_an_unwritten_exercise_goes_on_with_labkits_answer(capsys):
    def stub(*args):
        raise NotImplementedError

    rows = [{"name": "aten::mm", "self_s": 1.0}, {"name": "aten::add", "self_s": 3.0}]
    assert lab10.check_matmul_share(stub)(rows) == 0.25
    assert "exercise 10.1" in capsys.readouterr().out
