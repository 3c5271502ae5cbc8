"""Checkpoints: a direct round trip restores weights, optimizer, scaler and RNG; files follow the umask;
resume orders steps by number and survives SIGKILL during a write."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from labkit.checkpoint import checkpoints, kill_when_logged, latest_checkpoint, load_checkpoint, save_checkpoint
from labkit.models import tiny_gpt2
from labkit.train import TrainConfig, make_optimizer
from tests.permissions import UMASK_CASES, modes, umask


def _trained(seed: int = 0):
    model = tiny_gpt2(vocab_size=128, seed=seed)
    cfg = TrainConfig(steps=1, progress=False)
    optimizer = make_optimizer(model, cfg)
    model(torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
    optimizer.step()  # so that the optimizer has state to save
    return model, optimizer, cfg


def test_round_trip_restores_weights_optimizer_scaler_and_the_rng(tmp_path):
    model, optimizer, cfg = _trained()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    torch.manual_seed(3)
    np.random.seed(4)
    save_checkpoint(tmp_path, model, optimizer, scaler, 7, {"epoch": 1, "index": 2}, cfg)
    next_draws = (torch.rand(2), np.random.rand(2))  # what a resumed run must draw next

    fresh, fresh_opt, _ = _trained(seed=1)
    fresh_scaler = torch.amp.GradScaler("cpu")
    state = load_checkpoint(latest_checkpoint(tmp_path), fresh, fresh_opt, fresh_scaler)
    assert (state["step"], state["data"]) == (7, {"epoch": 1, "index": 2})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    saved, loaded = optimizer.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert sorted(saved) == sorted(loaded) and len(saved) > 0
    assert all(torch.equal(saved[i]["exp_avg_sq"], loaded[i]["exp_avg_sq"]) for i in saved)
    assert fresh_scaler.get_scale() == 1024.0
    assert torch.equal(torch.rand(2), next_draws[0]) and np.array_equal(np.random.rand(2), next_draws[1])


def test_an_optimizer_of_other_parameter_groups_is_refused_before_the_weights_change(tmp_path):
    model, optimizer, cfg = _trained()
    save_checkpoint(tmp_path, model, optimizer, torch.amp.GradScaler("cpu", enabled=False), 1, {}, cfg)
    fresh = tiny_gpt2(vocab_size=128, seed=1)
    fresh.transformer.wpe.requires_grad_(False)  # frozen: the optimizer's decay group is one tensor short
    before = [p.detach().clone() for p in fresh.parameters()]
    with pytest.raises(ValueError, match=r"other parameter groups \(sizes \[\d+, \d+\], this one's"):
        load_checkpoint(latest_checkpoint(tmp_path), fresh, make_optimizer(fresh, cfg))
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))


def test_latest_checkpoint_is_none_where_there_is_none(tmp_path):
    assert latest_checkpoint(tmp_path / "absent") is None
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / ".step_000001.abc.tmp").mkdir()  # unfinished writes and other names are not checkpoints
    (tmp_path / "step_2").write_text("a file")
    (tmp_path / "step_x").mkdir()
    assert latest_checkpoint(tmp_path) is None and checkpoints(tmp_path) == []


def test_loading_something_that_is_not_a_checkpoint_says_what_it_is(tmp_path):
    model = tiny_gpt2(vocab_size=128)
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "absent", model)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is unusable: it is a file, not a checkpoint directory"):
        load_checkpoint(tmp_path / "file", model)


def test_steps_past_a_million_order_by_number_in_resume_and_rotation(tmp_path):
    model, optimizer, cfg = _trained()
    cfg.keep_checkpoints = 2
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for step in (999_998, 999_999, 1_000_000, 1_000_001):
        save_checkpoint(tmp_path, model, optimizer, scaler, step, {"epoch": 0, "index": step}, cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1000000", "step_1000001"]
    assert latest_checkpoint(tmp_path).name == "step_1000001"
    assert [s for s, _ in checkpoints(tmp_path)] == [1_000_000, 1_000_001]
    assert load_checkpoint(latest_checkpoint(tmp_path), model)["step"] == 1_000_001


def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path):
    model, optimizer, cfg = _trained()
    cfg.keep_checkpoints = 1
    (tmp_path / "step_000009").mkdir(parents=True)  # newer, not a checkpoint: resume skipped it
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for step in (3, 4):
        save_checkpoint(tmp_path, model, optimizer, scaler, step, {}, cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004", "step_000009"]
    with pytest.warns(UserWarning, match="skipping checkpoint step_000009"):
        assert latest_checkpoint(tmp_path).name == "step_000004"


def test_a_save_removes_what_an_interrupted_save_left(tmp_path):
    model, optimizer, cfg = _trained()
    leftover = tmp_path / ".step_000001.k9.tmp"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half")
    save_checkpoint(tmp_path, model, optimizer, torch.amp.GradScaler("cpu", enabled=False), 2, {}, cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002"]


SAVE_LOOP = Path(__file__).parent / "scripts" / "save_checkpoints.py"


@pytest.mark.slow
def test_sigkill_during_saves_leaves_a_checkpoint_to_resume_from(tmp_path):
    """Kill a process that saves checkpoints back to back, the moment a write is under way; repeat."""
    mid_write = 0
    for attempt in range(4):
        work = tmp_path / f"run{attempt}"
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, str(SAVE_LOOP), str(work)], env=env)
        deadline = time.time() + 120
        while time.time() < deadline and not (checkpoints(work) and list(work.glob(".step_*.tmp"))):
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        mid_write += bool(list(work.glob(".step_*.tmp")))
        latest = latest_checkpoint(work)  # never the unfinished one
        fresh = tiny_gpt2(vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4, seed=1)  # the script's shape
        state = load_checkpoint(latest, fresh)
        assert state["data"] == {"epoch": 0, "index": state["step"]}
        if mid_write:
            break
    assert mid_write, "no kill landed during a write"


@pytest.mark.parametrize("mask, file_mode, dir_mode", UMASK_CASES)
def test_checkpoints_get_the_modes_the_umask_gives(tmp_path, mask, file_mode, dir_mode):
    model, optimizer, cfg = _trained()
    with umask(mask):
        save_checkpoint(
            tmp_path / "ck",
            model,
            optimizer,
            torch.amp.GradScaler("cpu", enabled=False),
            1,
            {"epoch": 0, "index": 1},
            cfg,
        )
    step = "step_000001"
    found = modes(tmp_path / "ck")
    assert (found.pop("."), found.pop(step)) == (dir_mode, dir_mode)
    names = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "trainer.json", "labkit-manifest.json")
    assert {f"{step}/{name}" for name in names} <= set(found)  # and whatever marker fileio.atomic_directory adds
    assert set(found.values()) == {file_mode}


def _writer(tmp_path: Path, rows: int, delay: float) -> list[str]:
    """A process that logs `rows` JSON lines, one every `delay` seconds."""
    code = (
        "import json, sys, time\n"
        f"for i in range({rows}):\n"
        f"    open(sys.argv[1], 'a').write(json.dumps({{'step': i + 1}}) + '\\n'); time.sleep({delay})\n"
    )
    return [sys.executable, "-c", code, str(tmp_path / "log.jsonl")]


def test_kill_when_logged_kills_the_run_mid_way(tmp_path):
    started = time.monotonic()
    logged = kill_when_logged(_writer(tmp_path, 1000, 0.02), tmp_path / "log.jsonl", 5, timeout=60)
    assert 5 <= logged < 1000 and time.monotonic() - started < 30
    time.sleep(0.2)  # a killed writer writes no more
    assert (tmp_path / "log.jsonl").read_text().count("\n") == logged


def test_kill_when_logged_says_when_the_run_ended_first(tmp_path):
    with pytest.raises(RuntimeError, match="ended .* after 2 steps, before the kill"):
        kill_when_logged(_writer(tmp_path, 2, 0.0), tmp_path / "log.jsonl", 5, timeout=60)
    with pytest.raises(ValueError, match="rows must be"):
        kill_when_logged(["true"], tmp_path / "x", 0)
