"""What a training run is configured with: `TrainConfig`, checked when it is made, saved in every checkpoint.

Its own module so that the trainer (labkit.train, which re-exports it) and the checkpoints it writes and resumes
(labkit.checkpoint, which compares a saved configuration with the current one) both import it, one way.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from labkit import precision
from labkit.torchutil import is_int, is_number

SCHEDULES = ("cosine", "linear", "constant")
RESUME_MODES = ("same-config", "any-config")


@dataclass
class TrainConfig:
    """Everything a run needs besides the model and the data; saved in every checkpoint."""

    steps: int
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 0
    schedule: str = "cosine"
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = 1.0  # None: report the norm, never clip
    accum_steps: int = 1
    precision: str = "fp32"
    scale_growth_interval: int = 2000  # fp16: good steps before the loss scale doubles (torch's default)
    activation_checkpointing: bool = False
    compile: bool = False
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # 0: only at the end (when checkpoint_dir is set)
    keep_checkpoints: int = 2
    resume: str = "same-config"  # "any-config": resume a checkpoint saved with other settings, with a warning
    log_path: str | None = None
    tensorboard_dir: str | None = None  # a TensorBoard run: train/* scalars and the hardware's system/* beside them
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes saved with the run

    def __post_init__(self) -> None:
        counts = ("steps", "accum_steps", "warmup_steps", "checkpoint_every", "keep_checkpoints", "seed")
        counts += ("scale_growth_interval",)
        for name in counts:
            if not is_int(getattr(self, name)):
                raise TypeError(f"{name} must be an int, got {getattr(self, name)!r}")
        for name in ("lr", "min_lr", "weight_decay") + (("grad_clip",) if self.grad_clip is not None else ()):
            value = getattr(self, name)
            if not is_number(value):
                raise TypeError(f"{name} must be a finite number, got {value!r}")
        for name in ("checkpoint_dir", "log_path", "tensorboard_dir"):  # text: saved as JSON in checkpoints
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a path or None, got {getattr(self, name)!r}")
        try:
            json.dumps(self.extra)
        except (TypeError, ValueError) as err:
            raise TypeError(f"extra must hold JSON values only (it is saved with every checkpoint): {err}") from None
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.accum_steps < 1:
            raise ValueError(f"accumulation steps must be >= 1, got {self.accum_steps}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {SCHEDULES}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps], got {self.warmup_steps}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr, got min_lr={self.min_lr}, lr={self.lr}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"grad_clip must be positive or None, got {self.grad_clip}")
        if self.precision not in precision.MODES:
            raise ValueError(f"unknown precision {self.precision!r}; choose one of {precision.MODES}")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ValueError("need checkpoint_every >= 0 and keep_checkpoints >= 1")
        if self.scale_growth_interval < 1:
            raise ValueError(f"scale_growth_interval must be >= 1, got {self.scale_growth_interval}")
        if self.resume not in RESUME_MODES:
            raise ValueError(f"resume must be one of {RESUME_MODES}, got {self.resume!r}")
