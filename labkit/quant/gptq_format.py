"""The classic "gptq" checkpoint both ways: int32-packed qweight/qzeros, fp16 scales, g_idx and a
`quantization_config` in config.json, which transformers (through GPTQModel) and GPTQModel load;
`load_gptq` also reads checkpoints that GPTQModel wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from labkit import __version__, fileio
from labkit.models import is_saved_model
from labkit.quant.formats import QuantConfig, QuantizedWeight
from labkit.quant.whole_model import QuantizedModel
from labkit.torchutil import module_name


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack [rows, cols] integers of `bits` bits into int32 along the rows: a little-endian bit stream,
    32 values per `bits` words (the GPTQ layout; for 2, 4 and 8 bits each word holds 32/bits whole values)."""
    v = values.to(torch.int64).cpu().numpy()
    rows, cols = v.shape
    if rows * bits % 32:
        raise ValueError(f"{rows} rows of {bits}-bit values do not fill whole 32-bit words")
    if v.min(initial=0) < 0 or v.max(initial=0) >= 2**bits:
        raise ValueError(f"values must lie in [0, {2**bits - 1}] to pack into {bits} bits")
    bitplanes = (v[:, None, :] >> np.arange(bits)[None, :, None]) & 1  # [rows, bits, cols]
    words = bitplanes.reshape(rows * bits // 32, 32, cols)
    packed = (words << np.arange(32, dtype=np.int64)[None, :, None]).sum(axis=1)
    return torch.from_numpy(packed.astype(np.uint32).view(np.int32))


def unpack_rows(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """Inverse of pack_rows: int32 [rows * bits / 32, cols] back to [rows, cols] integers (int32)."""
    p = packed.cpu().numpy().view(np.uint32).astype(np.int64)
    if p.shape[0] * 32 != rows * bits:
        raise ValueError(f"{p.shape[0]} packed words cannot hold {rows} values of {bits} bits")
    bitstream = (p[:, None, :] >> np.arange(32)[None, :, None]) & 1  # [words, 32, cols]
    bitplanes = bitstream.reshape(rows, bits, -1)
    values = (bitplanes << np.arange(bits)[None, :, None]).sum(axis=1)
    return torch.from_numpy(values.astype(np.int32))


def pack_weight(q: QuantizedWeight) -> dict[str, torch.Tensor]:
    """qweight [in*bits/32, out], qzeros [groups, out*bits/32] (stored minus one: the "gptq" v1 format),
    scales [groups, out] fp16, g_idx [in] int32."""
    maxq = 2**q.bits - 1
    return {
        "qweight": pack_rows(q.codes.T, q.bits),
        "qzeros": pack_rows(((q.zeros.to(torch.int64) - 1) & maxq).T, q.bits).T.contiguous(),
        "scales": q.scales.to(torch.float16).contiguous(),
        "g_idx": q.g_idx.to(torch.int32).contiguous(),
    }


def unpack_weight(tensors: dict[str, torch.Tensor], bits: int, in_features: int, v1: bool = True) -> QuantizedWeight:
    """Read one layer's qweight/qzeros/scales/g_idx back into codes, scales and zeros."""
    maxq = 2**bits - 1
    scales = tensors["scales"].float()
    out_features = scales.shape[1]
    codes = unpack_rows(tensors["qweight"], bits, in_features).T
    zeros = unpack_rows(tensors["qzeros"].T.contiguous(), bits, out_features).T
    if v1:
        zeros = (zeros + 1) & maxq
    g_idx = tensors.get("g_idx")
    if g_idx is None:
        raise ValueError("the checkpoint layer has no g_idx")
    return QuantizedWeight(
        codes.to(torch.uint8).contiguous(), scales, zeros.to(torch.int32).contiguous(), g_idx.to(torch.int32), bits
    )


def quantization_config(qm: QuantizedModel) -> dict[str, Any]:
    """The `quantization_config` entry of config.json that transformers and GPTQModel read."""
    cfg = qm.config
    return {
        "quant_method": "gptq",
        "bits": cfg.bits,
        "group_size": cfg.group_size,
        "desc_act": cfg.act_order,
        "sym": cfg.sym,
        "lm_head": False,
        "format": "gptq",
        "checkpoint_format": "gptq",
        "pack_dtype": "int32",
        "damp_percent": cfg.damp,
        "true_sequential": True,
        "meta": {
            "quantizer": [f"labkit:{__version__}"],
            "method": qm.method,
            "calibration_tokens": qm.calibration_tokens,
        },
    }


def save_gptq(qm: QuantizedModel, tokenizer, dest: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """Write a GPTQ checkpoint into `dest` atomically: packed quantized layers, the rest in `dtype`."""
    if not qm.weights:
        raise ValueError("nothing quantized to save")
    modules = dict(qm.model.named_modules())
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in qm.model.state_dict().items():
        module_name, _, param = key.rpartition(".")
        if module_name in qm.weights and param == "weight":
            continue
        if value.data_ptr() in seen:  # a tied weight (SmolLM2's LM head is its embedding): saved once
            continue
        seen.add(value.data_ptr())
        tensors[key] = value.detach().to(dtype if value.is_floating_point() else value.dtype).cpu().contiguous()
    for name, q in qm.weights.items():
        if not isinstance(modules.get(name), nn.Linear):
            raise ValueError(f"{name} is not a linear layer of this model")
        tensors.update({f"{name}.{k}": v for k, v in pack_weight(q).items()})
    config = qm.model.config.to_dict()
    config["quantization_config"] = quantization_config(qm)
    config["dtype"] = str(dtype).removeprefix("torch.")
    with fileio.atomic_directory(dest, legacy=is_saved_model) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
        (tmp / "quantize_config.json").write_text(json.dumps(config["quantization_config"], indent=2))
        if getattr(qm.model, "generation_config", None) is not None:
            qm.model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(dest)


def read_quantization_config(path: str | Path) -> dict[str, Any]:
    """The checkpoint's quantization_config (config.json, else quantize_config.json), validated."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} holds no config.json: not a model directory")
    qc = json.loads(config_file.read_text()).get("quantization_config")
    if qc is None and (path / "quantize_config.json").is_file():
        qc = json.loads((path / "quantize_config.json").read_text())
    if not qc or qc.get("quant_method", "gptq") != "gptq":
        raise ValueError(f"{path} is not a GPTQ checkpoint (quantization_config: {qc!r})")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"unsupported GPTQ checkpoint format {fmt!r}: labkit reads 'gptq' and 'gptq_v2'")
    return qc


def load_gptq(path: str | Path, dtype: torch.dtype = torch.float32) -> QuantizedModel:
    """Load a GPTQ checkpoint (labkit's or GPTQModel's) into a plain model with dequantized weights."""
    # transformers is slow to import (~3 s) and only loading needs it, as in labkit.models
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    qc = read_quantization_config(path)
    cfg = QuantConfig(
        bits=int(qc["bits"]),
        group_size=int(qc.get("group_size", -1)),
        sym=bool(qc.get("sym", True)),
        act_order=bool(qc.get("desc_act", False)),
    )
    v1 = qc.get("checkpoint_format", qc.get("format", "gptq")) == "gptq"
    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no .safetensors weights")
    for f in files:
        tensors.update(load_file(f))
    modules = dict(model.named_modules())
    weights: dict[str, QuantizedWeight] = {}
    for key in [k for k in tensors if k.endswith(".qweight")]:
        name = key.removesuffix(".qweight")
        module = modules.get(name)
        if not isinstance(module, nn.Linear):
            raise ValueError(f"checkpoint layer {name} is not a linear layer of {type(model).__name__}")
        parts = {
            p: tensors.pop(f"{name}.{p}") for p in ("qweight", "qzeros", "scales", "g_idx") if f"{name}.{p}" in tensors
        }
        q = unpack_weight(parts, cfg.bits, module.in_features, v1=v1)
        module.weight.data = q.dequantize(dtype)
        weights[name] = q
    missing, unexpected = model.load_state_dict(
        {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}, strict=False
    )
    quantized = {f"{n}.weight" for n in weights}
    missing = [k for k in missing if k not in quantized and not _is_tied(model, k)]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    return QuantizedModel(model.eval(), cfg, "loaded", weights)


def _is_tied(model: nn.Module, key: str) -> bool:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return (
        getattr(model.config, "tie_word_embeddings", False)
        and head is not None
        and key == module_name(model, head) + ".weight"
    )
