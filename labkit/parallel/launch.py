"""Where the ranks run and how a notebook starts them: one rank per GPU on NCCL, else CPU ranks on gloo;
`rank_context` inside each torchrun worker; `launch`, a torchrun launcher a notebook can call, which streams
the log, shows how far the job is (`report_progress` from the ranks), reports a failing rank's own traceback,
and leaves no rank running after it returns.

The same code runs on a laptop (gloo, CPU processes), a GPU node (NCCL) or many nodes under Slurm.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from labkit.torchutil import is_int

RESULT_ENV = "LABKIT_RESULT_DIR"
DEVICE_ENV = "LABKIT_DIST_DEVICE"  # 'cpu' or 'cuda': where the ranks run, instead of the automatic choice
LAUNCHER_ENV = "LABKIT_LAUNCHER"  # 'pid:start_time' of the process that called launch(); ranks die with it
PROGRESS_MARK = "labkit-progress"  # a log line 'labkit-progress DONE/TOTAL what' moves the launcher's bar


class RankError(RuntimeError):
    """A rank of a launched job failed; the message carries that rank's own traceback."""


# ----------------------------------------------------------------------------- where the ranks run


@dataclass(frozen=True)
class Placement:
    """Where the ranks of one node run, and the one line that says why."""

    device_type: str  # 'cuda': rank i on GPU i of the node; 'cpu': CPU processes
    backend: str  # 'nccl' | 'gloo'
    reason: str


def placement(ranks_per_node: int, gpus: int, prefer: str | None = None) -> Placement:
    """One rank per GPU on NCCL when the node has a GPU for every rank, else CPU ranks on gloo.

    Two ranks on a one-GPU node would share it (NCCL refuses two ranks on one device), so they run on
    the CPU instead. `prefer` ('cpu' or 'cuda', e.g. from $LABKIT_DIST_DEVICE) overrides the choice.
    """
    if ranks_per_node < 1 or gpus < 0:
        raise ValueError(f"need ranks_per_node >= 1 and gpus >= 0, got {ranks_per_node}, {gpus}")
    if prefer not in (None, "", "cpu", "cuda"):
        raise ValueError(f"prefer (or ${DEVICE_ENV}) must be 'cpu' or 'cuda', got {prefer!r}")
    ranks = f"{ranks_per_node} rank{'s' * (ranks_per_node != 1)}"
    if prefer == "cpu":
        return Placement("cpu", "gloo", f"{ranks} on the CPU with gloo (${DEVICE_ENV}=cpu)")
    if gpus >= ranks_per_node:
        return Placement("cuda", "nccl", f"{ranks} on {ranks_per_node} of this node's {gpus} GPUs, one each, NCCL")
    if prefer == "cuda":
        raise ValueError(f"${DEVICE_ENV}=cuda needs a GPU per rank: {ranks} per node, {gpus} GPU(s) visible")
    why = "no CUDA GPU is visible" if gpus == 0 else f"{gpus} GPU(s) for {ranks}, and NCCL needs a GPU per rank"
    return Placement("cpu", "gloo", f"{ranks} on the CPU with gloo: {why}")


def visible_gpus() -> int:
    """CUDA devices this process may use (after CUDA_VISIBLE_DEVICES)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# ----------------------------------------------------------------------------- inside a rank


@contextlib.contextmanager
def rank_context() -> Iterator[tuple[int, int, torch.device]]:
    """Inside a torchrun worker: init the process group, yield (rank, world_size, device), clean up.

    The device follows `placement` (rank 0 prints why, unless the launcher already did). An exception
    is written to the launcher's result directory before it propagates, so that `launch` can report
    the rank's own error instead of torchrun's summary. The rank exits if its torchrun agent or the
    launching process dies, so that no rank is left running on its own.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    where = placement(int(os.environ.get("LOCAL_WORLD_SIZE", world)), visible_gpus(), os.environ.get(DEVICE_ENV))
    if rank == 0 and not os.environ.get(DEVICE_ENV):
        print(f"labkit: {where.reason}", flush=True)
    watching = _exit_with_parents()
    device = torch.device("cuda", local) if where.device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(where.backend)
    try:
        yield rank, world, device
    except BaseException:
        out = os.environ.get(RESULT_ENV)
        if out:
            Path(out, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        watching.set()
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_with_parents(interval: float = 0.5) -> threading.Event:
    """Watch, from a daemon thread, the torchrun agent (our parent) and the launching process; exit when
    either is gone. torchrun puts each worker in a session of its own, so a killed agent (or a killed
    notebook kernel) would otherwise leave the ranks running, blocked in a collective forever.
    Setting the returned event stops the watch."""
    parent = os.getppid()
    launcher = os.environ.get(LAUNCHER_ENV, "")

    def alive(pid: int, started: float) -> bool:
        try:
            proc = psutil.Process(pid)
            return proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    pid, _, started = launcher.partition(":")
    watched = [(int(pid), float(started))] if launcher else []

    stop = threading.Event()

    def watch() -> None:
        while os.getppid() == parent and all(alive(p, t) for p, t in watched):
            if stop.wait(interval):
                return
        with contextlib.suppress(OSError):  # the log's reader may be what died
            print(f"labkit: rank {os.environ.get('RANK')} exits: its launcher or torchrun agent is gone", flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="labkit-orphan-watch", daemon=True).start()
    return stop


def report_progress(done: int, total: int, what: str = "") -> None:
    """From rank 0: `done` of `total` units of work finished (`what`: the one now running), one log line that
    `launch` turns into its progress bar; run by hand, the line reads as it is."""
    if not (is_int(done) and is_int(total) and 0 <= done <= total and total >= 1):
        raise ValueError(f"need ints 0 <= done <= total, total >= 1; got done={done!r}, total={total!r}")
    if "\n" in what:
        raise ValueError(f"what must be one line, got {what!r}")
    if int(os.environ.get("RANK", 0)) == 0:  # one write: the ranks share the launcher's pipe
        sys.stdout.write(f"{PROGRESS_MARK} {done}/{total} {what}".rstrip() + "\n")
        sys.stdout.flush()


def save_result(result: dict[str, Any]) -> None:
    """Write this rank's result (JSON) for the launcher to collect."""
    out = os.environ.get(RESULT_ENV)
    if out:
        rank = int(os.environ.get("RANK", 0))
        tmp = Path(out, f".result_rank{rank}.json")
        tmp.write_text(json.dumps(result))
        tmp.rename(Path(out, f"result_rank{rank}.json"))


# ----------------------------------------------------------------------------- the launcher


def launch(
    script: str | Path,
    nproc: int = 2,
    args: list[str] | None = None,
    *,
    timeout: float = 300,
    echo: Callable[[str], None] | None = print,
    env: dict[str, str] | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run `script` under torchrun with `nproc` local processes; return each rank's saved result.

    The ranks run where `placement` puts them (one line says where and why). The log is streamed line
    by line to `echo`. With `progress`, a bar shows the time so far, and how far the job is once rank 0
    reports it (`report_progress`, whose lines go to the bar, not to echo). If any rank fails, the whole
    job is stopped and a RankError carries the first failing rank's traceback; past `timeout` seconds, or on
    an interrupt, the job is killed, so a hung rank never hangs the caller and no rank outlives the call.
    """
    if not is_int(nproc) or nproc < 1:
        raise ValueError(f"nproc must be an int >= 1, got {nproc!r}")
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False, got {progress!r}")
    if args is not None and not all(isinstance(a, str) for a in args):
        raise TypeError(f"args must be a list of strings (command-line arguments), got {args!r}")
    script = Path(script)
    if not script.is_file():
        raise FileNotFoundError(f"no such script: {script}")
    env = {**os.environ, **(env or {})}
    where = placement(nproc, visible_gpus(), env.get(DEVICE_ENV))
    (echo or print)(f"labkit: {where.reason}")
    me = _process_id()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *(args or []),
    ]
    with tempfile.TemporaryDirectory(prefix="labkit-launch-") as out:
        job_env = {
            **env,
            RESULT_ENV: out,
            DEVICE_ENV: where.device_type,
            LAUNCHER_ENV: me,
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        }
        bar = tqdm(desc=f"{script.name}, {nproc} rank{'s' * (nproc != 1)}", leave=False, disable=not progress)
        bar.bar_format = "{desc}: {elapsed}"  # until rank 0 says how much there is to do
        try:
            code, lines = _run_job(cmd, job_env, timeout, echo, script.name, bar)
        finally:
            bar.close()
        return _rank_results(Path(out), script.name, code, lines)


# anywhere in a line: another rank's unbuffered print can leave its text, then its newline, around ours
PROGRESS_LINE = re.compile(rf"{PROGRESS_MARK} (\d+)/(\d+) ?(.*)$")


def _run_job(
    cmd: list[str], env: dict[str, str], timeout: float, echo: Callable[[str], None] | None, name: str, bar: tqdm
) -> tuple[int, list[str]]:
    """Run cmd in a session of its own, streaming its log to echo and its progress lines to bar (ticking each
    second); its exit code and log lines. Past timeout, or on an interrupt, the whole process tree is killed."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
    )
    lines: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            if mark := PROGRESS_LINE.search(line.rstrip("\n")):
                if before := line[: mark.start()]:  # another rank's words, cut by ours: still the log's
                    lines.append(before + "\n")
                    if echo:
                        echo(before)
                done, total, what = int(mark[1]), int(mark[2]), mark[3]
                if bar.total != total:
                    bar.total, bar.bar_format = total, None
                bar.set_postfix_str(what, refresh=False)
                bar.update(done - bar.n)
                bar.refresh()  # update() skips a redraw within 0.1 s of the last; these lines are rare
                continue
            lines.append(line)
            if echo:
                echo(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    try:
        while (code := _wait(proc, min(1.0, deadline - time.monotonic()))) is None:
            if time.monotonic() >= deadline:
                _kill_tree(proc)
                raise TimeoutError(
                    f"{name} did not finish within {timeout:.0f} s and was killed; last output:\n"
                    + "".join(lines[-20:])
                )
            bar.refresh()
    except BaseException:  # an interrupted notebook cell, Ctrl-C: stop the job before giving up
        _kill_tree(proc)
        raise
    finally:
        reader.join(timeout=5)
    return code, lines


def _wait(proc: subprocess.Popen, seconds: float) -> int | None:
    """proc's exit code, or None if it is still running after `seconds`."""
    try:
        return proc.wait(timeout=max(0.0, seconds))
    except subprocess.TimeoutExpired:
        return None


CRASH = re.compile(r"terminate called|what\(\):|Fatal Python error|Segmentation fault|Aborted")


def _rank_results(out: Path, name: str, code: int, lines: list[str]) -> list[dict[str, Any]]:
    """Each rank's saved result, in rank order; a RankError with the first failing rank's traceback, or with the
    end of the log when the job failed before a rank could write one."""
    errors = sorted(out.glob("error_rank*.txt"))
    if errors:
        raise RankError(f"{errors[0].stem.replace('error_', '')} of {name} failed:\n{errors[0].read_text()}")
    if code != 0:  # a rank that died in C++ (an abort in gloo, say) wrote no traceback: its last words are earlier
        crash = [line for line in lines[:-30] if CRASH.search(line)][:10]
        said = "the crash, earlier in the log:\n" + "".join(crash) + "...\n" if crash else ""
        raise RankError(f"{name} exited with {code}; {said}last output:\n" + "".join(lines[-30:]))
    return [
        json.loads(p.read_text())
        for p in sorted(out.glob("result_rank*.json"), key=lambda p: int(p.stem.removeprefix("result_rank")))
    ]


def _process_id(pid: int | None = None) -> str:
    """'pid:start_time' of a process (default: this one): unlike a bare pid, never names a later process."""
    proc = psutil.Process(pid)
    return f"{proc.pid}:{proc.create_time()!r}"


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill torchrun and every worker: workers run in sessions of their own, so a process group is not enough."""
    try:
        family = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(family, timeout=10)
    proc.wait()
