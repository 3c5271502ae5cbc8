"""Small torch and library idioms that several techniques need, written once.

Each one leaves the process as it found it: a model's train/eval mode, environment variables,
what a library prints. That is what lets a lab call techniques in any order.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_DECODER_PATHS = ("model.layers", "model.decoder.layers", "gpt_neox.layers", "transformer.h")


def is_int(value: Any) -> bool:
    """An int and not a bool: True is 1 to Python, never a size or a count to a caller who wrote it."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float, not a bool: what a rate, scale or probability argument must be."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_int(name: str, value: Any, minimum: int = 0) -> None:
    """Refuse a count or size by name: TypeError unless an int (not a bool), ValueError below `minimum`."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_number(name: str, value: Any, minimum: float | None = None) -> None:
    """Refuse a rate, time or amount by name: TypeError unless a finite number (no bool), ValueError below `minimum`."""
    if not is_number(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be a number >= {minimum}, got {value!r}")


def check_bool(name: str, value: Any) -> None:
    """Refuse a flag that is not True or False (a 1 or a "yes" would read as True without a word)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_module(value: Any, name: str = "model") -> None:
    """Refuse, by name, what is not a torch.nn.Module before an AttributeError deep inside says so less clearly."""
    if not isinstance(value, nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(value).__name__}")


def as_path(name: str, value: Any) -> Path:
    """`value` as a Path; TypeError, by name, for what is not a path (None, a number) before anything is written."""
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise TypeError(f"{name} must be a path (a non-empty str or os.PathLike), got {value!r}")
    return Path(value)


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the initialized process group, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def device_of(device: str | torch.device) -> torch.device:
    """torch.device(device), with a clear ValueError instead of torch's "Invalid device string"."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got {device!r}") from err


def check_token_ids(ids: torch.Tensor, vocab_size: int | None, what: str = "input ids") -> None:
    """Refuse token ids outside [0, vocab_size), naming one, before an embedding lookup fails on it."""
    if ids.numel() == 0 or vocab_size is None:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{what} hold token id {bad}, outside the model's vocabulary [0, {vocab_size})")


def vocab_size(model: nn.Module) -> int | None:
    """Rows of the model's input embedding (the ids it can read are 0 … vocab_size - 1); None for a model
    without transformers' get_input_embeddings, whose ids then go unchecked."""
    embedding = getattr(model, "get_input_embeddings", lambda: None)()
    return getattr(embedding, "num_embeddings", None)


def module_name(model: nn.Module, module: nn.Module) -> str:
    """The dotted name under which `module` sits in `model` (as named_modules gives it; "" for the model itself)."""
    for name, m in model.named_modules():
        if m is module:
            return name
    raise ValueError(f"{type(module).__name__} is not a submodule of {type(model).__name__}")


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` where the submodule called `name` (dotted, as named_modules gives it) is, in place."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks of a causal LM (Llama/SmolLM2, OPT, GPT-NeoX, GPT-2, Qwen, Mistral ...)."""
    for path in _DECODER_PATHS:
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return obj
    looked = ", ".join(_DECODER_PATHS)
    raise ValueError(f"cannot find the decoder blocks of {type(model).__name__} (looked for {looked})")


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The nn.Linear layers inside the decoder blocks, by their dotted names in `model`; none is an error."""
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    linears = {
        f"{prefix}.{i}.{name}": m
        for i, block in enumerate(layers)
        for name, m in block.named_modules()
        if isinstance(m, nn.Linear)
    }
    if not linears:
        raise ValueError(
            f"no nn.Linear inside the decoder blocks of {type(model).__name__} "
            "(GPT-2's Conv1D layers are not supported)"
        )
    return linears


def activation_checkpointing(model: nn.Module, on: bool | None = None) -> bool:
    """Whether a transformers model recomputes activations in the backward; turn it on or off when `on` is given.

    transformers 5 renamed gradient_checkpointing_* to activation_checkpointing_*; both are accepted. Older
    versions default to torch's reentrant checkpoint, which torch deprecates; both then get the non-reentrant one.
    """
    if on is not None:
        check_bool("on", on)
    new = hasattr(model, "activation_checkpointing_enable")
    if not new and not hasattr(model, "gradient_checkpointing_enable"):
        raise ValueError(f"activation checkpointing needs a transformers model, got {type(model).__name__}")
    if on is not None:
        prefix = "activation_checkpointing_" if new else "gradient_checkpointing_"
        if on:
            getattr(model, prefix + "enable")(**{prefix + "kwargs": {"use_reentrant": False}})
        else:
            getattr(model, prefix + "disable")()
    return bool(model.is_activation_checkpointing if new else model.is_gradient_checkpointing)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Dropout off for a measurement, then the model's train/eval mode as it was (also after an error)."""
    check_module(model)
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


@contextlib.contextmanager
def seeded(seed: int, device: str | torch.device | None = None) -> Iterator[None]:
    """Draw from torch's RNG seeded with `seed` inside the block, and give the caller's RNG state back after.

    Covers the CPU generator and, when `device` is a GPU, that GPU's: what model initialization and
    sampling on that device draw from.
    """
    if not is_int(seed):
        raise TypeError(f"seed must be an int, got {seed!r}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(cuda[0]):
                torch.cuda.manual_seed(seed)
        yield


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """Set environment variables for a call, then give the whole environment back as it was: also what the
    call itself set (GPTQModel and PEFT set variables for good when imported) is undone."""
    wrong = {name: value for name, value in values.items() if not isinstance(value, str)}
    if wrong:  # os.environ.update would fail part-way, with the earlier variables already set
        raise TypeError(f"environment variables take str values, got {wrong!r}")
    before = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        for name in os.environ.keys() - before.keys():
            del os.environ[name]
        os.environ.update(before)


@contextlib.contextmanager
def quiet(what: str, *, ignore_warnings: tuple[str, ...] = ()) -> Iterator[None]:
    """Hold back what a library prints (banners, progress lines); if `what` fails, raise with the output's end.

    `ignore_warnings` are message regexes of warnings that say nothing to the reader; others still show.
    transformers' own log, when it is imported, is held to errors for the call: its handler writes to the stderr it
    found at import, which redirecting `sys.stderr` does not reach.
    """
    if not isinstance(ignore_warnings, (tuple, list)) or not all(isinstance(m, str) for m in ignore_warnings):
        raise TypeError(f"ignore_warnings must be a tuple of message regexes, got {ignore_warnings!r}")
    log = io.StringIO()
    hf_logging = sys.modules.get("transformers.utils.logging")
    verbosity = hf_logging.get_verbosity() if hf_logging else None
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            for message in ignore_warnings:
                warnings.filterwarnings("ignore", message=message)
            if hf_logging:
                hf_logging.set_verbosity_error()
            yield
    except Exception as err:
        raise RuntimeError(f"{what} failed; its output ends with:\n{log.getvalue()[-3000:]}") from err
    finally:
        if hf_logging:
            hf_logging.set_verbosity(verbosity)
