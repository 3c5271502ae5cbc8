"""The library side, for parity: GPTQModel quantizes with labkit's settings, transformers loads GPTQ checkpoints
through GPTQModel's kernels. Each call leaves the process as it found it: its environment and working directory."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from labkit import fileio
from labkit.quant.formats import QuantConfig
from labkit.torchutil import decoder_layers, environ, quiet, replace_module


def gptqmodel_available() -> bool:
    """Whether GPTQModel (and optimum, which transformers needs to load GPTQ checkpoints) can be imported."""
    return all(importlib.util.find_spec(m) is not None for m in ("gptqmodel", "optimum"))


@contextlib.contextmanager
def _gptqmodel_environ() -> Iterator[None]:
    """At most 4 GPTQModel CPU workers (it would start one per core) unless the user chose a number, for this
    call only; and the environment as it was after it. GPTQModel reads the variable when it first builds its
    thread pool, inside the call; importing it sets variables of its own for good (HF_HOME and three more HF
    cache paths through tokenicer, PYTORCH_ALLOC_CONF, CUDA_DEVICE_ORDER), undone here too."""
    workers = os.environ.get("GPTQMODEL_CPU_WORKERS", str(max(1, min(os.cpu_count() or 1, 4))))
    with environ(GPTQMODEL_CPU_WORKERS=workers):
        yield


@contextlib.contextmanager
def _gptqmodel_logs_elsewhere() -> Iterator[None]:
    """GPTQModel 7.6 writes a JSON log of every quantization run into `logs/` under the working directory
    (the relative `_PROJECT_LOG_DIR` of gptqmodel.looper.loop_processor; no option or variable moves it).
    Point it at a temporary directory for the call: the same rows are in the checkpoint's quant_log.csv.
    Changing directory instead would move every relative path of the process, the caller's included."""
    # GPTQModel is optional and slow to import: imported only when it is used, like everywhere in this module
    from gptqmodel.looper import loop_processor

    before = loop_processor._PROJECT_LOG_DIR
    with tempfile.TemporaryDirectory(prefix="labkit-gptqmodel-logs-") as tmp:
        loop_processor._PROJECT_LOG_DIR = Path(tmp)  # GPTQModel drains its log writes before quantize returns
        try:
            yield
        finally:
            loop_processor._PROJECT_LOG_DIR = before


def quantize_with_gptqmodel(
    source: str | Path, calibration: torch.Tensor, cfg: QuantConfig, dest: str | Path, batch_size: int = 1
) -> Path:
    """Quantize the model in directory `source` (holding a tokenizer too) with GPTQModel, same settings as labkit."""
    with _gptqmodel_environ(), quiet("GPTQModel quantization"), _gptqmodel_logs_elsewhere():
        # GPTQModel is optional (the "gptq" extra) and slow to import
        from gptqmodel import GPTQModel, QuantizeConfig

        qcfg = QuantizeConfig(
            bits=cfg.bits,
            group_size=cfg.group_size,
            sym=cfg.sym,
            desc_act=cfg.act_order,
            damp_percent=cfg.damp,
            act_group_aware=False,
        )
        model = GPTQModel.load(str(source), qcfg, device="cuda" if torch.cuda.is_available() else "cpu")
        calib = [{"input_ids": row[None], "attention_mask": torch.ones_like(row)[None]} for row in calibration]
        model.quantize(calib, batch_size=batch_size)
        with fileio.atomic_directory(dest) as tmp:
            model.save(str(tmp))
    return Path(dest)


def load_with_transformers(path: str | Path, device: str = "cpu") -> nn.Module:
    """Load a GPTQ checkpoint the standard way: AutoModelForCausalLM.from_pretrained (GPTQModel's kernels)."""
    if not gptqmodel_available():
        raise ImportError(
            "loading GPTQ checkpoints through transformers needs GPTQModel and optimum: "
            "pip install 'labkit[gptq]' (see README)"
        )
    # transformers is slow to import, and loads a GPTQ checkpoint through the optional optimum and GPTQModel
    from transformers import AutoModelForCausalLM

    with _gptqmodel_environ(), quiet(f"loading {path} through transformers"):
        return AutoModelForCausalLM.from_pretrained(str(path), device_map=device).eval()


def gptq_kernels(model: nn.Module) -> dict[str, int]:
    """Which GPTQModel kernel runs the model's quantized linears, counted by class and backend, e.g.
    {"MarlinLinear (gptq_marlin)": 210}: GPTQModel picks one per device at load time, silently."""
    # GPTQModel is optional (the "gptq" extra); a model with its kernels means it is installed
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear

    return dict(
        Counter(
            f"{type(m).__name__} ({m.SUPPORTS_BACKENDS[0].value})"
            for m in model.modules()
            if isinstance(m, BaseQuantLinear)
        )
    )


# ----------------------------------------------------------------------------- bitsandbytes (NF4, QLoRA)


def bitsandbytes_available() -> bool:
    """Whether bitsandbytes (the `qlora` extra) can be imported."""
    return importlib.util.find_spec("bitsandbytes") is not None


def import_bitsandbytes() -> ModuleType:
    """bitsandbytes, imported without the warning it logs on a CPU with AVX512-BF16 when the optional `kernels`
    package is missing: with that package it would fetch a faster 4-bit CPU kernel from the Hugging Face Hub, which
    this offline course never does. Its built-in CPU path, which it uses instead, is the one the parity tests check."""
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import bitsandbytes
    finally:
        log.setLevel(level)
    return bitsandbytes


def to_bnb_4bit(model: nn.Module, compute_dtype: torch.dtype = torch.float32, blocksize: int = 64) -> nn.Module:
    """Every nn.Linear inside the decoder blocks swapped, in place, for bitsandbytes' `Linear4bit` (NF4 with double
    quantization, as QLoRA loads a model): the library side of `quantize_model_nf4` + `pack_model_nf4`."""
    bnb = import_bitsandbytes()

    for block in decoder_layers(model):
        for name, linear in [(n, m) for n, m in block.named_modules() if isinstance(m, nn.Linear)]:
            layer = bnb.nn.Linear4bit(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                compute_dtype=compute_dtype,
                compress_statistics=True,
                quant_type="nf4",
                device="meta",
            )
            weight = linear.weight.detach().float().cpu()
            layer.weight = bnb.nn.Params4bit(
                weight, requires_grad=False, quant_type="nf4", blocksize=blocksize, compress_statistics=True
            )
            if linear.bias is not None:
                layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
            # bitsandbytes quantizes when the weight moves to its device
            replace_module(block, name, layer.to(linear.weight.device))
    return model


def nf4_from_bnb(layer: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """labkit's NF4Linear holding the very codes and scales of a quantized bitsandbytes `Linear4bit`."""
    from labkit.quant.nf4 import NF4Weight
    from labkit.quant.packed import NF4Linear

    state = layer.weight.quant_state
    if state is None or state.quant_type != "nf4":
        raise ValueError("expected a quantized NF4 Linear4bit (move it to its device first: that quantizes it)")
    nested = state.nested
    q = NF4Weight(
        layer.weight.data.reshape(-1),
        state.absmax,
        tuple(state.shape),
        state.blocksize,
        state.state2.absmax if nested else None,
        float(state.offset) if nested else 0.0,
    )
    return NF4Linear(q, layer.bias, dtype=dtype)


def from_bnb_4bit(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Every bitsandbytes `Linear4bit` of `model` swapped, in place, for labkit's NF4Linear with the same codes."""
    bnb = import_bitsandbytes()

    for name, layer in [(n, m) for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]:
        replace_module(model, name, nf4_from_bnb(layer, dtype))
    return model
