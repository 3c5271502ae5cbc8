"""Training checkpoints that resume the exact trajectory: weights, optimizer, loss scaler, data position, RNG.

A checkpoint is a directory step_N/ (zero-padded to six digits for the eye; ordered by the number,
of any width) written atomically — built under a temporary name, renamed when whole — with a
manifest of checksums. Resume takes the newest one that verifies and says which it skipped and why;
loading checks the manifest and the model's shapes before a single tensor is copied. One run at a time
writes a directory: `writer_lock` refuses a second one, naming the first.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file, save_model
from torch import nn

from labkit import fileio
from labkit.torchutil import rank_and_world
from labkit.train_config import TrainConfig


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors |= {f"torch_cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(keys.astype(np.int64))
    return tensors, {"numpy": [kind, pos, has_gauss, gauss], "python": random.getstate()}


def _set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [tensors[f"torch_cuda_{i}"] for i in range(torch.cuda.device_count()) if f"torch_cuda_{i}" in tensors]
        )
    kind, pos, has_gauss, gauss = meta["numpy"]
    np.random.set_state((kind, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, gauss))
    py = meta["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))


def save_checkpoint(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    step: int,
    data_state: dict[str, int],
    cfg: TrainConfig,
) -> Path:
    """Write step_NNNNNN/ atomically: weights and optimizer tensors as safetensors, the rest as JSON."""
    dest = Path(directory) / f"step_{step:06d}"
    remove_unfinished(directory)
    opt = optimizer.state_dict()
    opt_tensors = {
        f"{pid}.{key}": value
        for pid, state in opt["state"].items()
        for key, value in state.items()
        if torch.is_tensor(value)
    }
    rng_tensors, rng_meta = _rng_state()
    with fileio.atomic_directory(dest) as tmp:
        save_model(model, str(tmp / "model.safetensors"))  # handles tied weights
        save_file({k: v.contiguous() for k, v in opt_tensors.items()}, str(tmp / "optimizer.safetensors"))
        save_file(rng_tensors, str(tmp / "rng.safetensors"))
        state = {
            "step": step,
            "data": data_state,
            "config": asdict(cfg),
            "param_groups": opt["param_groups"],
            "scaler": scaler.state_dict(),
            "rng": rng_meta,
        }
        fileio.atomic_write_text(tmp / "trainer.json", json.dumps(state, indent=1))
        fileio.write_manifest(tmp, source="labkit.train")
    # Rotation counts back from this step: a newer directory can only be one that resume skipped (corrupt,
    # stray), and counting it would delete the checkpoint just written.
    for _, old in [c for c in checkpoints(directory) if c[0] <= step][: -cfg.keep_checkpoints]:
        shutil.rmtree(old)
    return dest


_STEP_DIR = re.compile(r"step_(\d+)")


def checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every step_N directory in `directory`, oldest first by number: step_1000000 after
    step_999999, which sorting the names as text gets wrong. Unfinished writes (.step_*.tmp) are not listed."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(m, p) for p in directory.iterdir() if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return sorted((int(m.group(1)), p) for m, p in found)


def remove_unfinished(directory: str | Path) -> list[Path]:
    """Delete the temporary directories that writes killed mid-way left behind; return what was removed."""
    directory = Path(directory)
    leftovers = sorted(p for p in directory.glob(".step_*.tmp") if p.is_dir()) if directory.is_dir() else []
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return leftovers


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest checkpoint in `directory` that verifies (manifest and checksums), warning about each newer
    one skipped and why; None if there is none; ValueError if there are some and none verifies."""
    skipped = []
    for _, path in reversed(checkpoints(directory)):
        problem = fileio.check_manifest(path)
        if problem is None:
            for bad, why in skipped:
                warnings.warn(f"skipping checkpoint {bad.name}: {why}; resuming from {path.name}", stacklevel=2)
            return path
        skipped.append((path, problem))
    if skipped:
        detail = "; ".join(f"{p.name}: {why}" for p, why in skipped)
        raise ValueError(
            f"no checkpoint in {directory} verifies ({detail}): remove them to start afresh, "
            "or give another checkpoint_dir"
        )
    return None


def saved_config(path: str | Path) -> dict[str, Any]:
    """The configuration (asdict(TrainConfig), through JSON) of the run that saved checkpoint `path`: what a resume
    compares with its own before loading anything."""
    return json.loads((Path(path) / "trainer.json").read_text())["config"]


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> dict[str, Any]:
    """Restore model (and optimizer, scaler, RNG) from a checkpoint after checking it is whole and fits."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist")
    problem = fileio.check_manifest(path) if path.is_dir() else "it is a file, not a checkpoint directory"
    if problem:
        raise ValueError(f"checkpoint {path} is unusable: {problem}")
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    mismatched = [
        f"{k}: model {expected[k]}, checkpoint {saved[k]}" for k in saved if k in expected and expected[k] != saved[k]
    ]
    unknown = sorted(set(saved) - set(expected))
    if mismatched or unknown:
        detail = "; ".join(mismatched[:3] + [f"unexpected tensor {k}" for k in unknown[:3]])
        raise ValueError(f"checkpoint {path} was saved from another model shape: {detail}")
    state = json.loads((path / "trainer.json").read_text())
    if optimizer is not None:  # checked before the weights are copied: a refusal leaves the model as it was
        sizes = {"checkpoint": [len(g["params"]) for g in state["param_groups"]]}
        sizes["optimizer"] = [len(g["params"]) for g in optimizer.param_groups]
        if sizes["checkpoint"] != sizes["optimizer"]:
            raise ValueError(
                f"checkpoint {path} was saved by an optimizer with other parameter groups (sizes "
                f"{sizes['checkpoint']}, this one's {sizes['optimizer']}): were other parameters trainable then?"
            )
    weights = load_file(str(path / "model.safetensors"), device=str(next(model.parameters()).device))
    model.load_state_dict(weights, strict=False)  # tied weights are stored once
    current = model.state_dict()
    loaded_storage = {current[k].data_ptr() for k in weights if k in current}
    absent = [k for k in set(expected) - set(weights) if current[k].data_ptr() not in loaded_storage]  # not tied
    if absent:
        raise ValueError(f"checkpoint {path} lacks tensors: {sorted(absent)[:3]}")
    if optimizer is not None:
        tensors = load_file(str(path / "optimizer.safetensors"))
        opt_state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            pid, name = key.split(".", 1)
            opt_state.setdefault(int(pid), {})[name] = value
        optimizer.load_state_dict({"state": opt_state, "param_groups": state["param_groups"]})
    if scaler is not None:
        scaler.load_state_dict(state["scaler"])
    _set_rng_state(load_file(str(path / "rng.safetensors")), state["rng"])
    return state


# ----------------------------------------------------------------------------- one writer at a time

LOCK_FILE = ".labkit-writer.lock"  # in the checkpoint directory: neither a step_N name nor a .step_*.tmp leftover
_held_locks: set[int] = set()  # descriptors of the writer locks this process holds


def _drop_held_locks() -> None:
    """In a forked child (a DataLoader worker, say): close the inherited lock descriptors, so that the lock ends
    with the run that took it, not with its last child."""
    for fd in _held_locks:
        with contextlib.suppress(OSError):
            os.close(fd)
    _held_locks.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_held_locks)


class CheckpointDirBusy(RuntimeError):
    """Another live run writes to the checkpoint directory: two writers would delete each other's saves."""


def _holder(text: str) -> str:
    """Who holds a lock, from what it wrote into the lock file."""
    try:
        who = json.loads(text)
        return f"pid {who['pid']} on host {who['host']} since {who['since']} ({who['command']})"
    except (ValueError, KeyError, TypeError):
        return "a run that has not yet written who it is"


@contextlib.contextmanager
def writer_lock(directory: str | Path) -> Iterator[Path]:
    """Hold `directory` for this process's writes alone, or raise CheckpointDirBusy naming the run that holds it:
    runs that save, rotate and clean up one directory together delete each other's checkpoints.

    A non-blocking flock on LOCK_FILE, into which the holder writes its pid, host, start time and command. The
    kernel drops the lock when the holder dies, SIGKILL included, so a lock file left behind never blocks the next
    run. Without fcntl (Windows) nothing is locked, as in fileio.file_lock.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    try:
        import fcntl
    except ImportError:
        yield path
        return
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
            os.close(fd)
            raise CheckpointDirBusy(
                f"checkpoint_dir {directory} is in use by another training run: {holder}; lock file {path}. "
                "Wait for that run to end or stop it, or give this run another checkpoint_dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        os.close(fd)  # the previous holder removed the file between our open and our lock: lock the current one
    _held_locks.add(fd)
    try:
        since = datetime.now().astimezone().isoformat(timespec="seconds")
        command = " ".join(sys.argv)[:300]
        who = {"pid": os.getpid(), "host": socket.gethostname(), "since": since, "command": command}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(who).encode(), 0)
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # still locked: a run that opened the file meanwhile finds it gone and opens a new one
        _held_locks.discard(fd)
        os.close(fd)


# ----------------------------------------------------------------------------- resuming a run

# Settings a resume may change: where the outputs go and how progress shows, and how the same arithmetic is
# carried out (activation checkpointing recomputes identical gradients; compile changes rounding only). Every other
# setting defines the trajectory, the seed included: it names the run. So does `steps` under a decaying schedule:
# lr_at divides by steps, so a cosine run of 4 steps continued to 6 follows neither the saved run's learning rates
# nor a 6-step run's (the rate jumps back up at the resume). Under "constant" it only says where to stop, and
# extending a run is a resume like any other.
RESUME_MAY_CHANGE = frozenset(
    {"checkpoint_dir", "checkpoint_every", "keep_checkpoints", "resume", "log_path", "tensorboard_dir", "progress"}
    | {"extra", "activation_checkpointing", "compile"}
)


def config_changes(saved: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """What differs, as "name saved (saved) vs now (now)", between a checkpoint's saved config and `cfg` among the
    settings that define the trajectory: what resuming under `cfg` would silently change."""
    now = json.loads(json.dumps(asdict(cfg)))  # as the checkpoint holds it: the betas tuple becomes a list
    free = RESUME_MAY_CHANGE | ({"steps"} if cfg.schedule == "constant" else set())
    changed = [name for name in now if name not in free and name in saved and saved[name] != now[name]]
    return [f"{name} {saved[name]!r} (saved) vs {now[name]!r} (now)" for name in changed]


_END = object()


class DataStream:
    """Endless micro-batches from a loader, epoch after epoch, with a position a checkpoint can restore.

    Exact resumption needs a seeded sampler (labkit.shards.make_loader's) and a dataset that draws
    no random numbers. Starting an iterator can draw from the global RNG (DataLoader seeds its
    workers; a generator wrapping a loader starts it on its first item), so starting, skipping
    and the first fetch happen with the RNG forked: dropout draws the same masks after a resume.
    """

    def __init__(self, loader: Iterable, epoch: int = 0, index: int = 0):
        self.loader, self.epoch, self.index = loader, epoch, index
        self._it, self._next = None, _END

    def _start(self) -> None:
        sampler = getattr(self.loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        with torch.random.fork_rng(devices=[]):
            self._it = iter(self.loader)
            for _ in range(self.index):  # skip what was consumed before the checkpoint
                next(self._it)
            self._next = next(self._it, _END)

    def __next__(self) -> Any:
        if self._it is None:
            self._start()
        if self._next is _END:  # the epoch is over: reshuffle and go on
            self.epoch, self.index = self.epoch + 1, 0
            self._start()
            if self._next is _END:
                raise ValueError("the loader yields no batches")
        item, self._next = self._next, next(self._it, _END)
        self.index += 1
        return item

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}


@contextlib.contextmanager
def hold_checkpoint_dir(cfg: TrainConfig, device: torch.device) -> Iterator[None]:
    """Rank 0, the one that writes, holds cfg.checkpoint_dir's writer lock for the run. Under torchrun every rank
    learns whether it got it, so that a refusal stops them all instead of leaving the others waiting for rank 0 in
    DDP's first collective."""
    if not cfg.checkpoint_dir:
        yield
        return
    rank, world = rank_and_world()
    with contextlib.ExitStack() as held:
        failure = None
        if rank == 0:
            try:
                held.enter_context(writer_lock(cfg.checkpoint_dir))
            except Exception as err:  # any failure: the other ranks must hear of it too
                failure = err
        if world > 1:
            failed = torch.tensor([failure is not None], dtype=torch.int32, device=device)
            dist.broadcast(failed, src=0)
            if rank > 0 and failed.item():
                raise RuntimeError(f"rank 0 could not take checkpoint_dir {cfg.checkpoint_dir}: see its error")
        if failure is not None:
            raise failure
        yield


def resume_point(cfg: TrainConfig) -> Path | None:
    """The checkpoint to resume from (None: start afresh), once its saved configuration is found to match cfg's."""
    latest = latest_checkpoint(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    changes = config_changes(saved_config(latest), cfg) if latest is not None else []
    if changes and cfg.resume == "same-config":
        raise ValueError(
            f"checkpoint {latest} was saved by a run with other settings: {'; '.join(changes)}. Resuming would "
            "continue that run's trajectory under new ones: give this run another checkpoint_dir, or set "
            'TrainConfig(resume="any-config") to resume anyway'
        )
    if changes:
        warnings.warn(
            f"resuming from {latest} with changed settings ({'; '.join(changes)}): resume='any-config'",
            stacklevel=3,  # fit's caller
        )
    return latest


def kill_when_logged(
    cmd: list[str], log_path: str | Path, rows: int, timeout: float = 600.0, env: dict[str, str] | None = None
) -> int:
    """Run `cmd` (a training process writing one JSON line per step to `log_path`), SIGKILL it as soon as
    `rows` steps are logged, and return how many were logged when it died: a crash at an arbitrary moment,
    for showing that resume continues the same trajectory. A run that ends before the kill is an error."""
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise ValueError(f"rows must be an int >= 1, got {rows!r}")
    log = Path(log_path)

    def logged() -> int:
        return log.read_text(encoding="utf-8").count("\n") if log.exists() else 0

    proc = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + timeout
    try:
        while logged() < rows:
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended (exit {proc.returncode}) after {logged()} steps, before the kill")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{rows} steps not logged within {timeout:.0f} s")
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            proc.kill()  # SIGKILL: no handler, no clean-up, as a crashed node or the OOM killer
        proc.wait()
    return logged()
