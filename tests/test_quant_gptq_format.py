"""labkit.quant.gptq_format: GPTQ packing and checkpoints, labkit's and GPTQModel's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from labkit.models import tiny_llama
from labkit.quant import gptq_format
from labkit.quant.formats import BITS, QuantConfig, quantize_rtn
from labkit.quant.gptq_format import load_gptq, pack_rows, pack_weight, save_gptq, unpack_rows, unpack_weight
from labkit.quant.whole_model import quantize_model
from tests.permissions import UMASK_CASES, modes, umask

FIXTURES = Path(__file__).parent / "fixtures"


def bitstream_reference(values: list[int], bits: int) -> list[int]:
    """Pack with Python integers: value k at bits [k*bits, (k+1)*bits), then cut into signed 32-bit words."""
    stream = sum(v << (bits * k) for k, v in enumerate(values))
    words = [(stream >> (32 * i)) & 0xFFFFFFFF for i in range(len(values) * bits // 32)]
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]


@pytest.mark.parametrize("bits", BITS)
def test_pack_rows_matches_a_bitstream_and_round_trips(bits):
    g = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 2**bits, (64, 3), generator=g)
    packed = pack_rows(values, bits)
    assert packed.dtype == torch.int32 and packed.shape == (64 * bits // 32, 3)
    for c in range(3):
        assert packed[:, c].tolist() == bitstream_reference(values[:, c].tolist(), bits)
    assert torch.equal(unpack_rows(packed, bits, 64), values.to(torch.int32))


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from(BITS), words=st.integers(1, 4), cols=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_any_codes_round_trip_through_packing(bits, words, cols, seed):
    rows = words * 32 // math.gcd(bits, 32)  # the fewest rows that fill whole words, times `words`
    values = torch.randint(0, 2**bits, (rows, cols), generator=torch.Generator().manual_seed(seed))
    packed = pack_rows(values, bits)
    assert packed[:, 0].tolist() == bitstream_reference(values[:, 0].tolist(), bits)
    assert torch.equal(unpack_rows(packed, bits, rows), values.to(torch.int32))


def test_four_bit_packing_is_the_classic_eight_nibbles_per_word():
    values = torch.arange(16).reshape(16, 1) % 16
    packed = pack_rows(values, 4)
    assert packed[:, 0].tolist() == [0x76543210, 0xFEDCBA98 - (1 << 32)]


def test_pack_rejects_values_out_of_range():
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_rows(torch.full((8, 1), 16), 4)


@pytest.mark.parametrize("sym", [True, False])
def test_symmetric_zeros_are_stored_minus_one(sym):
    q = quantize_rtn(torch.randn(32, 64), QuantConfig(bits=4, group_size=32, sym=sym))
    packed = pack_weight(q)
    if sym:  # zero 8 stored as 7 in every nibble: the familiar 0x77777777 of "gptq" v1 checkpoints
        assert (packed["qzeros"] == 0x77777777).all()
    back = unpack_weight(packed, 4, 64)
    assert torch.equal(back.zeros, q.zeros) and torch.equal(back.codes, q.codes)


def test_checkpoint_round_trip_is_exact_in_fp32(tiny, calibration, tmp_path):
    qm = quantize_model(tiny, QuantConfig(bits=4, group_size=32, act_order=True), calibration, progress=False)
    save_gptq(qm, None, tmp_path / "q", dtype=torch.float32)
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert config | {"meta": None} == config | {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "desc_act": True,
        "sym": True,
        "checkpoint_format": "gptq",
        "meta": None,
    }
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" not in tensors
    assert tensors["model.layers.0.self_attn.q_proj.qweight"].shape == (64 * 4 // 32, 64)
    back = load_gptq(tmp_path / "q")
    ids = calibration[:2]
    with torch.no_grad():
        assert torch.equal(back.model(ids).logits, qm.model(ids).logits)


def test_failed_save_keeps_the_previous_checkpoint(tiny, tmp_path, monkeypatch):
    qm = quantize_model(tiny, QuantConfig(bits=4, group_size=32), method="rtn", progress=False)
    save_gptq(qm, None, tmp_path / "q")
    before = sorted(p.name for p in (tmp_path / "q").iterdir())
    monkeypatch.setattr(gptq_format, "pack_weight", lambda q: (_ for _ in ()).throw(RuntimeError("disk full")))
    with pytest.raises(RuntimeError, match="disk full"):
        save_gptq(qm, None, tmp_path / "q")
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["q"]


def test_load_gptq_rejects_non_gptq_directories(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "fp")
    with pytest.raises(ValueError, match="not a GPTQ checkpoint"):
        load_gptq(tmp_path / "fp")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_gptq(tmp_path / "nowhere")


def test_a_gptqmodel_checkpoint_loads_into_labkit():
    """The shipped fixture was quantized by GPTQModel 7.6 (tests/fixtures/make_gptqmodel_tiny.py);
    its reference logits come from GPTQModel's own CPU kernel, which computes in bfloat16."""
    qm = load_gptq(FIXTURES / "gptqmodel_tiny")
    ref = load_file(FIXTURES / "gptqmodel_tiny_reference.safetensors")
    assert qm.config == QuantConfig(bits=4, group_size=32, sym=True)
    with torch.no_grad():
        logits = qm.model(ref["input_ids"]).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=0.02)
    source = tiny_llama()
    for name, q in qm.weights.items():  # GPTQ moves weights, but only about a grid step
        w = source.get_submodule(name).weight
        assert ((q.dequantize() - w).abs() <= 2 * q.scales[q.g_idx.long()].T).float().mean() > 0.99


@pytest.mark.parametrize("mask, file_mode, dir_mode", UMASK_CASES)
def test_gptq_checkpoints_get_the_modes_the_umask_gives(tiny, tmp_path, mask, file_mode, dir_mode):
    from transformers import PreTrainedTokenizerFast

    from labkit.bpe import train_bpe

    bpe = train_bpe(["hello world"] * 3, 270, progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe.to_hf(), eos_token="<|endoftext|>")
    qm = quantize_model(tiny, QuantConfig(bits=4, group_size=32), method="rtn", progress=False)
    with umask(mask):
        dest = save_gptq(qm, tokenizer, tmp_path / "q")
    found = modes(dest)
    assert {"model.safetensors", "config.json", "quantize_config.json", "tokenizer.json"} <= found.keys()
    assert found == dict.fromkeys(found, file_mode) | {".": dir_mode}
