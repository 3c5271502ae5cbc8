"""Quantize once, load after: a whole-model quantization's codes kept in labkit's cache.

Labs 07 and 08 quantize the same model with the same settings and calibration; on a CPU that takes
minutes. The first call pays and saves the codes, scales and zeros (packed, a few tens of MB); every
later call, in this process or another (a second lab, a re-run, a parallel test worker, which waits on
the build's lock), writes them into a copy of the model in seconds: exactly the model a fresh run gives.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from labkit import __version__, assets
from labkit.quant.formats import QuantConfig, QuantizedWeight
from labkit.quant.gptq_format import pack_rows, unpack_rows
from labkit.quant.whole_model import LayerRecord, QuantizedModel, quantize_model

META = "labkit-quantized.json"


def fingerprint(model: nn.Module, cfg: QuantConfig, calibration: torch.Tensor | None, method: str) -> str:
    """A digest of everything the result depends on: the weights, the settings, the calibration, labkit."""
    digest = hashlib.sha256(
        json.dumps([dataclasses.asdict(cfg), method, __version__], sort_keys=True, default=str).encode()
    )
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    if calibration is not None:
        digest.update(calibration.detach().cpu().to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()[:20]


def quantize_model_cached(
    model: nn.Module, cfg: QuantConfig, calibration: torch.Tensor | None = None, *, method: str = "gptq", **kwargs: Any
) -> tuple[QuantizedModel, bool]:
    """`quantize_model`, computed once per (weights, settings, calibration, labkit version); (result, reused).

    The result is the same model either way; `seconds` and the per-layer records are those of the
    original quantization, and `reused` says that this call did not redo it.
    """
    dest = assets.cache_dir() / "quantized" / f"{method}-{fingerprint(model, cfg, calibration, method)}"
    built = []

    def build(tmp: Path) -> None:
        qm = quantize_model(model, cfg, calibration, method=method, **kwargs)
        tensors = {}
        for name, q in qm.weights.items():
            tensors |= {f"{name}.codes": pack_rows(q.codes.T, q.bits), f"{name}.scales": q.scales}
            tensors |= {f"{name}.zeros": q.zeros, f"{name}.g_idx": q.g_idx}
        save_file(tensors, str(tmp / "codes.safetensors"))
        meta = {"method": method, "seconds": qm.seconds, "calibration_tokens": qm.calibration_tokens}
        meta |= {"names": list(qm.weights), "layers": [dataclasses.asdict(r) for r in qm.layers]}
        (tmp / META).write_text(json.dumps(meta, indent=1))
        built.append(True)

    assets.cached_build(
        dest,
        build,
        source=f"labkit.quant.cache ({method}, {cfg.label()})",
        builder=f"labkit.quant.quantize_model_cached ({method}, {cfg.label()}; `labkit prepare` does not stage it)",
    )
    return _load(dest, model, cfg), not built


def _load(entry: Path, model: nn.Module, cfg: QuantConfig) -> QuantizedModel:
    """A copy of `model` with the entry's dequantized weights written in, as quantize_model writes them."""
    meta = json.loads((entry / META).read_text())
    tensors = load_file(str(entry / "codes.safetensors"))
    copied = copy.deepcopy(model)
    weights = {}
    for name in meta["names"]:
        module = copied.get_submodule(name)
        codes = unpack_rows(tensors[f"{name}.codes"], cfg.bits, module.in_features).T.contiguous()
        q = QuantizedWeight(
            codes.to(torch.uint8),
            tensors[f"{name}.scales"],
            tensors[f"{name}.zeros"],
            tensors[f"{name}.g_idx"],
            cfg.bits,
        )
        module.weight.data = q.dequantize().to(module.weight.device).to(module.weight.dtype)
        weights[name] = q
    layers = [LayerRecord(**{**r, "shape": tuple(r["shape"])}) for r in meta["layers"]]
    return QuantizedModel(copied, cfg, meta["method"], weights, layers, meta["seconds"], meta["calibration_tokens"])
