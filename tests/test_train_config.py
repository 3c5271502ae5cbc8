"""labkit.train_config: a run's configuration, checked when it is made (the trainer and checkpoints both use it)."""

import pytest

from labkit import checkpoint, train
from labkit.train_config import SCHEDULES, TrainConfig


def test_the_trainer_and_the_checkpoints_share_one_config_type():
    assert train.TrainConfig is TrainConfig and train.SCHEDULES is SCHEDULES  # `from labkit.train import ...` as before
    assert checkpoint.TrainConfig is TrainConfig


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"accum_steps": 0}, "accumulation steps must be >= 1"),
        ({"schedule": "step"}, "unknown schedule"),
        ({"warmup_steps": 20}, "warmup_steps"),
        ({"precision": "fp8"}, "unknown precision"),
        ({"min_lr": 1.0}, "min_lr <= lr"),
        ({"grad_clip": 0}, "grad_clip"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(steps=10, **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"steps": "10"}, "steps must be an int, got '10'"),
        ({"accum_steps": 2.0}, "accum_steps must be an int"),
        ({"keep_checkpoints": True}, "keep_checkpoints must be an int"),
        ({"lr": "3e-4"}, "lr must be a finite number"),
        ({"lr": float("nan")}, "lr must be a finite number"),
        ({"grad_clip": "1"}, "grad_clip must be a finite number"),
        ({"checkpoint_dir": 3}, "checkpoint_dir must be a path or None"),
        ({"extra": {"when": object()}}, "extra must hold JSON values only"),
    ],
)
def test_config_types_are_checked(kwargs, match):
    with pytest.raises(TypeError, match=match):
        TrainConfig(**{"steps": 10, **kwargs})


def test_config_keeps_paths_as_text_for_the_checkpoint(tmp_path):
    cfg = TrainConfig(steps=1, checkpoint_dir=tmp_path / "ck", log_path=tmp_path / "log.jsonl")
    assert (cfg.checkpoint_dir, cfg.log_path) == (str(tmp_path / "ck"), str(tmp_path / "log.jsonl"))
