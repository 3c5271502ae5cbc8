"""The child process a student's code runs in: its functions answer through proxies, in-place changes to tensor
arguments come back, callables stay with the caller, and nothing the code does — loop, crash, exit, reach for the
network, return something that runs code when read, replace a check — reaches the process that called it."""

import os
import socket
import time

import pytest
import torch

from labcourse import sandbox
from labcourse.checks import lab00


@pytest.fixture(scope="module")
def box():
    with sandbox.Sandbox(timeout=20) as child:
        yield child


def test_a_defined_function_answers_with_plain_data(box):
    box.define("def f(x, n):\n    return [x * 2, {'n': n, 'half': n / 2}, torch.ones(2) * n, np.float64(n)]\n")
    assert [v if not isinstance(v, torch.Tensor) else v.tolist() for v in box.function("f")(3, 4)] == [
        6,
        {"n": 4, "half": 2.0},
        [4.0, 4.0],
        4.0,
    ]


def test_a_tensor_changed_in_place_in_the_child_changes_here(box):
    box.define("def bump(t, by):\n    t[1:] += by\n    return None\n")
    mine = torch.zeros(3)
    assert box.function("bump")(mine, 2.0) is None
    assert mine.tolist() == [0.0, 2.0, 2.0]


def test_a_callable_argument_is_called_back_here(box):
    calls = []
    box.define("def twice(work):\n    return work(1) + work(2)\n")
    assert box.function("twice")(lambda k: calls.append(k) or 10 * k) == 30
    assert calls == [1, 2]  # the lambda ran in this process


def test_the_lab_00_check_passes_the_reference_and_fails_a_wrong_answer_through_the_proxy(box):
    box.define(
        "import statistics\n"
        "def median_time(work, sync, clock, warmup, repeats):\n"
        "    for _ in range(warmup):\n        work()\n"
        "    times = []\n"
        "    for _ in range(repeats):\n"
        "        sync(); start = clock(); work(); sync(); times.append(clock() - start)\n"
        "    return statistics.median(times)\n"
    )
    assert "passed (3 cases)" in lab00.check_median_time.__wrapped__(box.function("median_time"))
    box.define("def median_time(work, sync, clock, warmup, repeats):\n    return clock()\n")
    with pytest.raises(lab00.CheckFailed, match="exercise 00.1"):
        lab00.check_median_time.__wrapped__(box.function("median_time"))


def test_what_the_student_raises_is_relayed_by_kind(box):
    box.define("def stub():\n    raise NotImplementedError('write me')\ndef bad():\n    return 1 / 0\n")
    with pytest.raises(NotImplementedError, match="write me"):
        box.function("stub")()
    with pytest.raises(sandbox.StudentError, match="ZeroDivisionError"):
        box.function("bad")()
    with pytest.raises(sandbox.StudentError, match="SyntaxError"):
        box.define("def broken(:\n")
    with pytest.raises(sandbox.StudentError, match="NameError: the cell defines no function 'nowhere'"):
        box.function("nowhere")()


def test_a_loop_is_stopped_at_the_time_limit_and_the_sandbox_refuses_more():
    child = sandbox.Sandbox(timeout=2)
    child.define("def spin():\n    while True:\n        pass\n")
    with pytest.raises(sandbox.TimedOut, match="no answer within 2 s"):
        child.function("spin")()
    assert not child.alive
    with pytest.raises(sandbox.SandboxError, match="start a new Sandbox"):
        child.function("spin")()


@pytest.mark.parametrize("body", ["import os; os._exit(3)", "raise SystemExit(0)"])
def test_a_child_that_exits_is_reported_and_never_answers_for_the_student(body):
    child = sandbox.Sandbox(timeout=20)
    child.define(f"def leave():\n    {body}\n")
    if "SystemExit" in body:  # caught in the child: the student's code raised it
        with pytest.raises(sandbox.StudentError, match="SystemExit"):
            child.function("leave")()
        child.close()
        return
    with pytest.raises(sandbox.Crashed, match="exit status 3"):
        child.function("leave")()
    assert not child.alive


def test_a_result_that_would_run_code_when_read_is_refused():
    with sandbox.Sandbox(timeout=20) as child:
        child.define(
            "class Gadget:\n    def __reduce__(self):\n        return (print, ('ran',))\n"
            "def f():\n    return Gadget()\n"
        )
        with pytest.raises(sandbox.SandboxError, match="not plain data"):
            child.function("f")()


def test_the_child_has_no_network(box):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        box.define(
            "import socket\n"
            "def reach(port):\n"
            "    with socket.socket() as s:\n"
            "        s.settimeout(2)\n"
            "        s.connect(('127.0.0.1', port))\n"
            "    return 'connected'\n"
        )
        with pytest.raises(sandbox.StudentError, match="PermissionError|OSError|ConnectionRefused"):
            box.function("reach")(port)


def test_replacing_a_check_in_the_child_leaves_this_process_s_check_alone(box):
    original = lab00.check_median_time
    box.define(
        "import labcourse.checks as c\n"
        "c.check_median_time = lambda fn: fn\n"
        "def done():\n    import labcourse.checks as c\n    return c.check_median_time.__name__\n"
    )
    assert box.function("done")() == "<lambda>"  # replaced there
    assert lab00.check_median_time is original and original.__name__ == "check_median_time"  # not here


def test_bad_arguments_are_refused_before_a_child_starts():
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        sandbox.Sandbox(timeout=0)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        sandbox.Sandbox(timeout=True)


def test_an_answer_past_the_size_limit_is_refused_without_reading_it():
    with sandbox.Sandbox(timeout=20) as child:
        child.define(f"def big():\n    return torch.zeros({sandbox.MAX_MESSAGE // 4 + 1024})\n")
        with pytest.raises(sandbox.SandboxError, match="more than the 67,108,864 allowed"):
            child.function("big")()
        assert not child.alive


def test_a_lab_s_imports_are_there_for_every_cell_and_a_failing_one_is_skipped(box):
    box.prelude(["import statistics", "from labkit import bench", "import no_such_module_here"])
    box.define("def f(xs):\n    return statistics.median(xs), bench.fmt_seconds(1.5)\n")
    assert box.function("f")([3, 1, 2]) == (2, "1.50 s")


def test_a_callback_and_an_in_place_change_in_one_call(box):
    box.define("def g(t, tick):\n    tick()\n    t.mul_(3)\n    return t.sum().item()\n")
    mine, ticks = torch.ones(4), []
    assert box.function("g")(mine, lambda: ticks.append(1)) == 12.0
    assert mine.tolist() == [3.0] * 4 and ticks == [1]


def test_what_a_callback_of_ours_raises_comes_back_as_itself_even_if_the_student_swallows_it(box):
    box.define("def h(probe):\n    try:\n        probe()\n    except Exception:\n        return 'fine'\n")

    def probe():
        raise lab00.CheckFailed("the work was called too often")

    with pytest.raises(lab00.CheckFailed, match="called too often"):
        box.function("h")(probe)


def test_iterables_come_back_as_lists_and_tuple_kinds_as_tuples(box):
    box.define(
        "import collections\nPoint = collections.namedtuple('Point', 'x y')\n"
        "def it():\n    return (i * i for i in range(3)), map(str, [1, 2]), range(2), Point(1, 2)\n"
    )
    assert box.function("it")() == ([0, 1, 4], ["1", "2"], [0, 1], (1, 2))


@pytest.mark.parametrize(
    "body",
    [
        "return torch.zeros(1).expand(10**9)",  # a few bytes on the pipe, 4 GB to use
        "x = []\n    for _ in range(200):\n        x = [x]\n    return x",  # deeper than any answer
        "return [[0] * 1000] * 2000",  # 2 M values a check would walk
    ],
)
def test_an_answer_small_on_the_pipe_but_huge_to_use_is_refused(body):
    with sandbox.Sandbox(timeout=20) as child:
        child.define(f"def f():\n    {body}\n")
        with pytest.raises(sandbox.SandboxError, match="not plain data of a sane size"):
            child.function("f")()


def test_a_child_that_reads_nothing_cannot_block_the_caller_s_write():
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        with pytest.raises(TimeoutError):
            sandbox._write_frame(write, b"x" * 2**20, time.monotonic() + 0.5)  # a 1 MiB call into a 64 KiB pipe
    finally:
        os.close(read)
        os.close(write)


def test_an_exercise_budget_bounds_all_its_calls_together():
    with sandbox.Sandbox(timeout=20) as child:
        child.define("import time\ndef nap():\n    time.sleep(0.4)\n")
        child.limit(1.0)
        nap = child.function("nap")
        with pytest.raises(sandbox.TimedOut):
            for _ in range(10):  # each call is well within the per-call limit; together they are not
                nap()
