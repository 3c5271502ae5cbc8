"""What every exercise check shares: `CheckFailed`, calling the student's function (a stub still raising
NotImplementedError is reported as the exercise left to do), comparing rows, and the pass message."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


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
