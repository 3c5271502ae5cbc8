"""One writer per checkpoint directory: a second run is refused, naming the first, before it changes anything; the
first finishes unharmed; a run killed with SIGKILL leaves a lock file that does not block the next run."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from labkit import fileio
from labkit.bench import read_results
from labkit.checkpoint import LOCK_FILE, CheckpointDirBusy, checkpoints
from labkit.models import tiny_llama
from labkit.train import TrainConfig, fit

# A run of fit whose third batch waits for a gate file: by then step 1 is logged and saved, so the test can act while
# the run is alive and holds the directory. Before waiting it forks a child that lives on, as a DataLoader worker
# would, and writes the child's pid into WAITING.
HOLDER = """
import os, sys, time
from pathlib import Path
import torch
from labkit.models import tiny_llama
from labkit.train import TrainConfig, fit

ck, log, gate, waiting = sys.argv[1:5]


class Gated:
    def __iter__(self):
        for i, batch in enumerate(BATCHES):
            if i == 2:
                child = os.fork()
                if child == 0:
                    time.sleep(120)
                    os._exit(0)
                Path(waiting).write_text(str(child))
                while not Path(gate).exists():
                    time.sleep(0.02)
            yield batch


BATCHES = [(x, x) for x in torch.randint(0, 64, (6, 2, 8), generator=torch.Generator().manual_seed(0))]
cfg = TrainConfig(steps=6, schedule="constant", checkpoint_dir=ck, checkpoint_every=1, keep_checkpoints=6,
                  log_path=log, progress=False)
fit(tiny_llama(vocab_size=64, num_layers=1), Gated(), cfg)
"""


def _config(ck: Path, **changes) -> TrainConfig:
    base = {"steps": 6, "schedule": "constant", "checkpoint_every": 1, "keep_checkpoints": 6, "progress": False}
    return TrainConfig(checkpoint_dir=str(ck), **{**base, **changes})


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x, x) for x in torch.randint(0, 64, (6, 2, 8), generator=torch.Generator().manual_seed(0))]


def _start_holder(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """Start HOLDER; return it and its forked child's pid once it waits at the gate."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    args = [tmp_path / n for n in ("ck", "log.jsonl", "gate", "waiting")]
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, *map(str, args)], env=env)
    deadline = time.monotonic() + 120
    while not (tmp_path / "waiting").exists() or not (tmp_path / "waiting").read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the holder ended (exit {proc.wait()}) or timed out before the gate")
        time.sleep(0.02)
    return proc, int((tmp_path / "waiting").read_text())


def _stop(proc: subprocess.Popen, child: int) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    try:
        os.kill(child, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.slow
def test_a_second_run_is_refused_naming_the_first_which_finishes_unharmed(tmp_path):
    ck = tmp_path / "ck"
    proc, child = _start_holder(tmp_path)
    try:
        (ck / ".step_000009.x1.tmp").mkdir()  # looks like a killed save's leftover: the refused run must not touch it
        files = {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()}
        model = tiny_llama(vocab_size=64, num_layers=1)
        before = [p.detach().clone() for p in model.parameters()]
        holder = rf"pid {proc.pid} on host .+ since \d{{4}}-.+ \(-c .+\); lock file {ck / LOCK_FILE}"
        with pytest.raises(CheckpointDirBusy, match=rf"in use by another training run: {holder}"):
            fit(model, _batches(), _config(ck, lr=5e-3))  # another lr too: refused before any resume
        assert {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()} == files
        assert (ck / ".step_000009.x1.tmp").is_dir()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        (tmp_path / "gate").touch()
        assert proc.wait(timeout=120) == 0
    finally:
        _stop(proc, child)
    assert [r["step"] for r in read_results(tmp_path / "log.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in checkpoints(ck)] == [1, 2, 3, 4, 5, 6]
    assert all(fileio.check_manifest(p) is None for _, p in checkpoints(ck))
    assert not (ck / LOCK_FILE).exists()  # the run removes its lock file as it ends


@pytest.mark.slow
def test_a_run_killed_with_sigkill_leaves_a_lock_file_that_does_not_block(tmp_path):
    ck = tmp_path / "ck"
    proc, child = _start_holder(tmp_path)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert f'"pid": {proc.pid},' in (ck / LOCK_FILE).read_text()  # left behind, naming the dead run
        os.kill(child, 0)  # its forked child still runs: it must not hold the lock
        history = fit(tiny_llama(vocab_size=64, num_layers=1), _batches(), _config(ck))
    finally:
        _stop(proc, child)
    assert [r["step"] for r in history] == [2, 3, 4, 5, 6]  # resumed from the killed run's step 1
    assert not (ck / LOCK_FILE).exists()
