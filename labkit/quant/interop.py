"""The library side, for parity: GPTQModel quantizes with labkit's settings, transformers loads GPTQ checkpoints
through GPTQModel's kernels."""

from __future__ import annotations

import importlib.util
import os
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from labkit import assets
from labkit.quant.grid import QuantConfig
from labkit.torchutil import quiet


def gptqmodel_available() -> bool:
    """Whether GPTQModel (and optimum, which transformers needs to load GPTQ checkpoints) can be imported."""
    return all(importlib.util.find_spec(m) is not None for m in ("gptqmodel", "optimum"))


def _cap_gptqmodel_workers() -> None:
    """At most 4 GPTQModel CPU workers (it would start one per core), unless the user chose a number."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(1, min(os.cpu_count() or 1, 4))))


def quantize_with_gptqmodel(
    source: str | Path, calibration: torch.Tensor, cfg: QuantConfig, dest: str | Path, batch_size: int = 1
) -> Path:
    """Quantize the model in directory `source` (holding a tokenizer too) with GPTQModel, same settings as labkit."""
    _cap_gptqmodel_workers()
    with quiet("GPTQModel quantization"):
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
        with assets.atomic_directory(dest) as tmp:
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

    _cap_gptqmodel_workers()
    with quiet(f"loading {path} through transformers"):
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
