"""Claims: each sentence is decided by the measured values, each branch hand-computed, laws checked by Hypothesis."""

import ast
import re
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from labcourse import claims
from labcourse.claims import Spread, compare, fmt_number, fmt_value, ratio, say, share, spread
from labkit.bench import Timing

T4 = Timing([4.1e-3, 4.12e-3, 4.3e-3], warmup=1)  # 4-bit decode: median 4.12 ms, range 4.10–4.30 ms
T16 = Timing([6.8e-3, 6.7e-3, 6.9e-3], warmup=1)  # fp16 decode: median 6.80 ms, range 6.70–6.90 ms
MIB = 2**20


def test_claims_imports_nothing_from_labkit_but_bench():
    tree = ast.parse(Path(claims.__file__).read_text(encoding="utf-8"))
    found = {
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("labkit")
    }
    assert found == {"labkit.bench"}


# ----------------------------------------------------------------------------- measurements and numbers


def test_a_measurement_is_reduced_to_median_range_and_runs():
    assert spread([3.0, 1.0, 2.0]) == Spread(center=2.0, low=1.0, high=3.0, runs=3)
    assert spread([4.0, 1.0, 2.0, 3.0]) == Spread(center=2.5, low=1.0, high=4.0, runs=4)
    assert spread(5) == Spread(center=5.0, low=5.0, high=5.0, runs=1)
    assert spread(Timing([0.3, 0.1, 0.2], warmup=0)) == Spread(center=0.2, low=0.1, high=0.3, runs=3)
    assert spread(np.array([1.0, 2.0, 4.0])) == Spread(center=2.0, low=1.0, high=4.0, runs=3)


def test_numbers_are_written_to_four_significant_digits_and_units_as_bench_writes_them():
    cases = {23.4512: "23.45", 0.01234: "0.01234", 12345.6: "12346", 1.5e-7: "1.500e-07", 0: "0", -3.14159: "-3.142"}
    assert {x: fmt_number(x) for x in cases} == cases
    assert fmt_number(4.58296, 3) == "4.58"
    assert fmt_number(2.5e6) == "2.500e+06"
    assert fmt_value(0.0042, "s") == "4.20 ms"
    assert fmt_value(3 * MIB, "B") == "3.0 MiB"
    assert fmt_value(26.19, "%") == "26.19 %"
    assert fmt_value(17.9) == "17.90"


# ----------------------------------------------------------------------------- compare


def test_a_beats_b_when_the_ranges_do_not_overlap_and_the_sentence_is_printed(capsys):
    sentence = compare("A", [1, 2, 3], "B", [4, 5, 6], lower_is_better=True, what="loss")
    assert sentence == (
        "A beats B on loss: 2.000 vs 5.000, lower is better "
        "(A spans 1.000–3.000 over 3 runs, B spans 4.000–6.000 over 3 runs: no overlap)"
    )
    assert capsys.readouterr().out == sentence + "\n"


def test_b_beats_a_when_higher_is_better_and_the_winner_comes_first():
    assert compare("A", [1, 2, 3], "B", [4, 5, 6], lower_is_better=False, what="accuracy") == (
        "B beats A on accuracy: 5.000 vs 2.000, higher is better "
        "(B spans 4.000–6.000 over 3 runs, A spans 1.000–3.000 over 3 runs: no overlap)"
    )


def test_ranges_that_touch_are_within_noise_not_ranked():
    assert compare("A", [1, 3], "B", [3, 5], lower_is_better=True) == (
        "A and B are within noise: 2.000 vs 4.000 "
        "(A spans 1.000–3.000 over 2 runs, B spans 3.000–5.000 over 2 runs: the ranges overlap)"
    )


def test_one_run_each_reports_the_difference_and_does_not_rank_however_large():
    assert compare("GPTQ", 23.45, "RTN", 23.56, lower_is_better=True, what="perplexity") == (
        "GPTQ and RTN on perplexity, one run each: 23.45 vs 23.56, a difference of 0.1100; "
        "not ranked, since one run measures no spread to judge it against"
    )
    far_apart = compare("GPTQ", 1.0, "RTN", 100.0, lower_is_better=True)
    assert "one run each" in far_apart and "beats" not in far_apart


def test_one_run_each_is_ranked_only_beyond_a_stated_factor(capsys):
    assert compare("magnitude", 576.6, "Wanda", 46.26, lower_is_better=True, what="perplexity", factor=1.5) == (
        "Wanda beats magnitude on perplexity: 46.26 vs 576.6, lower is better, 12.5× apart "
        "(one run each, ranked since the gap is wider than 1.5×)"
    )
    assert capsys.readouterr().out.startswith("Wanda beats magnitude")
    assert compare("Wanda", 46.26, "SparseGPT", 39.96, lower_is_better=True, factor=1.5) == (
        "Wanda and SparseGPT, one run each: 46.26 vs 39.96, 1.16× apart; not ranked, "
        "since one run each is ranked only beyond 1.5×"
    )
    assert compare("A", 3.0, "B", 2.0, lower_is_better=False, factor=1.5).startswith("A and B, one run each")
    assert compare("A", 3.01, "B", 2.0, lower_is_better=False, factor=1.5).startswith("A beats B: 3.010 vs 2.000")


def test_a_factor_leaves_runs_with_a_spread_to_their_ranges():
    with_factor = compare("A", [1, 2], "B", [1.5, 3], lower_is_better=True, factor=1.01)
    assert with_factor == compare("A", [1, 2], "B", [1.5, 3], lower_is_better=True)
    assert "within noise" in with_factor


def test_a_single_number_against_runs_is_a_point_ranked_outside_their_range():
    assert compare("fp16", 17.9, "GPTQ", [18.2, 18.3, 18.25], lower_is_better=True, what="perplexity") == (
        "fp16 beats GPTQ on perplexity: 17.90 vs 18.25, lower is better "
        "(fp16 17.90 from one run, GPTQ spans 18.20–18.30 over 3 runs: no overlap)"
    )


def test_timings_read_faster_and_a_number_beside_a_timing_is_seconds():
    assert compare("fp16", T16, "4-bit", T4, lower_is_better=True, what="decode") == (
        "4-bit is faster than fp16 on decode: 4.12 ms vs 6.80 ms, lower is better "
        "(4-bit spans 4.10 ms–4.30 ms over 3 runs, fp16 spans 6.70 ms–6.90 ms over 3 runs: no overlap)"
    )
    assert compare("a", Timing([1.0, 1.1], warmup=0), "b", 2.0, lower_is_better=True).startswith(
        "a is faster than b: 1.05 s vs 2.00 s"
    )


def test_a_verb_of_ones_own_reads_for_a_throughput():
    sentence = compare(
        "4-bit", [210, 205, 215], "fp16", [120, 118, 125], lower_is_better=False, unit="tokens/s", verb="is faster than"
    )
    assert sentence.startswith("4-bit is faster than fp16: 210.0 tokens/s vs 120.0 tokens/s, higher is better")


# ----------------------------------------------------------------------------- ratio


def test_ratio_picks_the_direction_word_from_the_data(capsys):
    small = ratio("the 4-bit checkpoint", 112.7 * MIB, "the fp32 checkpoint", 516.5 * MIB, unit="B")
    assert small == "the 4-bit checkpoint is 4.58× smaller than the fp32 checkpoint (112.7 MiB vs 516.5 MiB)"
    assert capsys.readouterr().out == small + "\n"
    large = ratio("the fp32 checkpoint", 516.5 * MIB, "the 4-bit checkpoint", 112.7 * MIB, unit="B")
    assert large == "the fp32 checkpoint is 4.58× larger than the 4-bit checkpoint (516.5 MiB vs 112.7 MiB)"


def test_ratio_of_timings_reads_faster_or_slower_with_its_range_from_the_extremes():
    # 6.80 / 4.12 = 1.650; the extremes 6.70 / 4.30 = 1.558 and 6.90 / 4.10 = 1.683
    assert ratio("4-bit decode", T4, "fp16 decode", T16) == (
        "4-bit decode is 1.65× faster than fp16 decode (4.12 ms vs 6.80 ms; 1.56–1.68× at the extremes)"
    )
    assert ratio("fp16 decode", T16, "4-bit decode", T4) == (
        "fp16 decode is 1.65× slower than 4-bit decode (6.80 ms vs 4.12 ms; 1.56–1.68× at the extremes)"
    )


def test_ratio_whose_range_straddles_one_is_within_noise():
    close = Timing([4.4e-3, 4.2e-3, 3.9e-3], warmup=1)  # 4.10 / 4.40 = 0.932 and 4.30 / 3.90 = 1.103
    assert ratio("4-bit decode", T4, "fp16 decode", close) == (
        "4-bit decode and fp16 decode are within noise: 4.12 ms vs 4.20 ms, a ratio of 0.932–1.10 at the extremes"
    )


def test_ratio_words_of_ones_own_and_equal_points():
    assert ratio("4-bit", 200, "fp16", 100, unit="tokens/s", above="faster", below="slower") == (
        "4-bit is 2.00× faster than fp16 (200.0 tokens/s vs 100.0 tokens/s)"
    )
    assert ratio("a", 5, "b", 5) == "a and b are equal: 5.000 vs 5.000"


# ----------------------------------------------------------------------------- share and say


def test_share_says_more_than_half_only_when_it_is():
    assert share("the weight-read floor", 3.1e-3, "the decode step", 4.2e-3, unit="s") == (
        "the weight-read floor is more than half of the decode step: 73.8 % (3.10 ms of 4.20 ms)"
    )


def test_share_under_half_says_what_is_the_larger_part_instead():
    # 1.1 / 4.2 = 26.2 %; extremes 1.1 / 4.3 = 25.6 % and 1.1 / 4.1 = 26.8 %
    assert share("the floor", 1.1e-3, "the decode step", Timing([4.2e-3, 4.3e-3, 4.1e-3], warmup=1)) == (
        "the floor is only 26.2 % of the decode step (1.10 ms of 4.20 ms; 25.6 %–26.8 % at the extremes): "
        "the rest, 73.8 %, is the larger part"
    )


def test_share_whose_range_straddles_half_is_not_called_more_even_with_its_median_above():
    assert share("x", [40, 55, 70], "y", 100) == (
        "x is 55.0 % of y (55.00 of 100.0; 40.0 %–70.0 % at the extremes): not clearly more or less than half"
    )
    assert share("x", 1, "y", 2).endswith("not clearly more or less than half")


def test_share_above_the_whole_says_so_only_when_every_run_is():
    assert share("x", 120, "y", 100) == (
        "x exceeds y: 120 % (120.0 of 100.0); a part above its whole: check what each measures"
    )
    # 105 of 100 at the median, but 95 / 110 = 86.4 % at the extremes: more than half, not more than all
    assert share("x", [95, 105, 115], "y", [90, 100, 110]).startswith("x is more than half of y: 105 %")


def test_say_prints_the_branch_that_holds(capsys):
    assert say(0.74 > 0.5, "bandwidth is most of it", "other costs dominate") == "bandwidth is most of it"
    assert say(0.26 > 0.5, "bandwidth is most of it", "other costs dominate") == "other costs dominate"
    assert capsys.readouterr().out == "bandwidth is most of it\nother costs dominate\n"


# ----------------------------------------------------------------------------- refused at the boundary


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: spread(float("nan")), ValueError, "finite"),
        (lambda: spread([]), ValueError, "empty"),
        (lambda: spread([1.0, float("inf")], name="loss"), ValueError, "loss holds inf"),
        (lambda: spread(Timing([0.1, -0.2], warmup=0), name="decode"), ValueError, "decode holds -0.2 s"),
        (lambda: spread(-1.0, unit="B"), ValueError, "cannot be negative"),
        (lambda: spread(Timing([0.1], warmup=0), unit="MiB"), ValueError, "Timing, in seconds"),
        (lambda: spread("3.5"), TypeError, "got str"),
        (lambda: spread(True), TypeError, "got bool"),
        (lambda: spread(None), TypeError, "got NoneType"),
        (lambda: spread([1.0, "2"]), TypeError, "not a number"),
        (lambda: spread(torch.tensor([1.0, 2.0])), TypeError, "not a number"),
        (lambda: compare("", 1, "B", 2, lower_is_better=True), TypeError, "names"),
        (lambda: compare("A", 1, "B", 2, lower_is_better="yes"), TypeError, "lower_is_better"),
        (lambda: compare("A", Timing([0.1], 0), "B", 0.2, lower_is_better=True, unit="ms"), ValueError, "Timing"),
        (lambda: compare("A", 1, "B", -2, lower_is_better=True, unit="s"), ValueError, "B holds -2"),
        (lambda: ratio("A", 0.0, "B", 1.0), ValueError, "positive"),
        (lambda: ratio("A", 1.0, "B", 2.0, unit=3), TypeError, "unit"),
        (lambda: share("A", 1.0, "B", 0.0), ValueError, "whole > 0"),
        (lambda: share("A", -1.0, "B", 2.0), ValueError, "part >= 0"),
        (lambda: say(np.bool_(True), "yes", "no"), TypeError, "bool"),
        (lambda: say(1, "yes", "no"), TypeError, "bool"),
        (lambda: say(True, "", "no"), ValueError, "if_true"),
        (lambda: compare("A", 1, "B", 2, lower_is_better=True, factor=1.0), ValueError, "above 1"),
        (lambda: compare("A", 1, "B", 2, lower_is_better=True, factor=float("nan")), ValueError, "above 1"),
        (lambda: compare("A", 1, "B", 2, lower_is_better=True, factor=True), ValueError, "above 1"),
        (lambda: compare("A", 0, "B", 2, lower_is_better=True, factor=2), ValueError, "positive values"),
        (lambda: fmt_number(1.0, 0), ValueError, "digits"),
    ],
)
def test_bad_inputs_are_refused_with_a_clear_message(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


# ----------------------------------------------------------------------------- laws

RUNS = st.lists(st.floats(1.0, 1000.0), min_size=1, max_size=5)


def verdict(sentence: str) -> str:
    """'unranked', 'noise', or the winner's name (named first, before ' beats ')."""
    if "one run each" in sentence:
        return "unranked"
    if "are within noise" in sentence:
        return "noise"
    winner, beats, _ = sentence.partition(" beats ")
    assert beats, sentence
    return winner


@given(a=RUNS, b=RUNS, lower=st.booleans())
def test_the_verdict_is_decided_by_the_ranges_alone(a, b, lower):
    found = verdict(compare("A", a, "B", b, lower_is_better=lower))
    if len(a) == len(b) == 1:
        assert found == "unranked"
    elif max(a) < min(b):
        assert found == ("A" if lower else "B")
    elif max(b) < min(a):
        assert found == ("B" if lower else "A")
    else:
        assert found == "noise"


@given(a=RUNS, b=RUNS, lower=st.booleans())
def test_the_order_of_the_arguments_does_not_change_the_verdict(a, b, lower):
    assert verdict(compare("A", a, "B", b, lower_is_better=lower)) == verdict(
        compare("B", b, "A", a, lower_is_better=lower)
    )


@given(a=RUNS, b=RUNS)
def test_flipping_which_way_is_better_swaps_the_winner_and_nothing_else(a, b):
    low, high = (verdict(compare("A", a, "B", b, lower_is_better=lower)) for lower in (True, False))
    assert high == {"A": "B", "B": "A"}.get(low, low)


@given(a=RUNS, b=RUNS, lower=st.booleans(), power=st.integers(-20, 20))
def test_scaling_every_value_by_a_positive_constant_leaves_the_verdict(a, b, lower, power):
    c = 2.0**power  # a power of two scales a float exactly, so every min, max and median scales with it
    scaled = compare("A", [c * x for x in a], "B", [c * x for x in b], lower_is_better=lower)
    assert verdict(scaled) == verdict(compare("A", a, "B", b, lower_is_better=lower))


@given(a=RUNS, b=RUNS)
def test_ratio_read_the_other_way_gives_the_same_fold_and_the_other_word(a, b):
    forward, backward = ratio("A", a, "B", b), ratio("B", b, "A", a)
    if max(a) >= min(b) and max(b) >= min(a):
        assert all("are within noise" in s or "are equal" in s for s in (forward, backward))
        return
    there = re.match(r"A is (\S+)× (smaller|larger) than B", forward)
    back = re.match(r"B is (\S+)× (smaller|larger) than A", backward)
    assert there and back and there[1] == back[1] and {there[2], back[2]} == {"smaller", "larger"}
    assert (there[2] == "smaller") == (statistics.median(a) < statistics.median(b))


@given(part=RUNS, whole=RUNS)
def test_share_claims_only_what_every_pairing_of_runs_agrees_on(part, whole):
    sentence, fractions = share("P", part, "W", whole), [p / w for p in part for w in whole]
    if " exceeds " in sentence:
        assert all(f > 1 for f in fractions)
    elif " is more than half of " in sentence:
        assert all(f > 0.5 for f in fractions)
    elif " is only " in sentence:
        assert all(f < 0.5 for f in fractions)
    else:
        assert sentence.endswith("not clearly more or less than half") and min(fractions) <= 0.5 <= max(fractions)
