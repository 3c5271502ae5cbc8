from pathlib import Path

import pytest

from labcourse import expected
from labcourse.expected import EXPECTED, ExpectationFailed, Range, check

LABS = sorted(p.name[:2] for p in (Path(__file__).parents[1] / "labs").glob("[0-9][0-9]_*.ipynb"))


def test_every_lab_has_cpu_figures_and_every_range_is_ordered():
    assert len(LABS) >= 10 and set(LABS) <= set(EXPECTED)
    for lab in LABS:
        assert EXPECTED[lab].get("cpu"), f"lab {lab} has no cpu reference figures"
        for profile, table in EXPECTED[lab].items():
            assert profile in expected.REFERENCE
            assert all(r.low <= r.high for r in table.values())


def test_an_empty_range_is_refused():
    with pytest.raises(ValueError, match="empty range"):
        Range(2.0, 1.0)


def test_in_range_passes_and_prints_the_comparison(capsys):
    rows = check("00", {"perplexity": 17.9, "best fp32 matmul TFLOP/s": 0.3}, profile="cpu")
    assert [r.ok for r in rows] == [True, True]
    out = capsys.readouterr().out
    assert "17.9" in out and "expected 17.7–18.1" in out and "profile 'cpu'" in out


def test_a_quality_miss_fails_and_names_the_figure():
    with pytest.raises(ExpectationFailed, match=r"perplexity = 25 not in \[17.7, 18.1\]"):
        check("00", {"perplexity": 25.0, "best fp32 matmul TFLOP/s": 0.3}, profile="cpu")


def test_a_speed_miss_is_reported_not_failed(capsys):
    rows = check("00", {"perplexity": 17.9, "best fp32 matmul TFLOP/s": 40.0}, profile="cpu")
    assert rows[1].ok is False
    assert "speed depends on your hardware" in capsys.readouterr().out


def test_a_resident_set_miss_is_reported_with_its_reason_not_failed(capsys):
    rows = check("09", {"added / predicted state, FSDP2": 0.53}, profile="smoke", unmeasured=UNMEASURED_09)
    assert rows[0].ok is False
    assert "0.53  expected 0.9–1.1 (reported only)  outside: the resident set depends" in capsys.readouterr().out


UNMEASURED_09 = {m: "not this test's" for m in EXPECTED["09"]["smoke"] if m != "added / predicted state, FSDP2"}


def test_a_profile_without_figures_shows_the_values_and_checks_nothing(capsys):
    rows = check("00", {"perplexity": 99.0}, profile="gpu")
    assert rows[0].ok is None
    assert "No reference figures recorded for profile 'gpu'" in capsys.readouterr().out


def test_a_figure_this_machine_cannot_measure_is_listed_with_its_reason_not_failed(capsys):
    why = "bf16 is emulated on this CPU"
    unmeasured = {"final loss, bf16": why, "final loss difference bf16 - fp32": why}
    check("02", {"final loss, fp32": 7.4, "bf16 step time / fp32": 30.0}, profile="cpu", unmeasured=unmeasured)
    out = capsys.readouterr().out
    assert "final loss, bf16" in out and f"not measured on this machine: {why}" in out


def test_a_listed_figure_never_measured_fails_even_when_the_rest_pass(capsys):
    with pytest.raises(ExpectationFailed, match="final loss, bf16 was never measured"):
        check("02", {"final loss, fp32": 7.4}, profile="cpu")
    assert "MISSING" in capsys.readouterr().out  # and the table was printed first


def test_a_figure_cannot_be_measured_and_unmeasured_at_once():
    with pytest.raises(ValueError, match="measured and unmeasured at once: perplexity"):
        check("00", {"perplexity": 18.7}, profile="smoke", unmeasured={"perplexity": "no model"})


def test_an_unknown_lab_is_a_clear_error():
    with pytest.raises(ValueError, match="no expected results for lab '42'"):
        check("42", {}, profile="cpu")


def test_extra_figures_are_shown_without_a_range(capsys):
    rows = check("00", {"perplexity": 18.7, "load seconds": 3.0}, profile="smoke")
    assert rows[1].expected is None and rows[1].ok is None
    assert "load seconds" in capsys.readouterr().out


def test_the_profile_defaults_to_the_active_one(monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_PROFILE", "smoke")
    check("00", {"perplexity": 18.7})
    assert "profile 'smoke'" in capsys.readouterr().out
