"""Claims are code: a sentence about this run's numbers is printed from them, with the condition that makes it true.

A notebook's prose cannot know what this machine measured: "GPTQ beats RTN" or "4-bit decode is faster", typed
into markdown, drifts and becomes false on another machine or run. So each such sentence is made here, from the
measured values, by a condition in code; where the condition fails, the other branch is printed (what happened
instead), never a sentence that has become false. Every function prints its sentence and returns it.

A measurement is one number (one run), a sequence of numbers (runs: repeats, seeds, calibration draws) or a
`bench.Timing`; its center is the median and its spread the range [min, max] over the runs. Two measurements are
ranked only where their ranges do not overlap, and `compare` ranks one run against one run only beyond a factor
the caller states: no spread was measured to judge a smaller difference against. `ratio` and `share` take a single
number as exact (a size, a count): pass runs or a Timing for anything noisy. Speeds are reported, never asserted:
nothing here raises on an outcome.
"""

from __future__ import annotations

import math
import numbers
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from labkit.bench import Timing, fmt_bytes, fmt_seconds

Measurement = float | Iterable[float] | Timing


@dataclass(frozen=True)
class Spread:
    """A measurement reduced to what a claim needs: its center (the median), its range and how many runs made it."""

    center: float
    low: float
    high: float
    runs: int


def spread(value: Measurement, *, name: str = "value", unit: str = "") -> Spread:
    """Center and range of one measurement, refusing what no claim can stand on (nothing, NaN, a negative time)."""
    if isinstance(value, Timing):
        if unit not in ("", "s"):
            raise ValueError(f"{name} is a Timing, in seconds, but the unit given is {unit!r}")
        values, unit = list(value.times), "s"
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        values = [value]
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        values = list(value)
    else:
        raise TypeError(f"{name} must be a number, a sequence of numbers or a Timing, got {type(value).__name__}")
    if not values:
        raise ValueError(f"{name} is empty: a claim needs at least one run")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name} holds {v!r} ({type(v).__name__}), not a number")
        if not math.isfinite(v):
            raise ValueError(f"{name} holds {v}: a claim needs finite values")
        if v < 0 and unit in ("s", "B"):
            raise ValueError(f"{name} holds {v} {unit}: a time or a size cannot be negative")
    floats = [float(v) for v in values]
    return Spread(statistics.median(floats), min(floats), max(floats), len(floats))


def overlap(a: Spread, b: Spread) -> bool:
    """Whether two ranges share a point: then the runs cannot tell the two measurements apart."""
    return a.low <= b.high and b.low <= a.high


def fmt_number(x: float, digits: int = 4) -> str:
    """`x` to about `digits` significant digits, in plain notation from 0.001 to a million: 23.45, 0.01234."""
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    if x == 0:
        return "0"
    if not 1e-3 <= abs(x) < 1e6:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{max(digits - 1 - math.floor(math.log10(abs(x))), 0)}f}"


def fmt_value(x: float, unit: str = "") -> str:
    """A value with its unit: seconds ("s") and bytes ("B") as bench writes them, anything else to 4 digits."""
    if unit == "s":
        return fmt_seconds(x)
    if unit == "B":
        return fmt_bytes(x)
    return f"{fmt_number(x)} {unit}".rstrip()


def _spreads(a_name: str, a: Measurement, b_name: str, b: Measurement, unit: str) -> tuple[Spread, Spread, str]:
    """Both measurements' spreads, and the claim's unit: seconds where a Timing is among them and none was given."""
    if not isinstance(unit, str) or not all(isinstance(n, str) and n.strip() for n in (a_name, b_name)):
        raise TypeError(f"names must be non-empty strings and unit a string, got {a_name!r}, {b_name!r}, {unit!r}")
    unit = "s" if unit == "" and (isinstance(a, Timing) or isinstance(b, Timing)) else unit
    return spread(a, name=a_name, unit=unit), spread(b, name=b_name, unit=unit), unit


def _range(name: str, s: Spread, unit: str) -> str:
    if s.runs == 1:
        return f"{name} {fmt_value(s.center, unit)} from one run"
    return f"{name} spans {fmt_value(s.low, unit)}–{fmt_value(s.high, unit)} over {s.runs} runs"


def _said(sentence: str) -> str:
    print(sentence)
    return sentence


def compare(
    a_name: str,
    a: Measurement,
    b_name: str,
    b: Measurement,
    *,
    lower_is_better: bool,
    unit: str = "",
    what: str = "",
    verb: str | None = None,
    factor: float | None = None,
) -> str:
    """Rank two methods only where their ranges do not overlap; the winner comes first with `verb` ("beats", or
    "is faster than" for times where lower is better), so the verdict holds for the spread the lab measured.

    One run each is ranked only where `factor` is given and the two lie more than `factor` times apart: a
    stated margin that stands in for the spread no one measured (a one-draw perplexity 12x worse is worse)."""
    if not isinstance(lower_is_better, bool):
        raise TypeError(f"lower_is_better must be a bool, got {type(lower_is_better).__name__}")
    if factor is not None and (
        isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not 1 < factor < math.inf
    ):
        raise ValueError(f"factor must be a finite number above 1, got {factor!r}")
    sa, sb, unit = _spreads(a_name, a, b_name, b, unit)
    on, values = f" on {what}" if what else "", f"{fmt_value(sa.center, unit)} vs {fmt_value(sb.center, unit)}"
    one_each = sa.runs == sb.runs == 1
    if one_each and factor is not None:
        if min(sa.center, sb.center) <= 0:
            raise ValueError(f"a factor compares positive values, got {sa.center} and {sb.center}")
        fold = max(sa.center, sb.center) / min(sa.center, sb.center)
        if fold <= factor:
            return _said(
                f"{a_name} and {b_name}{on}, one run each: {values}, {fmt_number(fold, 3)}× apart; not ranked, "
                f"since one run each is ranked only beyond {factor:g}×"
            )
    elif one_each:
        gap = fmt_value(abs(sa.center - sb.center), unit)
        return _said(
            f"{a_name} and {b_name}{on}, one run each: {values}, a difference of {gap}; not ranked, since one run "
            "measures no spread to judge it against"
        )
    elif overlap(sa, sb):
        ranges = f"{_range(a_name, sa, unit)}, {_range(b_name, sb, unit)}"
        return _said(f"{a_name} and {b_name} are within noise{on}: {values} ({ranges}: the ranges overlap)")
    a_wins = (sa.center < sb.center) == lower_is_better
    (win, sw), (lose, sl) = ((a_name, sa), (b_name, sb)) if a_wins else ((b_name, sb), (a_name, sa))
    verb = verb or ("is faster than" if unit == "s" and lower_is_better else "beats")
    better = "lower" if lower_is_better else "higher"
    why = (
        f", {fmt_number(fold, 3)}× apart (one run each, ranked since the gap is wider than {factor:g}×)"
        if one_each
        else f" ({_range(win, sw, unit)}, {_range(lose, sl, unit)}: no overlap)"
    )
    ranked = f"{fmt_value(sw.center, unit)} vs {fmt_value(sl.center, unit)}"
    return _said(f"{win} {verb} {lose}{on}: {ranked}, {better} is better{why}")


def ratio(
    a_name: str,
    a: Measurement,
    b_name: str,
    b: Measurement,
    *,
    unit: str = "",
    below: str | None = None,
    above: str | None = None,
) -> str:
    """How many times `a` is below or above `b`, in the word the data picks (`below`/`above`: smaller/larger, or
    faster/slower for times), with its range at the extremes of noisy inputs; within noise where the ranges overlap."""
    sa, sb, unit = _spreads(a_name, a, b_name, b, unit)
    if sa.low <= 0 or sb.low <= 0:
        raise ValueError(f"a ratio needs positive values, got {a_name} down to {sa.low} and {b_name} down to {sb.low}")
    values = f"{fmt_value(sa.center, unit)} vs {fmt_value(sb.center, unit)}"
    if sa.low == sa.high == sb.low == sb.high:
        return _said(f"{a_name} and {b_name} are equal: {values}")
    lo, hi = sa.low / sb.high, sa.high / sb.low  # a/b at the extremes
    if overlap(sa, sb):
        span = f"{fmt_number(lo, 3)}–{fmt_number(hi, 3)}"
        return _said(f"{a_name} and {b_name} are within noise: {values}, a ratio of {span} at the extremes")
    a_smaller = sa.center < sb.center
    below, above = below or ("faster" if unit == "s" else "smaller"), above or ("slower" if unit == "s" else "larger")
    fold, lo, hi = (sb.center / sa.center, 1 / hi, 1 / lo) if a_smaller else (sa.center / sb.center, lo, hi)
    span = "" if sa.runs == sb.runs == 1 else f"; {fmt_number(lo, 3)}–{fmt_number(hi, 3)}× at the extremes"
    return _said(f"{a_name} is {fmt_number(fold, 3)}× {below if a_smaller else above} than {b_name} ({values}{span})")


def share(part_name: str, part: Measurement, whole_name: str, whole: Measurement, *, unit: str = "") -> str:
    """What fraction of `whole` `part` is, and whether it is more than half (most of it), decided on its range."""
    sp, sw, unit = _spreads(part_name, part, whole_name, whole, unit)
    if sp.low < 0 or sw.low <= 0:
        raise ValueError(f"a share needs part >= 0 and whole > 0, got {part_name} {sp.low} and {whole_name} {sw.low}")
    c, lo, hi = sp.center / sw.center, sp.low / sw.high, sp.high / sw.low

    def pct(x: float) -> str:
        return f"{fmt_number(100 * x, 3)} %"

    extremes = "" if sp.runs == sw.runs == 1 else f"; {pct(lo)}–{pct(hi)} at the extremes"
    detail = f"({fmt_value(sp.center, unit)} of {fmt_value(sw.center, unit)}{extremes})"
    if lo > 1:
        return _said(
            f"{part_name} exceeds {whole_name}: {pct(c)} {detail}; a part above its whole: check what each measures"
        )
    if lo > 0.5:
        return _said(f"{part_name} is more than half of {whole_name}: {pct(c)} {detail}")
    if hi < 0.5:
        return _said(
            f"{part_name} is only {pct(c)} of {whole_name} {detail}: the rest, {pct(1 - c)}, is the larger part"
        )
    return _said(f"{part_name} is {pct(c)} of {whole_name} {detail}: not clearly more or less than half")


def say(condition: bool, if_true: str, if_false: str) -> str:
    """Print the sentence whose condition holds: the general form of any claim about this run's numbers."""
    if not isinstance(condition, bool):
        raise TypeError(f"condition must be a bool (wrap a numpy or torch test in bool()), got {type(condition)}")
    for name, text in (("if_true", if_true), ("if_false", if_false)):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{name} must be a non-empty sentence, got {text!r}")
    return _said(if_true if condition else if_false)
