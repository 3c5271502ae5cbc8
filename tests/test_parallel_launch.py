"""The torchrun launcher and rank placement: a failing or hung rank ends the job with a clear error instead
of hanging, no rank outlives its launch, and each rank gets a GPU of its own or runs on the CPU."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from labkit.parallel import launch

SCRIPT = Path(__file__).parents[1] / "labs" / "scripts" / "dp_parity.py"
HOLD = Path(__file__).parent / "scripts" / "hold_ranks.py"
REPORT = Path(__file__).parent / "scripts" / "report_progress.py"


def test_a_failing_rank_ends_the_job_with_its_own_error():
    start = time.time()
    with pytest.raises(launch.RankError, match=r"rank1 of dp_parity.py failed(.|\n)*ValueError: boom from rank 1"):
        launch.launch(SCRIPT, nproc=2, args=["--fail-rank", "1"], echo=None, timeout=120)
    assert time.time() - start < 120
    survivors = [p for p in psutil.process_iter(["cmdline"]) if "--fail-rank" in " ".join(p.info["cmdline"] or [])]
    assert survivors == []  # the other rank was stopped too


def test_a_hung_rank_is_killed_at_the_timeout():
    start = time.time()
    with pytest.raises(TimeoutError, match="did not finish within 12 s"):
        launch.launch(SCRIPT, nproc=2, args=["--hang-rank", "1"], echo=None, timeout=12)
    assert time.time() - start < 60
    survivors = [p for p in psutil.process_iter(["cmdline"]) if "--hang-rank" in " ".join(p.info["cmdline"] or [])]
    assert survivors == []  # no worker outlives the job


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _still_running_after(pids: list[int], seconds: float) -> list[int]:
    deadline = time.time() + seconds
    while (left := [pid for pid in pids if _running(pid)]) and time.time() < deadline:
        time.sleep(0.2)
    return left


def _start_held_job(ready: Path) -> tuple[subprocess.Popen, int, list[int]]:
    """A launcher process (as a notebook kernel is) running a 2-rank job that never ends: (launcher, agent, ranks)."""
    # SIGINT raises KeyboardInterrupt, as in a notebook kernel, even when this test runs in a background job
    # (which starts with SIGINT ignored, and Python then installs no handler)
    code = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); from labkit.parallel import launch; "
        f"launch.launch({str(HOLD)!r}, 2, [{str(ready)!r}], echo=None, timeout=600)"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.time() + 120
    while len(pids := sorted(ready.glob("rank*.pid"))) < 2:
        assert launcher.poll() is None and time.time() < deadline, "the held job did not start"
        time.sleep(0.2)
    ranks = [int(p.read_text()) for p in pids]
    return launcher, psutil.Process(ranks[0]).ppid(), ranks


@pytest.mark.parametrize("end", ["agent killed", "launcher killed", "launcher interrupted"])
def test_no_rank_outlives_the_end_of_its_launch(tmp_path, end):
    launcher, agent, ranks = _start_held_job(tmp_path)
    assert agent != launcher.pid and all(_running(pid) for pid in (agent, *ranks))
    try:
        if end == "agent killed":  # torchrun's agent dies (OOM killer, scancel of one step)
            os.kill(agent, signal.SIGKILL)
        elif end == "launcher killed":  # the notebook kernel dies or is restarted
            launcher.kill()
        else:  # Kernel > Interrupt, or Ctrl-C
            launcher.send_signal(signal.SIGINT)
        assert _still_running_after([agent, *ranks], 15) == []
    finally:
        for pid in (agent, *ranks):
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.kill()
        launcher.wait()


def test_launcher_checks_its_arguments(tmp_path):
    with pytest.raises(FileNotFoundError):
        launch.launch(tmp_path / "missing.py")
    with pytest.raises(ValueError, match="nproc must be an int >= 1, got 0"):
        launch.launch(SCRIPT, nproc=0)
    with pytest.raises(ValueError, match="nproc must be an int >= 1, got '2'"):
        launch.launch(SCRIPT, nproc="2")
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, got -1"):
        launch.launch(SCRIPT, nproc=1, timeout=-1)
    with pytest.raises(TypeError, match="args must be a list of strings"):
        launch.launch(SCRIPT, nproc=1, args=["--steps", 3])


@pytest.mark.parametrize(
    "gpus, ranks, device",
    [
        (0, 1, "cpu"),
        (0, 2, "cpu"),
        (1, 1, "cuda"),
        (1, 2, "cpu"),
        (2, 2, "cuda"),
        (2, 4, "cpu"),
        (8, 2, "cuda"),
        (8, 8, "cuda"),
    ],
)
def test_ranks_get_a_gpu_each_or_run_on_the_cpu(gpus, ranks, device):
    where = launch.placement(ranks, gpus)
    assert (where.device_type, where.backend) == (device, {"cuda": "nccl", "cpu": "gloo"}[device])
    assert where.reason.startswith(f"{ranks} rank")
    if device == "cpu":
        assert ("no CUDA GPU" if gpus == 0 else f"{gpus} GPU(s) for {ranks} ranks") in where.reason


def test_placement_can_be_forced_and_says_when_it_cannot():
    assert launch.placement(2, 8, prefer="cpu").device_type == "cpu"
    assert launch.placement(2, 2, prefer="cuda").device_type == "cuda"
    with pytest.raises(ValueError, match="needs a GPU per rank: 2 ranks per node, 1 GPU"):
        launch.placement(2, 1, prefer="cuda")
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        launch.placement(2, 1, prefer="gpu")
    with pytest.raises(ValueError, match="ranks_per_node >= 1"):
        launch.placement(0, 1)


def test_two_ranks_on_a_one_gpu_node_use_the_cpu(monkeypatch, capsys):
    """rank_context itself (not just the rule): with one GPU visible, a 2-rank node's rank 0 runs on gloo."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(launch, "visible_gpus", lambda: 1)
    monkeypatch.delenv(launch.DEVICE_ENV, raising=False)
    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(key, value)
    with launch.rank_context() as (rank, world, device):
        assert (rank, world, device.type, dist.get_backend()) == (0, 1, "cpu", "gloo")
    assert not dist.is_initialized()
    assert "2 ranks on the CPU with gloo: 1 GPU(s) for 2 ranks" in capsys.readouterr().out


def test_a_rank_that_dies_without_a_traceback_is_named_by_its_last_words(tmp_path):
    log = [f"step {i}\n" for i in range(60)]
    log[5] = "terminate called after throwing an instance of 'gloo::IoException'\n"
    with pytest.raises(launch.RankError) as err:
        launch._rank_results(tmp_path, "job.py", 1, log)
    assert "gloo::IoException" in str(err.value) and "step 59" in str(err.value) and "step 4\n" not in str(err.value)
    with pytest.raises(launch.RankError) as err:
        launch._rank_results(tmp_path, "job.py", 1, log[6:])
    assert "the crash" not in str(err.value)


def test_progress_lines_move_the_bar_and_stay_out_of_the_log(capsys):
    said = []
    results = launch.launch(REPORT, nproc=2, echo=said.append, timeout=120)
    assert results == [{"rank": 0}, {"rank": 1}]
    assert "rank 0 of 2 works" in said and any(line.startswith("rank 1 of 2 works") for line in said)
    assert not any(launch.PROGRESS_MARK in line for line in said)
    bar = capsys.readouterr().err
    assert "report_progress.py, 2 ranks" in bar and "0/3" in bar and "first unit" in bar and "3/3" in bar


def test_no_bar_without_progress(capsys):
    launch.launch(REPORT, nproc=1, echo=None, timeout=120, progress=False)
    assert capsys.readouterr().err == ""
    with pytest.raises(TypeError, match="progress must be True or False"):
        launch.launch(REPORT, nproc=1, progress="yes")


def test_report_progress_prints_on_rank_0_only_and_checks_its_counts(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    launch.report_progress(2, 5, "memory: fsdp")
    assert capsys.readouterr().out == f"{launch.PROGRESS_MARK} 2/5 memory: fsdp\n"
    monkeypatch.setenv("RANK", "1")
    launch.report_progress(2, 5, "memory: fsdp")
    assert capsys.readouterr().out == ""
    for done, total in ((6, 5), (-1, 5), (0, 0), (1.0, 5)):
        with pytest.raises(ValueError, match="need ints 0 <= done <= total"):
            launch.report_progress(done, total)
    with pytest.raises(ValueError, match="one line"):
        launch.report_progress(1, 2, "two\nlines")
