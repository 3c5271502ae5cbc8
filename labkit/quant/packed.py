"""Quantized codes kept packed in memory and dequantized on the fly, in the forward and the backward:
a 4-bit base to train LoRA adapters on (QLoRA, lab 08)."""

from __future__ import annotations

import torch
from torch import nn

from labkit.quant.formats import QuantizedWeight
from labkit.quant.model import QuantizedModel

PACKABLE_BITS = (2, 4, 8)  # whole codes per byte; 3-bit codes are packed only in checkpoints


class PackedLinear(nn.Module):
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

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (a fresh tensor: the layer stores only the packed codes)."""
        return self.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _DequantizedMatmul.apply(x, self)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"


class _DequantizedMatmul(torch.autograd.Function):
    """x @ Wᵀ that saves nothing for the backward but the layer, and dequantizes W again there."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: PackedLinear) -> torch.Tensor:
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
    for name, q in qm.weights.items():
        parent_name, _, child = name.rpartition(".")
        parent = qm.model.get_submodule(parent_name)
        linear = getattr(parent, child)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{name} is a {type(linear).__name__}, not the nn.Linear that was quantized")
        packed = PackedLinear(q, linear.bias, dtype=linear.weight.dtype).to(linear.weight.device)
        setattr(parent, child, packed)
    return qm.model
