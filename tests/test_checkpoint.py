"""Checkpoints: a direct round trip restores weights, optimizer, scaler and RNG; files follow the umask."""

import numpy as np
import pytest
import torch

from labkit.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
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


def test_latest_checkpoint_is_none_where_there_is_none(tmp_path):
    assert latest_checkpoint(tmp_path / "absent") is None
    assert latest_checkpoint(tmp_path) is None


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
    assert modes(tmp_path / "ck") == {
        ".": dir_mode,
        step: dir_mode,
        f"{step}/model.safetensors": file_mode,
        f"{step}/optimizer.safetensors": file_mode,
        f"{step}/rng.safetensors": file_mode,
        f"{step}/trainer.json": file_mode,
        f"{step}/labkit-manifest.json": file_mode,
    }
