"""labkit.quant.packed: PackedLinear and pack_model (QLoRA's base)."""

from __future__ import annotations

import copy

import pytest
import torch

from labkit.models import tiny_llama
from labkit.quant.formats import QuantConfig, quantize_rtn
from labkit.quant.gptq import gptq_quantize
from labkit.quant.packed import CastEmbedding, CastLinear, PackedLinear, pack_model, store_embeddings
from labkit.quant.whole_model import quantize_model
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


def _rounded_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The reference: the same model with its embedding and LM head weights rounded to `dtype` and back."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for m in (ref.get_input_embeddings(), ref.get_output_embeddings()):
            m.weight.copy_(m.weight.to(dtype).float())
    return ref


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16])
def test_store_embeddings_computes_as_the_rounded_model_in_half_the_bytes(tied, storage):
    model = tiny_llama(tie_word_embeddings=tied)
    reference = _rounded_copy(model, storage)
    before = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    stored = store_embeddings(model, storage)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    hidden_ref = hidden.detach().clone().requires_grad_(True)
    with torch.no_grad():
        assert torch.equal(stored(ids).logits, reference(ids).logits)
    stored.get_output_embeddings()(hidden).square().sum().backward()  # the head's backward casts again
    reference.get_output_embeddings()(hidden_ref).square().sum().backward()
    torch.testing.assert_close(hidden.grad, hidden_ref.grad)
    embedding, head = stored.get_input_embeddings(), stored.get_output_embeddings()
    assert isinstance(embedding, CastEmbedding) and isinstance(head, CastLinear)
    assert (head.stored is embedding.weight) == tied
    assert not embedding.weight.requires_grad and not head.stored.requires_grad
    after = sum(p.numel() * p.element_size() for p in {id(p): p for p in stored.parameters()}.values())
    saved = 512 * 64 * 2 * (1 if tied else 2)  # 4 -> 2 bytes per number, one tensor when tied
    assert before - after == saved


def test_store_embeddings_refuses_other_dtypes_and_a_second_call():
    model = tiny_llama()
    with pytest.raises(ValueError, match="storage"):
        store_embeddings(model, torch.int8)
    store_embeddings(model)
    with pytest.raises(ValueError, match="stored already"):
        store_embeddings(model)
