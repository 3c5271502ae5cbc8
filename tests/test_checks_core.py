"""labcourse.checks as a whole: a stub (the student build's `raise NotImplementedError`) is reported as the exercise
left to do and the lab goes on with labkit's reference, which answers the exercise as the check wants; a wrong
answer stops the cell with one line, not a traceback through labkit; the package re-exports every lab's checks."""

from __future__ import annotations

import importlib

import pytest

from labcourse import checks
from labcourse.checks import core
from tests.stubs import stub

ALL_CHECKS = [getattr(checks, name) for name in checks.__all__ if name.startswith("check_")]


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
def test_a_stub_is_reported_in_one_line_and_the_lab_goes_on_with_the_reference(check, capsys):
    reference = check(stub)
    said = capsys.readouterr().out
    assert said.count("\n") == 1 and "not written yet" in said and "goes on with labkit's" in said
    assert reference is not stub and callable(reference)
    assert check(reference) is reference  # the reference has the exercise's signature and its answers
    assert "passed" in capsys.readouterr().out


def test_a_non_function_is_an_error():
    with pytest.raises(checks.CheckFailed, match="expected a function"):
        checks.check_merge_pair(None)


def test_a_wrong_answer_shows_one_line_in_ipython_not_a_traceback(capsys):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    cell = "from labcourse import checks\nchecks.check_loss_divisors(lambda counts: [1] * len(counts))"
    result = shell.run_cell(cell)
    shown = capsys.readouterr().out
    assert isinstance(result.error_in_exec, checks.CheckFailed)
    assert "CheckFailed: exercise 03.1" in shown and "hint:" in shown
    assert "Traceback" not in shown and "labcourse/checks" not in shown and len(shown.strip().splitlines()) == 1


def test_the_package_re_exports_every_check_of_every_lab():
    labs = [importlib.import_module(f"labcourse.checks.lab{n:02d}") for n in range(11)]
    defined = {name: getattr(lab, name) for lab in labs for name in vars(lab) if name.startswith("check_")}
    assert len(defined) == 22  # two exercises in each of labs 00 to 10
    assert sorted(checks.__all__) == sorted([*defined, "CheckFailed", "reveal"])
    assert all(getattr(checks, name) is fn for name, fn in defined.items())
    assert checks.CheckFailed is core.CheckFailed and issubclass(checks.CheckFailed, AssertionError)


@pytest.mark.parametrize(
    "prediction, says",
    [
        (None, "measured 0.36. You wrote no prediction"),
        (0.01, "you predicted 0.01, measured 0.36: too low (a factor 36)"),
        (1.0, "you predicted 1, measured 0.36: too high (a factor 2.8)"),
        (0.3, "you predicted 0.3, measured 0.36: close (a factor 1.2)"),
        ("linear", "you predicted 'linear', measured 0.36."),
        (-1, "you predicted -1, measured 0.36."),
    ],
)
def test_reveal_puts_the_prediction_beside_the_measurement(prediction, says, capsys):
    assert checks.reveal("relative error", prediction, 0.36) is None  # a cell ending with it shows the line once
    out = capsys.readouterr().out
    assert says in out and out.startswith("relative error: ") and out.count("\n") == 1


def test_reveal_shows_an_answer_that_is_not_a_number(capsys):
    checks.reveal("the largest item", "optimizer state", "logits")
    assert capsys.readouterr().out == "the largest item: you predicted 'optimizer state', measured logits.\n"


@pytest.mark.parametrize("name", [n for n in checks.__all__ if n.startswith("check_")])
def test_no_check_passes_a_nan(name, capsys):
    """abs(nan - x) > tol is False: a check written that way passed `return float('nan')` (five did)."""
    check = getattr(checks, name).__wrapped__  # the check itself, not the lab's fallback to labkit's answer
    for answer in (float("nan"), [float("nan")]):
        with pytest.raises(Exception):  # noqa: B017, PT011 (CheckFailed, or the check's own error on a wrong type)
            check(lambda *args, answer=answer: answer)
    assert "passed" not in capsys.readouterr().out
