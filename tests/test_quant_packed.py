"""labkit.quant.packed: PackedLinear and pack_model (QLoRA's base)."""

from __future__ import annotations

import pytest
import torch

from labkit.models import tiny_llama
from labkit.quant.formats import QuantConfig, quantize_rtn
from labkit.quant.gptq import gptq_quantize
from labkit.quant.model import quantize_model
from labkit.quant.packed import PackedLinear, pack_model
from tests.numerics import FLOAT64


@pytest.mark.parametrize(
    "bits,group_size,act_order", [(4, 32, False), (4, -1, False), (2, 16, False), (8, 32, False), (4, 32, True)]
)
def test_packed_linear_stores_bits_per_code_and_computes_with_the_dequantized_weight(bits, group_size, act_order):
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(48, 64, generator=g), torch.randn(5, 64, generator=g)
    cfg = QuantConfig(bits=bits, group_size=group_size, act_order=act_order)
    hessian = torch.cov(torch.randn(64, 256, generator=g)) + torch.eye(64)
    q = gptq_quantize(weight, hessian, cfg)
    layer = PackedLinear(q)
    assert layer.packed.dtype == torch.uint8 and layer.packed.numel() == weight.numel() * bits // 8
    assert torch.equal(layer.codes(), q.codes.to(torch.uint8))
    assert torch.equal(layer.weight, q.dequantize())
    x = x.double().requires_grad_(True)  # float64: the same products in any order agree to ~1e-15 (tests/numerics.py)
    out = layer(x)
    out.square().sum().backward()
    reference = x.detach().clone().requires_grad_(True)
    expected = reference @ q.dequantize(torch.float64).T
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected, **FLOAT64)
    torch.testing.assert_close(x.grad, reference.grad, **FLOAT64)


def test_packed_linear_keeps_no_full_weight_for_the_backward():
    """The memory point of QLoRA: the dequantized weight is rebuilt in the backward, not saved from the forward."""
    q = quantize_rtn(torch.randn(96, 64), QuantConfig(bits=4, group_size=32))
    layer, x = PackedLinear(q), torch.randn(3, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        x @ q.dequantize().T
        assert (96, 64) in saved or (64, 96) in saved  # a plain matmul keeps the weight alive
        saved.clear()
        layer(x).sum().backward()
    assert saved == []


@pytest.mark.parametrize("bits", [3])
def test_packed_linear_rejects_codes_that_do_not_fill_bytes(bits):
    q = quantize_rtn(torch.randn(8, 64), QuantConfig(bits=bits, group_size=32))
    with pytest.raises(ValueError, match="packs"):
        PackedLinear(q)


def test_pack_model_gives_the_same_logits_in_an_eighth_of_the_bytes():
    qm = quantize_model(tiny_llama(), QuantConfig(bits=4, group_size=32), method="rtn", progress=False)
    ids = torch.randint(2, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    qm.model.double()  # dense kernels against PackedLinear's matmul: compared in float64 (tests/numerics.py)
    with torch.no_grad():
        expected = qm.model(ids).logits
        model = pack_model(qm)
        logits = model(ids).logits
    assert logits.dtype == torch.float64
    torch.testing.assert_close(logits, expected, **FLOAT64)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == len(qm.weights) == 2 * 7
    codes = sum(m.packed.numel() for m in packed)
    assert codes * 2 == sum(q.codes.numel() for q in qm.weights.values())  # 4 bits: half a byte per weight
