"""labkit.checks as a whole: a stub (the student build's `raise NotImplementedError`) or a non-function is
reported as the exercise left to do by every check, and the package re-exports every lab's checks."""

from __future__ import annotations

import importlib

import pytest

from labkit import checks
from labkit.checks import core
from tests.stubs import stub


def test_a_stub_is_reported_as_not_written_yet():
    with pytest.raises(checks.CheckFailed, match="not written yet"):
        checks.check_merge_pair(stub)
    with pytest.raises(checks.CheckFailed, match="expected a function"):
        checks.check_merge_pair(None)


@pytest.mark.parametrize(
    "check",
    [checks.check_median_time, checks.check_reduce_scatter_step, checks.check_1f1b_order, checks.check_gptq_column],
)
def test_new_checks_report_a_stub_as_not_written_yet(check):
    with pytest.raises(checks.CheckFailed, match="not written yet"):
        check(stub)


@pytest.mark.parametrize(
    "check", [checks.check_lr_at, checks.check_all_gather_step, checks.check_pack_nibbles, checks.check_lora_merge]
)
def test_second_exercise_checks_report_a_stub_as_not_written_yet(check):
    with pytest.raises(checks.CheckFailed, match="not written yet"):
        check(stub)


@pytest.mark.parametrize(
    "check",
    [
        checks.check_windows,
        checks.check_pack_blocks,
        checks.check_kept_fraction,
        checks.check_bubble_fraction,
        checks.check_overall_sparsity,
    ],
)
def test_more_checks_report_a_stub_as_not_written_yet(check):
    with pytest.raises(checks.CheckFailed, match="not written yet"):
        check(stub)


def test_the_package_re_exports_every_check_of_every_lab():
    labs = [importlib.import_module(f"labkit.checks.lab{n:02d}") for n in range(9)]
    defined = {name: getattr(lab, name) for lab in labs for name in vars(lab) if name.startswith("check_")}
    assert len(defined) == 18  # two exercises in each of labs 00 to 08
    assert sorted(checks.__all__) == sorted([*defined, "CheckFailed"])
    assert all(getattr(checks, name) is fn for name, fn in defined.items())
    assert checks.CheckFailed is core.CheckFailed and issubclass(checks.CheckFailed, AssertionError)
