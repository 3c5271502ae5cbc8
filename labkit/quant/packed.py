"""Quantized codes kept packed in memory and dequantized on the fly, in the forward and the backward:
a 4-bit base to train LoRA adapters on (QLoRA, lab 08) — GPTQ/RTN codes (PackedLinear) or NF4 (NF4Linear)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from labkit.quant.formats import QuantizedWeight
from labkit.quant.nf4 import NF4Model, NF4Weight
from labkit.quant.whole_model import QuantizedModel
from labkit.torchutil import module_name, replace_module

PACKABLE_BITS = (2, 4, 8)  # whole codes per byte; 3-bit codes are packed only in checkpoints


class _DequantizingLinear(nn.Module):
    """A frozen linear layer that stores its weight compressed and computes with `dequantize()`, on the fly."""

    in_features: int
    out_features: int
    bias: nn.Parameter | None

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (a fresh tensor: the layer stores only codes and scales)."""
        return self.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _DequantizedMatmul.apply(x, self)
        return y if self.bias is None else y + self.bias


class PackedLinear(_DequantizingLinear):
    """A frozen linear layer that keeps its codes packed in memory (two 4-bit codes per byte) and
    dequantizes them on the fly, in the forward and again in the backward, so the full-precision
    weight exists only one layer at a time: the memory saving QLoRA trains adapters on top of."""

    def __init__(
        self, q: QuantizedWeight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        if q.bits not in PACKABLE_BITS:
            raise ValueError(f"PackedLinear packs {PACKABLE_BITS}-bit codes, not {q.bits}-bit ones")
        out_features, in_features = q.codes.shape
        per_byte = 8 // q.bits
        if in_features % per_byte:
            raise ValueError(f"{in_features} inputs do not fill whole bytes of {per_byte} codes")
        self.in_features, self.out_features, self.bits, self.dtype = in_features, out_features, q.bits, dtype
        codes = q.codes.to(torch.uint8).reshape(out_features, in_features // per_byte, per_byte)
        shifts = torch.arange(per_byte, dtype=torch.uint8) * q.bits
        self.register_buffer("packed", (codes << shifts).sum(dim=-1, dtype=torch.uint8))
        self.register_buffer("scales", q.scales.to(torch.float16))
        self.register_buffer("zeros", q.zeros.to(torch.uint8))
        self.register_buffer("g_idx", q.g_idx.to(torch.int32))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        width = in_features // q.scales.shape[0]
        consecutive = torch.equal(q.g_idx.long(), torch.arange(in_features) // width)
        self.width = width if consecutive else 0

    def codes(self) -> torch.Tensor:
        """The integer codes [out, in], unpacked."""
        mask = 2**self.bits - 1
        parts = [(self.packed >> shift) & mask for shift in range(0, 8, self.bits)]
        return torch.stack(parts, dim=-1).reshape(self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in the compute dtype: scale * (code - zero), per group."""
        codes = self.codes().to(self.dtype)
        if self.width:  # groups of consecutive columns: broadcast per group instead of gathering per column
            zeros, scales = self.zeros.T[..., None].to(self.dtype), self.scales.T[..., None].to(self.dtype)
            grouped = codes.view(self.out_features, -1, self.width).sub_(zeros).mul_(scales)
            return grouped.view(self.out_features, self.in_features)
        g = self.g_idx.long()  # act-order: each column names its group
        return (codes - self.zeros[g].T.to(self.dtype)) * self.scales[g].T.to(self.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"


class NF4Linear(_DequantizingLinear):
    """A frozen linear layer that keeps NF4 codes (two per byte, bitsandbytes' layout) and its block scales, and
    dequantizes them on the fly in the forward and the backward: the base QLoRA trains adapters on. `dtype` is
    the compute dtype the weight is dequantized to (fp32 on a CPU, bf16 on a GPU that has it)."""

    def __init__(self, q: NF4Weight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if len(q.shape) != 2:
            raise ValueError(f"NF4Linear holds a 2-D weight [out, in], got shape {q.shape}")
        self.out_features, self.in_features = q.shape
        self.blocksize, self.offset, self.dtype = q.blocksize, q.offset, dtype
        self.register_buffer("packed", q.packed)
        self.register_buffer("absmax", q.absmax)
        self.register_buffer("absmax_scale", q.absmax_scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def nf4(self) -> NF4Weight:
        """The stored codes and scales as an NF4Weight."""
        shape = (self.out_features, self.in_features)
        return NF4Weight(self.packed, self.absmax, shape, self.blocksize, self.absmax_scale, self.offset)

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in the compute dtype."""
        return self.nf4().dequantize(self.dtype)

    def extra_repr(self) -> str:
        dq = ", double quantized" if self.absmax_scale is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4 blocks of {self.blocksize}{dq}"


class CastLinear(_DequantizingLinear):
    """A frozen linear layer whose weight is stored in a narrower float (bf16) and cast to the compute dtype on
    use, in the forward and the backward: a tied LM head shares its stored weight with the input embedding."""

    def __init__(self, stored: nn.Parameter, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.out_features, self.in_features = stored.shape
        self.stored, self.dtype = stored, dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in the compute dtype."""
        return self.stored.to(self.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, stored as {self.stored.dtype}"


class CastEmbedding(nn.Module):
    """A frozen embedding stored in a narrower float (bf16) whose looked-up rows come out in the compute dtype."""

    def __init__(self, embedding: nn.Embedding, storage: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(embedding.weight.detach().to(storage), requires_grad=False)
        self.padding_idx, self.dtype = embedding.padding_idx, embedding.weight.dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight, self.padding_idx).to(self.dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.weight.shape[0]}, {self.weight.shape[1]}, stored as {self.weight.dtype}, computes in {self.dtype}"
        )


def store_embeddings(model: nn.Module, storage: torch.dtype = torch.bfloat16) -> nn.Module:
    """Keep the frozen input embedding and LM head (one tensor when tied) in `storage`, cast to the compute dtype
    on use, in place: QLoRA's base holds what it does not quantize in 16 bits (on SmolLM2 the tied embedding is
    21 % of the parameters). Only the stored bytes change: the model computes as one whose embedding was
    rounded to `storage`."""
    if storage not in (torch.bfloat16, torch.float16):
        raise ValueError(f"storage must be torch.bfloat16 or torch.float16, got {storage}")
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(embedding, nn.Embedding) or not isinstance(head, nn.Linear):
        raise ValueError(
            f"expected an nn.Embedding and an nn.Linear LM head, got {type(embedding).__name__} and "
            f"{type(head).__name__} (stored already?)"
        )
    cast = CastEmbedding(embedding, storage)
    stored = cast.weight if head.weight is embedding.weight else nn.Parameter(head.weight.detach().to(storage), False)
    replace_module(model, module_name(model, embedding), cast)
    replace_module(model, module_name(model, head), CastLinear(stored, head.bias, head.weight.dtype))
    return model


class _DequantizedMatmul(torch.autograd.Function):
    """x @ Wᵀ that saves nothing for the backward but the layer, and dequantizes W again there."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: _DequantizingLinear) -> torch.Tensor:
        ctx.layer = layer
        return x @ layer.dequantize().to(x.dtype).T

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad @ ctx.layer.dequantize().to(grad.dtype), None


def pack_model(qm: QuantizedModel) -> nn.Module:
    """Swap each quantized linear of `qm.model` for a PackedLinear, in place: the same outputs, ~1/8 the bytes."""
    if not qm.weights:
        raise ValueError("nothing quantized to pack")
    if qm.config.bits not in PACKABLE_BITS:
        raise ValueError(f"PackedLinear packs {PACKABLE_BITS}-bit codes; this model has {qm.config.bits}-bit ones")
    return _swap(qm.model, qm.weights, lambda q, linear: PackedLinear(q, linear.bias, dtype=linear.weight.dtype))


def pack_model_nf4(result: NF4Model, dtype: torch.dtype | None = None) -> nn.Module:
    """Swap each NF4-quantized linear of `result.model` for an NF4Linear, in place: the same outputs, ~1/7.8 the
    bytes. `dtype` is the compute dtype (default: the replaced layer's)."""
    if not result.weights:
        raise ValueError("nothing quantized to pack")
    return _swap(
        result.model, result.weights, lambda q, linear: NF4Linear(q, linear.bias, dtype or linear.weight.dtype)
    )


def _swap(model: nn.Module, weights: dict, make: Callable[[Any, nn.Linear], nn.Module]) -> nn.Module:
    """Replace each named nn.Linear of `model` by make(its quantized weight, the linear), on its device, in place."""
    for name, q in weights.items():
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{name} is a {type(linear).__name__}, not the nn.Linear that was quantized")
        replace_module(model, name, make(q, linear).to(linear.weight.device))
    return model
