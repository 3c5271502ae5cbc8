"""What every exercise check shares: `CheckFailed`, calling the student's function (a stub still raising
NotImplementedError is reported as the exercise left to do), the reference the lab goes on with while an
exercise is not written, comparing rows, and the pass message."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


class CheckFailed(AssertionError):
    """An exercise answer that does not match the reference; the message says how."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows instead of a traceback through labkit: the message is the whole story."""
        return [f"{type(self).__name__}: {self}"]


class NotWritten(CheckFailed):
    """The exercise still raises NotImplementedError: the student build's stub, not yet replaced."""


def call_answer(exercise: str, fn: Callable, *args: Any) -> Any:
    """The student's function called on one case; the student build's unwritten stub raises NotWritten."""
    if not callable(fn):
        raise CheckFailed(f"{exercise}: expected a function, got {type(fn).__name__}")
    try:
        return fn(*args)
    except NotImplementedError:
        raise NotWritten(f"{exercise}: not written yet") from None


def goes_on_with(
    reference: Callable, name: str
) -> Callable[[Callable[[Callable], str]], Callable[[Callable], Callable]]:
    """Make a check return the function the lab goes on with: the student's once it passes, and labkit's
    `reference` (shown to the student as `name`) while the exercise is not written, so that Run All
    reaches the end of a lab either way. A wrong answer still stops the cell with CheckFailed."""

    def decorate(check: Callable[[Callable], str]) -> Callable[[Callable], Callable]:
        @functools.wraps(check)
        def run(fn: Callable) -> Callable:
            try:
                check(fn)
            except NotWritten as err:
                print(
                    f"{err}: the lab goes on with labkit's `{name}` for now. To try yours, replace the "
                    "`raise NotImplementedError` in the exercise cell with your code, run that cell, then this one."
                )
                return reference
            return fn

        run.shown_as = name  # type: ignore[attr-defined]  # what the lab calls the reference (its source is an answer)
        return run

    return decorate


def reveal(what: str, prediction: Any, measured: Any, unit: str = "") -> None:
    """Print the student's prediction (written before the measurement ran) next to what was measured, with the
    factor between them for a number; a prediction left as None is asked for next time, never filled in. Returns
    nothing, so that a notebook cell ending with it shows the line once."""
    number = isinstance(measured, (int, float)) and not isinstance(measured, bool)
    shown = f"{measured:.3g}{unit}" if number else f"{measured}{unit}"
    if prediction is None:
        line = f"{what}: measured {shown}. You wrote no prediction: next time, guess first; the gap is the lesson."
    elif (
        number
        and isinstance(prediction, (int, float))
        and not isinstance(prediction, bool)
        and prediction > 0 < measured
    ):
        factor = max(prediction, measured) / min(prediction, measured)
        side = "close" if factor < 1.5 else ("too high" if prediction > measured else "too low")
        line = f"{what}: you predicted {prediction:.3g}{unit}, measured {shown}: {side} (a factor {factor:.2g})."
    else:
        line = f"{what}: you predicted {prediction!r}, measured {shown}."
    print(line)


def as_rows(got: Any, kind: type) -> Any:
    """A list of sequences as a list of `kind` (tuple or list), for comparing; anything else unchanged."""
    if isinstance(got, (list, tuple)) and all(isinstance(x, (list, tuple)) for x in got):
        return [kind(x) for x in got]
    return got


def report_passed(exercise: str, cases: int) -> str:
    """Print and return the line a check ends with when every case passed."""
    message = f"{exercise}: passed ({cases} cases)"
    print(message)
    return message
