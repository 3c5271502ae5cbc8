"""The course's trainer: token-normalized gradient accumulation, mixed precision, clipping, LR schedules,
and checkpoints that resume the exact same trajectory. nanoGPT-sized: read it top to bottom.

A step takes `accum_steps` micro-batches. Each micro-batch's summed loss is divided by the number of
target tokens in the *whole window*, so k micro-batches of b sequences give the same gradient as one
batch of k·b sequences, even when the sequences have different lengths. (Dividing each micro-batch
by its own token count — the per-micro-batch mean — weights short micro-batches up; transformers
shipped that bug until October 2024.)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from labkit import assets, bench, monitor, precision
from labkit.checkpoint import (
    DataStream,
    hold_checkpoint_dir,
    load_checkpoint,
    remove_unfinished,
    resume_point,
    save_checkpoint,
)
from labkit.profiler import phase
from labkit.torchutil import activation_checkpointing, check_token_ids, rank_and_world, seeded, vocab_size
from labkit.train_config import RESUME_MODES as RESUME_MODES  # re-exported: `from labkit.train import ...` as before
from labkit.train_config import SCHEDULES as SCHEDULES
from labkit.train_config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for 0-based `step`: linear warm-up to lr, then cosine/linear decay to min_lr, or constant."""
    if not 0 <= step < cfg.steps:
        raise ValueError(f"step must be in [0, {cfg.steps}) (0-based, cfg.steps steps), got {step}")
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps - 1))
    if cfg.schedule == "cosine":
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
    return cfg.lr - (cfg.lr - cfg.min_lr) * progress


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not biases or norm gains); fused on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    fused = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=cfg.betas,
        fused=fused,
    )


# ----------------------------------------------------------------------------- batches and the loss


def as_batch(item: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """A micro-batch as {input_ids, targets[, attention_mask]}: targets[t] is what position t predicts.

    Accepts the shard loader's (input, target) pairs, or a padded dict with HF-style `labels`
    (-100 on padding, not yet shifted).
    """
    if isinstance(item, (tuple, list)):
        x, y = item
        batch = {"input_ids": x, "targets": y}
    elif isinstance(item, dict):
        labels = item.get("labels", item["input_ids"])
        targets = torch.full_like(labels, -100)
        targets[:, :-1] = labels[:, 1:]
        batch = {"input_ids": item["input_ids"], "targets": targets}
        if "attention_mask" in item:
            batch["attention_mask"] = item["attention_mask"]
    else:
        raise TypeError(f"a batch is an (input, target) pair or a dict with input_ids, got {type(item).__name__}")
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def loss_sum(model: nn.Module, batch: dict[str, torch.Tensor], policy: precision.Policy) -> torch.Tensor:
    """Summed cross-entropy over the batch's target tokens (positions with target -100 are skipped). A transformers
    model is told to build no KV cache: training never reads one (and with checkpointing transformers warns)."""
    inner = model.module if isinstance(model, (nn.DataParallel, DistributedDataParallel)) else model
    no_cache = {"use_cache": False} if hasattr(getattr(inner, "config", None), "use_cache") else {}
    with policy.autocast():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), **no_cache).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16/fp16 up to fp32; fp64 stays fp64
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100, reduction="sum")


def loss_divisors(token_counts: list[int], normalize: str = "tokens") -> list[int]:
    """What to divide each micro-batch's *summed* loss by, given the target tokens of every micro-batch.

    "tokens": the window's total, for every micro-batch — the summed gradients then equal the big
    batch's mean-loss gradient exactly. "per_microbatch_mean": each one's own count times the number
    of micro-batches — the common mistake, which over-weights the tokens of short micro-batches.
    """
    if normalize not in ("tokens", "per_microbatch_mean"):
        raise ValueError(f"normalize must be 'tokens' or 'per_microbatch_mean', got {normalize!r}")
    total = sum(token_counts)
    if total == 0:
        raise ValueError("the accumulation window has no target tokens")
    if normalize == "tokens":
        return [total] * len(token_counts)
    return [n * len(token_counts) for n in token_counts]


NORMALIZATIONS = ("tokens", "rank_tokens", "per_microbatch_mean")


def accumulate_gradients(
    model: nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    policy: precision.Policy,
    scaler: torch.amp.GradScaler | None = None,
    normalize: str = "tokens",
) -> tuple[float, int]:
    """Backward over micro-batches into .grad; return (this rank's mean loss per target token, its target tokens).

    normalize="tokens" divides every summed loss by the target tokens of the whole window — of every
    rank, when `model` is DDP-wrapped: the exact gradient of the one big batch. "rank_tokens" divides
    by this rank's own window (the same without DDP; under DDP the ranks' means are averaged, which
    over-weights the tokens of ranks with short documents) and "per_microbatch_mean" averages
    per-micro-batch means: the two common mistakes, kept for labs 03 and 04 to show that they differ.
    """
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    device = micro_batches[0]["input_ids"].device
    counts = [int((mb["targets"] != -100).sum()) for mb in micro_batches]
    group = _ddp_group(model)
    if normalize == "tokens" and group is not None and dist.get_world_size(group) > 1:
        # DDP averages the ranks' gradients (divides their sum by `world`): dividing each rank's summed
        # loss by all ranks' tokens / world makes that average the gradient of the mean over all tokens.
        every_rank = torch.tensor(sum(counts), dtype=torch.float64, device=device)
        dist.all_reduce(every_rank, group=group)
        if every_rank.item() == 0:
            raise ValueError("the accumulation window has no target tokens on any rank")
        divisors = [every_rank.item() / dist.get_world_size(group)] * len(counts)
    else:
        divisors = loss_divisors(counts, "per_microbatch_mean" if normalize == "per_microbatch_mean" else "tokens")
    loss_sums = []  # kept in the loss's dtype: float64 stays float64
    for i, (mb, divisor) in enumerate(zip(micro_batches, divisors)):
        last = i == len(micro_batches) - 1
        # Under DDP, gradients are all-reduced only after the last micro-batch (lab 04).
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with phase("forward"):
                s = loss_sum(model, mb, policy)
                loss = s / divisor
            with phase("backward"):
                (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sums.append(s.detach())
    return torch.stack(loss_sums).sum().item() / max(1, sum(counts)), sum(counts)


def _ddp_group(model: nn.Module) -> Any:
    """The process group DDP averages `model`'s gradients over; None when it is not DDP-wrapped."""
    module = getattr(model, "_orig_mod", model)  # under torch.compile
    return module.process_group if isinstance(module, DistributedDataParallel) else None


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[dict[str, torch.Tensor]],
    policy: precision.Policy,
    scaler: torch.amp.GradScaler,
    grad_clip: float | None,
) -> dict[str, float | int | bool]:
    """One optimizer step: accumulate, unscale, clip (reporting the pre-clip norm), step, zero grads."""
    with policy.matmul_precision():  # TF32, when on, for the backward too: autocast covers only the forward
        loss, tokens = accumulate_gradients(model, micro_batches, policy, scaler)
    if not scaler.is_enabled() and not math.isfinite(loss):
        optimizer.zero_grad(set_to_none=True)
        raise FloatingPointError(
            f"non-finite loss {loss}: lower the learning rate, check the data, or use "
            "fp32/bf16 (fp16 runs skip such steps through the loss scaler)"
        )
    with phase("optimizer"):  # clipping included
        scaler.unscale_(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip is not None else float("inf"))
        scale = scaler.get_scale()
        scaler.step(optimizer)  # skipped by the scaler when fp16 gradients overflowed
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return {
        "loss": loss,
        "tokens": tokens,
        "grad_norm": norm.item(),
        "skipped": bool(scaler.is_enabled() and scaler.get_scale() < scale),
        "loss_scale": scale if scaler.is_enabled() else None,  # the scale this step's backward used
    }


def step_seconds(model: nn.Module, batch: dict[str, torch.Tensor], mode: str, repeats: int = 2) -> float:
    """Median seconds of one optimizer step (forward, backward, AdamW) in precision `mode` after a warm-up step:
    a probe before committing to a long run in a mode that this device may only emulate. The model is trained."""
    device = batch["input_ids"].device
    policy = precision.policy(mode, device)
    optimizer, scaler = make_optimizer(model, TrainConfig(steps=1)), policy.scaler()
    step = lambda: train_step(model, optimizer, [batch], policy, scaler, grad_clip=1.0)  # noqa: E731
    return bench.time_fn(step, warmup=1, repeats=repeats, device=device).median


def next_window(data: Iterator, accum_steps: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """The next step's micro-batches on `device`, marked as the step's data phase for a profiler."""
    with phase("data"):
        return [as_batch(next(data), device) for _ in range(accum_steps)]


def stepper(model: nn.Module, loader: Iterable, cfg: TrainConfig) -> Callable[[], dict[str, Any]]:
    """One optimizer step per call, as `fit` takes them (the same phases, marked for a profiler), at cfg.lr, without
    fit's schedule, checkpoints or logs: what `labkit.profiler.profile_steps` and a timer wrap."""
    device = next(model.parameters()).device
    policy, optimizer, data = precision.policy(cfg.precision, device), make_optimizer(model, cfg), DataStream(loader)
    scaler = policy.scaler(cfg.scale_growth_interval)
    model.train()

    def step() -> dict[str, Any]:
        return train_step(model, optimizer, next_window(data, cfg.accum_steps, device), policy, scaler, cfg.grad_clip)

    return step


# ----------------------------------------------------------------------------- the loop


def fit(model: nn.Module, loader: Iterable, cfg: TrainConfig) -> list[dict[str, Any]]:
    """Train for cfg.steps optimizer steps, resuming from the newest checkpoint in cfg.checkpoint_dir that
    verifies (warning about any newer one it skips, and removing what killed saves left behind).
    checkpoint_dir and log_path are checked before the first step.

    A run holds cfg.checkpoint_dir for the whole run (checkpoint.writer_lock): a second run into it is refused
    with CheckpointDirBusy naming the first, before it changes anything; the lock of a killed run is released by
    the kernel. A resume first compares the checkpoint's saved configuration with cfg and refuses one saved with
    other trajectory settings (lr, schedule, seed, ...: see checkpoint.RESUME_MAY_CHANGE), naming them, unless
    cfg.resume="any-config", which warns and goes on.

    Under torchrun (an initialized process group of several ranks) the model is wrapped in
    DistributedDataParallel: give each rank its own shard of the data (make_loader's rank and
    world_size); accumulation skips the all-reduce on all but the last micro-batch (no_sync), and
    only rank 0 writes checkpoints and logs, and holds the lock.

    What it changes, it gives back: the model leaves in the train/eval mode it came in, with gradient
    checkpointing off again if cfg.activation_checkpointing turned it on, and torch's RNG (seeded with
    cfg.seed for the run: dropout draws from it) in the caller's state. Resuming also sets NumPy's and
    Python's RNG to the checkpoint's, so that a resumed run draws what the uninterrupted one drew.
    """
    outputs = (("checkpoint_dir", True), ("log_path", False), ("tensorboard_dir", True))
    for name, is_dir in outputs:  # before any work, not at the first save
        if getattr(cfg, name) is not None and (problem := assets.output_path_problem(getattr(cfg, name), is_dir)):
            raise ValueError(f"{name}: {problem}")
    device = next(model.parameters()).device
    with hold_checkpoint_dir(cfg, device):
        latest = resume_point(cfg)
        was_training = model.training
        turn_off = cfg.activation_checkpointing and not activation_checkpointing(model)
        with seeded(cfg.seed, device):
            try:
                return _fit(model, loader, cfg, device, latest)
            finally:
                model.train(was_training)
                if turn_off:
                    activation_checkpointing(model, on=False)


def _fit(
    model: nn.Module, loader: Iterable, cfg: TrainConfig, device: torch.device, latest: Path | None
) -> list[dict[str, Any]]:
    policy = precision.policy(cfg.precision, device)
    if cfg.activation_checkpointing:
        activation_checkpointing(model, on=True)
    model.train()
    rank, world = rank_and_world()
    step_model = model
    if world > 1:
        step_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    step_model = torch.compile(step_model) if cfg.compile else step_model
    optimizer = make_optimizer(model, cfg)
    scaler = policy.scaler(cfg.scale_growth_interval)
    start, data = 0, DataStream(loader)
    if cfg.checkpoint_dir and rank == 0:
        remove_unfinished(cfg.checkpoint_dir)  # what a kill during a save left behind
    if latest is not None:
        state = load_checkpoint(latest, model, optimizer, scaler)
        start, data = state["step"], DataStream(loader, **state["data"])
    history = []
    bar = tqdm(range(start, cfg.steps), desc="train", disable=not cfg.progress, initial=start, total=cfg.steps)
    with monitor.training_log(cfg.tensorboard_dir if rank == 0 else None, device) as board:
        for step in bar:
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            micro = next_window(data, cfg.accum_steps, device)
            if step == start:  # once: a wrong tokenizer or vocab_size shows in the first batch, named here
                for mb in micro:
                    check_token_ids(mb["input_ids"], vocab_size(model))
                    check_token_ids(mb["targets"][mb["targets"] != -100], vocab_size(model), "targets")
            with bench.track_peak_memory(device) as memory, bench.stopwatch(device) as elapsed:
                metrics = train_step(step_model, optimizer, micro, policy, scaler, cfg.grad_clip)
            record = {
                "step": step + 1,
                "lr": lr,
                **metrics,
                "seconds": elapsed.seconds,  # memory: the step's peak
                "tokens_per_s": metrics["tokens"] / elapsed.seconds,
                "memory_bytes": memory.peak_bytes,
            }
            history.append(record)
            if cfg.log_path and rank == 0:
                bench.log_result(cfg.log_path, {"event": "train_step", **record})
            board(record)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", lr=f"{lr:.2e}")
            done = step + 1 == cfg.steps
            if cfg.checkpoint_dir and (done or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)):
                if rank == 0:
                    save_checkpoint(cfg.checkpoint_dir, model, optimizer, scaler, step + 1, data.state(), cfg)
                if world > 1:
                    dist.barrier()  # no rank runs ahead of a checkpoint it may need to resume from
    return history
