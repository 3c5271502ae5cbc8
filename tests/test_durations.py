"""The duration report: per-file totals and per-test lines, slowest first, summed over setup/call/teardown."""

from tests.durations import ci_figures, format_report, longest_first, read_file_seconds


def test_report_totals_files_and_sorts_tests_slowest_first():
    seconds = {"tests/a.py::t1": 1.0, "tests/a.py::t2": 4.0, "labs/01.ipynb::Cell 3": 2.5}
    text = format_report(seconds, wall=9.4, workers=2, exit_status=0)
    assert text.startswith("# 3 tests in 9 s wall on 2 worker(s), exit status 0\n")
    files = text.split("## per file\n")[1].split("\n\n")[0].splitlines()
    assert files == ["     5.0  tests/a.py", "     2.5  labs/01.ipynb"]
    assert "\n# commit " in text and ".ci/run" not in text
    assert "; .ci/run started 725 s before this report was written\n" in format_report(seconds, 9.4, 2, 0, 725.2)
    tests = text.split("## per test\n")[1].splitlines()
    assert tests == ["    4.00  tests/a.py::t2", "    2.50  labs/01.ipynb::Cell 3", "    1.00  tests/a.py::t1"]


def test_the_next_run_collects_long_files_first_and_unknown_ones_before_them():
    text = format_report({"tests/a.py::t1": 1.0, "labs/01.ipynb::Cell 1": 2.5}, wall=3, workers=2, exit_status=0)
    assert read_file_seconds(text) == {"labs/01.ipynb": 2.5, "tests/a.py": 1.0}
    nodeids = [
        "tests/a.py::t1",
        "labs/01.ipynb::Cell 0",
        "labs/01.ipynb::Cell 1",
        "tests/a.py::t2",
        "labs/new.ipynb::Cell 0",
    ]
    order = longest_first(nodeids, read_file_seconds(text))
    assert [nodeids[i] for i in order] == [
        "labs/new.ipynb::Cell 0",
        "labs/01.ipynb::Cell 0",
        "labs/01.ipynb::Cell 1",
        "tests/a.py::t1",
        "tests/a.py::t2",
    ]


def test_a_whole_ci_run_is_saved_as_its_time_outcome_and_files():
    seconds = {"tests/a.py::t1": 1.0, "tests/a.py::t2": 4.04, "build/test-labs/06.ipynb::Cell 3": 300.0}
    figures = ci_figures(seconds, wall=1001.44, workers=2, exit_status=0, since_ci=1194.26)
    assert figures["ci_seconds"] == 1194.3 and figures["suite_seconds"] == 1001.4 and figures["tests"] == 3
    assert figures["exit_status"] == 0 and figures["workers"] == 2 and figures["commit"]
    assert figures["files"] == {"build/test-labs/06.ipynb": 300.0, "tests/a.py": 5.0}
    assert list(figures["files"]) == ["build/test-labs/06.ipynb", "tests/a.py"]  # slowest first
