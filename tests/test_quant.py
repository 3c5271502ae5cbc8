"""labkit.quant: RTN and GPTQ on single layers and whole models, GPTQ packing, checkpoints, parity."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from labkit import quant
from labkit.models import tiny_llama
from labkit.quant import QuantConfig
from tests.numerics import FLOAT64, assert_within, reorder_bound
from tests.permissions import UMASK_CASES, modes, umask

FIXTURES = Path(__file__).parent / "fixtures"


def correlated_inputs(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Inputs with strongly correlated features, as real activations have (where GPTQ beats RTN)."""
    g = torch.Generator().manual_seed(seed)
    factors = torch.randn(n, dim // 4, generator=g) @ torch.randn(dim // 4, dim, generator=g)
    return factors + 0.1 * torch.randn(n, dim, generator=g)


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    return 2 * x.T @ x / x.shape[0]


# ----------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "kwargs",
    [{"bits": 5}, {"bits": 1}, {"group_size": 0}, {"group_size": -2}, {"damp": 1.0}, {"damp": -0.1}, {"block_size": 0}],
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        QuantConfig(**kwargs)


def test_group_size_must_divide_the_input_width():
    with pytest.raises(ValueError, match=r"does not divide in_features 576.*\[16, 32, 64\]"):
        QuantConfig(group_size=128).width(576)
    assert QuantConfig(group_size=64).width(576) == 64
    assert QuantConfig(group_size=-1).width(576) == 576


# ----------------------------------------------------------------------------- round to nearest


def test_rtn_on_a_hand_checked_row():
    w = torch.tensor([[-1.0, 0.0, 1.0, 2.0]])
    q = quant.quantize_rtn(w, QuantConfig(bits=2, group_size=-1, sym=False))
    assert q.scales.tolist() == [[1.0]] and q.zeros.tolist() == [[1]]
    assert q.codes.tolist() == [[0, 1, 2, 3]]
    assert torch.equal(q.dequantize(), w)


@pytest.mark.parametrize("bits", quant.BITS)
@pytest.mark.parametrize("group_size", [16, -1])
def test_rtn_error_is_at_most_half_a_step_on_an_asymmetric_grid(bits, group_size):
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(bits))
    q = quant.quantize_rtn(w, QuantConfig(bits=bits, group_size=group_size, sym=False))
    assert int(q.codes.max()) <= 2**bits - 1
    step = q.scales[q.g_idx.long()].T
    assert ((w - q.dequantize()).abs() <= step / 2 + 1e-6).all()
    assert q.scales.shape == (64 // (group_size if group_size > 0 else 64), 8)


def test_rtn_symmetric_zero_point_is_the_middle_code():
    q = quant.quantize_rtn(torch.randn(4, 32), QuantConfig(bits=4, group_size=16, sym=True))
    assert (q.zeros == 8).all()


def test_rtn_rejects_non_finite_weights():
    w = torch.randn(4, 32)
    w[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quant.quantize_rtn(w, QuantConfig(group_size=16))


# ----------------------------------------------------------------------------- GPTQ on one layer


@pytest.mark.parametrize("group_size", [16, -1])
def test_gptq_with_a_diagonal_hessian_is_round_to_nearest(group_size):
    """No correlation between inputs: no error to propagate, so GPTQ must reduce to RTN exactly."""
    w = torch.randn(16, 64)
    h = torch.diag(torch.rand(64) + 0.5)
    cfg = QuantConfig(bits=3, group_size=group_size, block_size=32)
    assert torch.equal(quant.gptq_quantize(w, h, cfg).codes, quant.quantize_rtn(w, cfg).codes)


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_correlated_inputs(bits, act_order):
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    x = correlated_inputs(512, 64)
    h = hessian_of(x)
    cfg = QuantConfig(bits=bits, group_size=16, act_order=act_order, block_size=32)
    gptq = quant.gptq_quantize(w, h, cfg).dequantize()
    rtn = quant.quantize_rtn(w, cfg).dequantize()
    out_err = lambda wq: ((x @ (w - wq).T) ** 2).sum() / ((x @ w.T) ** 2).sum()  # noqa: E731
    assert out_err(gptq) < 0.8 * out_err(rtn)
    assert quant.hessian_error(w, gptq, h) == pytest.approx(float(out_err(gptq)), rel=1e-3)


def test_gptq_act_order_groups_are_full_and_consistent():
    w = torch.randn(8, 64)
    h = hessian_of(correlated_inputs(256, 64))
    q = quant.gptq_quantize(w, h, QuantConfig(bits=4, group_size=16, act_order=True))
    assert sorted(torch.bincount(q.g_idx.long()).tolist()) == [16, 16, 16, 16]
    assert not torch.equal(q.g_idx, torch.arange(64, dtype=torch.int32) // 16)  # columns were reordered
    back = quant.unpack_weight(quant.pack_weight(q), 4, 64)
    assert torch.equal(back.dequantize(), q.dequantize())


def test_gptq_dead_inputs_get_zero_weights():
    w = torch.randn(8, 32)
    x = correlated_inputs(128, 32)
    x[:, 5] = 0
    q = quant.gptq_quantize(w, hessian_of(x), QuantConfig(bits=4, group_size=16))
    assert (q.dequantize()[:, 5] == 0).all()


def test_gptq_singular_hessian_without_damping_is_a_clear_error():
    x = correlated_inputs(8, 32)  # 8 tokens cannot span 32 dimensions
    with pytest.raises(ValueError, match="not positive definite"):
        quant.gptq_quantize(torch.randn(4, 32), hessian_of(x), QuantConfig(group_size=16, damp=0.0))


def test_gptq_rejects_a_hessian_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"hessian must be \[32, 32\]"):
        quant.gptq_quantize(torch.randn(4, 32), torch.eye(16), QuantConfig(group_size=16))


# ----------------------------------------------------------------------------- packing


def bitstream_reference(values: list[int], bits: int) -> list[int]:
    """Pack with Python integers: value k at bits [k*bits, (k+1)*bits), then cut into signed 32-bit words."""
    stream = sum(v << (bits * k) for k, v in enumerate(values))
    words = [(stream >> (32 * i)) & 0xFFFFFFFF for i in range(len(values) * bits // 32)]
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]


@pytest.mark.parametrize("bits", quant.BITS)
def test_pack_rows_matches_a_bitstream_and_round_trips(bits):
    g = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 2**bits, (64, 3), generator=g)
    packed = quant.pack_rows(values, bits)
    assert packed.dtype == torch.int32 and packed.shape == (64 * bits // 32, 3)
    for c in range(3):
        assert packed[:, c].tolist() == bitstream_reference(values[:, c].tolist(), bits)
    assert torch.equal(quant.unpack_rows(packed, bits, 64), values.to(torch.int32))


def test_four_bit_packing_is_the_classic_eight_nibbles_per_word():
    values = torch.arange(16).reshape(16, 1) % 16
    packed = quant.pack_rows(values, 4)
    assert packed[:, 0].tolist() == [0x76543210, 0xFEDCBA98 - (1 << 32)]


def test_pack_rejects_values_out_of_range():
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        quant.pack_rows(torch.full((8, 1), 16), 4)


@pytest.mark.parametrize("sym", [True, False])
def test_symmetric_zeros_are_stored_minus_one(sym):
    q = quant.quantize_rtn(torch.randn(32, 64), QuantConfig(bits=4, group_size=32, sym=sym))
    packed = quant.pack_weight(q)
    if sym:  # zero 8 stored as 7 in every nibble: the familiar 0x77777777 of "gptq" v1 checkpoints
        assert (packed["qzeros"] == 0x77777777).all()
    back = quant.unpack_weight(packed, 4, 64)
    assert torch.equal(back.zeros, q.zeros) and torch.equal(back.codes, q.codes)


# ----------------------------------------------------------------------------- packed in memory


@pytest.mark.parametrize(
    "bits,group_size,act_order", [(4, 32, False), (4, -1, False), (2, 16, False), (8, 32, False), (4, 32, True)]
)
def test_packed_linear_stores_bits_per_code_and_computes_with_the_dequantized_weight(bits, group_size, act_order):
    torch.manual_seed(0)
    weight, x = torch.randn(48, 64), torch.randn(5, 64)
    cfg = QuantConfig(bits=bits, group_size=group_size, act_order=act_order)
    hessian = torch.cov(torch.randn(64, 256)) + torch.eye(64)
    q = quant.gptq_quantize(weight, hessian, cfg)
    layer = quant.PackedLinear(q)
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
    q = quant.quantize_rtn(torch.randn(96, 64), QuantConfig(bits=4, group_size=32))
    layer, x = quant.PackedLinear(q), torch.randn(3, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        x @ q.dequantize().T
        assert (96, 64) in saved or (64, 96) in saved  # a plain matmul keeps the weight alive
        saved.clear()
        layer(x).sum().backward()
    assert saved == []


@pytest.mark.parametrize("bits", [3])
def test_packed_linear_rejects_codes_that_do_not_fill_bytes(bits):
    q = quant.quantize_rtn(torch.randn(8, 64), QuantConfig(bits=bits, group_size=32))
    with pytest.raises(ValueError, match="packs"):
        quant.PackedLinear(q)


def test_pack_model_gives_the_same_logits_in_an_eighth_of_the_bytes():
    qm = quant.quantize_model(tiny_llama(), QuantConfig(bits=4, group_size=32), method="rtn", progress=False)
    ids = torch.randint(2, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    qm.model.double()  # dense kernels against PackedLinear's matmul: compared in float64 (tests/numerics.py)
    with torch.no_grad():
        expected = qm.model(ids).logits
        model = quant.pack_model(qm)
        logits = model(ids).logits
    assert logits.dtype == torch.float64
    torch.testing.assert_close(logits, expected, **FLOAT64)
    packed = [m for m in model.modules() if isinstance(m, quant.PackedLinear)]
    assert len(packed) == len(qm.weights) == 2 * 7
    codes = sum(m.packed.numel() for m in packed)
    assert codes * 2 == sum(q.codes.numel() for q in qm.weights.values())  # 4 bits: half a byte per weight


# ----------------------------------------------------------------------------- whole models


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


@pytest.fixture(scope="module")
def calibration():
    return torch.randint(2, 512, (8, 64), generator=torch.Generator().manual_seed(0))


def test_sequential_groups_follow_the_data_flow(tiny, calibration):
    layers = quant.decoder_layers(tiny)
    inputs, kwargs = quant._first_block_inputs(tiny, layers, calibration[:2], batch_size=2)
    groups = quant._sequential_groups(layers[0], inputs[0], kwargs[0])
    assert groups == [
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        ["self_attn.o_proj"],
        ["mlp.gate_proj", "mlp.up_proj"],
        ["mlp.down_proj"],
    ]


def test_input_hessian_is_two_x_xt_over_n(tiny, calibration):
    layers = quant.decoder_layers(tiny)
    inputs, kwargs = quant._first_block_inputs(tiny, layers, calibration[:4], batch_size=2)
    seen = []
    down = layers[0].mlp.down_proj
    handle = down.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, m.in_features)))
    with torch.no_grad():
        for x, kw in zip(inputs, kwargs):
            layers[0](x, **kw)
    handle.remove()
    x = torch.cat(seen)
    h, n = quant._input_hessian(layers[0], down, inputs, kwargs)
    assert n == 4 * 64 and h.dtype == torch.float32
    x = x.double()  # H: a float64 sum (in another order than this one) rounded once to fp32
    expected = 2 * x.T @ x / n
    bound = torch.finfo(torch.float32).eps / 2 * expected.abs() + reorder_bound(
        n, 2 * x.abs().T @ x.abs() / n, torch.float64
    )
    assert_within(h.double(), expected, bound)


@pytest.mark.parametrize("method", quant.METHODS)
def test_quantize_model_leaves_the_source_alone_and_quantizes_every_block_linear(tiny, calibration, method):
    before = {k: v.clone() for k, v in tiny.state_dict().items()}
    cfg = QuantConfig(bits=3, group_size=32)
    qm = quant.quantize_model(tiny, cfg, calibration, method=method, progress=False)
    assert all(torch.equal(before[k], v) for k, v in tiny.state_dict().items())
    assert len(qm.weights) == len(qm.layers) == 2 * 7
    for name, q in qm.weights.items():
        weight = qm.model.get_submodule(name).weight
        assert torch.equal(weight, q.dequantize())
        assert len(torch.unique(weight[0, :32])) <= 2**3
    assert torch.equal(qm.model.model.embed_tokens.weight, tiny.model.embed_tokens.weight)
    if method == "gptq":
        assert qm.calibration_tokens == calibration.numel()
        assert sum(r.error for r in qm.layers) < sum(r.rtn_error for r in qm.layers)


def test_quantize_model_inplace_changes_the_model():
    model = tiny_llama()
    original = model.model.layers[0].mlp.up_proj.weight.clone()
    qm = quant.quantize_model(model, QuantConfig(bits=4, group_size=32), method="rtn", inplace=True, progress=False)
    assert qm.model is model and not torch.equal(model.model.layers[0].mlp.up_proj.weight, original)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inverse_hessian_factor_leaves_the_hessian_alone_and_keeps_its_dtype(dtype):
    x = correlated_inputs(256, 32).to(dtype)
    h = 2 * x.T @ x / 256
    before = h.clone()
    u = quant._inverse_hessian_factor(h, damp=0.01)
    assert torch.equal(h, before) and u.dtype == dtype
    damped = before.double() + 0.01 * before.double().diagonal().mean() * torch.eye(32, dtype=torch.float64)
    expected, uu = torch.linalg.inv(damped), u.double()  # U is the upper factor of the damped H⁻¹
    # U rounded to `dtype` moves each product U_ki·U_kj by up to ~2 roundoffs of it; plus float64's own error
    bound = 3 * torch.finfo(dtype).eps * (uu.abs().T @ uu.abs()) + FLOAT64["atol"] * expected.abs().max()
    assert_within(uu.T @ uu, expected, bound)


def test_gptq_warns_when_calibration_leaves_the_hessian_nearly_singular(tiny, calibration):
    widest = tiny.config.intermediate_size  # down_proj's inputs
    few = calibration[:, : 3 * widest // calibration.shape[0]]  # 3 tokens per input: full rank, badly conditioned
    assert widest <= few.numel() < quant.TOKENS_PER_INPUT * widest
    with pytest.warns(UserWarning, match="nearly singular"):
        quant.quantize_model(tiny, QuantConfig(group_size=32), few, progress=False)
    enough = calibration[:, : quant.TOKENS_PER_INPUT * widest // calibration.shape[0]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quant.quantize_model(tiny, QuantConfig(group_size=32), enough, progress=False)


def test_quantize_model_bad_input_is_caught_before_any_work(tiny, calibration):
    with pytest.raises(ValueError, match="too few"):
        quant.quantize_model(tiny, QuantConfig(group_size=32), calibration[:1, :16], progress=False)
    with pytest.raises(ValueError, match="does not divide"):
        quant.quantize_model(tiny, QuantConfig(group_size=48), calibration, progress=False)
    with pytest.raises(ValueError, match="long tensor"):
        quant.quantize_model(tiny, QuantConfig(group_size=32), calibration.float(), progress=False)
    with pytest.raises(ValueError, match="method"):
        quant.quantize_model(tiny, QuantConfig(group_size=32), calibration, method="awq")


class CharTokenizer:
    """One token per character (ids = code points), EOS = 0: enough for calibration_blocks."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_calibration_blocks_are_deterministic_non_overlapping_windows():
    texts = ["abcdefgh" * 5, "ijklmnop" * 5]  # 82 tokens with the two EOS
    blocks = quant.calibration_blocks(CharTokenizer(), texts, n_blocks=3, block_size=16, seed=1)
    assert blocks.shape == (3, 16) and blocks.dtype == torch.long
    assert torch.equal(blocks, quant.calibration_blocks(CharTokenizer(), texts, 3, 16, seed=1))
    stream = [t for text in texts for t in [ord(c) for c in text] + [0]]
    starts = [next(i for i in range(0, len(stream), 16) if stream[i : i + 16] == row.tolist()) for row in blocks]
    assert len(set(starts)) == 3
    with pytest.raises(ValueError, match="fewer than the 9"):
        quant.calibration_blocks(CharTokenizer(), texts, n_blocks=9, block_size=16)


def test_bits_per_weight_counts_scales_zeros_and_g_idx():
    assert quant.bits_per_weight(QuantConfig(bits=4, group_size=64), 576, 576) == pytest.approx(4 + 20 / 64 + 32 / 576)
    assert quant.bits_per_weight(QuantConfig(bits=3, group_size=-1), 576, 1536) == pytest.approx(
        3 + 19 / 576 + 32 / 1536
    )


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip_is_exact_in_fp32(tiny, calibration, tmp_path):
    qm = quant.quantize_model(tiny, QuantConfig(bits=4, group_size=32, act_order=True), calibration, progress=False)
    quant.save_gptq(qm, None, tmp_path / "q", dtype=torch.float32)
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
    back = quant.load_gptq(tmp_path / "q")
    ids = calibration[:2]
    with torch.no_grad():
        assert torch.equal(back.model(ids).logits, qm.model(ids).logits)


def test_failed_save_keeps_the_previous_checkpoint(tiny, tmp_path, monkeypatch):
    qm = quant.quantize_model(tiny, QuantConfig(bits=4, group_size=32), method="rtn", progress=False)
    quant.save_gptq(qm, None, tmp_path / "q")
    before = sorted(p.name for p in (tmp_path / "q").iterdir())
    monkeypatch.setattr(quant, "pack_weight", lambda q: (_ for _ in ()).throw(RuntimeError("disk full")))
    with pytest.raises(RuntimeError, match="disk full"):
        quant.save_gptq(qm, None, tmp_path / "q")
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["q"]


def test_load_gptq_rejects_non_gptq_directories(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "fp")
    with pytest.raises(ValueError, match="not a GPTQ checkpoint"):
        quant.load_gptq(tmp_path / "fp")
    with pytest.raises(FileNotFoundError, match="config.json"):
        quant.load_gptq(tmp_path / "nowhere")


def test_a_gptqmodel_checkpoint_loads_into_labkit():
    """The shipped fixture was quantized by GPTQModel 7.6 (tests/fixtures/make_gptqmodel_tiny.py);
    its reference logits come from GPTQModel's own CPU kernel, which computes in bfloat16."""
    qm = quant.load_gptq(FIXTURES / "gptqmodel_tiny")
    ref = load_file(FIXTURES / "gptqmodel_tiny_reference.safetensors")
    assert qm.config == QuantConfig(bits=4, group_size=32, sym=True)
    with torch.no_grad():
        logits = qm.model(ref["input_ids"]).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=0.02)
    source = tiny_llama()
    for name, q in qm.weights.items():  # GPTQ moves weights, but only about a grid step
        w = source.get_submodule(name).weight
        assert ((q.dequantize() - w).abs() <= 2 * q.scales[q.g_idx.long()].T).float().mean() > 0.99


@pytest.mark.slow
@pytest.mark.skipif(not quant.gptqmodel_available(), reason="GPTQModel and optimum are not installed")
@pytest.mark.parametrize("bits", [3, 4])
def test_a_labkit_checkpoint_loads_through_transformers(tiny, calibration, tmp_path, bits):
    qm = quant.quantize_model(tiny, QuantConfig(bits=bits, group_size=32), calibration, progress=False)
    quant.save_gptq(qm, None, tmp_path / "q")
    hf = quant.load_with_transformers(tmp_path / "q")
    module = hf.model.layers[1].mlp.down_proj
    assert type(module).__module__.startswith("gptqmodel")  # a packed kernel, not a dense nn.Linear
    # every decoder linear (7 per block) runs one CPU kernel: ATen's int4 matmul, or plain torch for 3 bits
    kernel = {4: "TorchAtenLinear (gptq_torch_aten)", 3: "TorchLinear (gptq_torch)"}[bits]
    assert quant.gptq_kernels(hf) == {kernel: 7 * hf.config.num_hidden_layers}
    theirs = quant.unpack_weight(
        {k: getattr(module, k) for k in ("qweight", "qzeros", "scales", "g_idx")}, bits, module.in_features, v1=False
    )  # GPTQModel converts to v2 on load
    ours = qm.weights["model.layers.1.mlp.down_proj"]
    assert torch.equal(theirs.codes, ours.codes) and torch.equal(theirs.zeros, ours.zeros)
    ids = calibration[:2]
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits.float(), qm.model(ids).logits, rtol=0, atol=0.03)


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.skipif(not quant.gptqmodel_available(), reason="GPTQModel and optimum are not installed")
def test_a_labkit_checkpoint_loads_in_gptqmodel_itself(tiny, calibration, tmp_path):
    from labkit.models import load_tokenizer

    qm = quant.quantize_model(tiny, QuantConfig(bits=4, group_size=32), calibration, progress=False)
    quant.save_gptq(qm, load_tokenizer(), tmp_path / "q")  # GPTQModel insists on a tokenizer
    with quant._quiet("GPTQModel.load"):
        from gptqmodel import GPTQModel

        loaded = GPTQModel.load(str(tmp_path / "q"), device="cpu")
    ids = calibration[:2]
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits.float(), qm.model(ids).logits, rtol=0, atol=0.03)


def test_input_hessian_of_a_whole_model_equals_the_block_level_one(tiny, calibration):
    layers = quant.decoder_layers(tiny)
    inputs, kwargs = quant._first_block_inputs(tiny, layers, calibration[:4], batch_size=2)
    expected, _ = quant._input_hessian(layers[0], layers[0].self_attn.q_proj, inputs, kwargs)
    h = quant.input_hessian(tiny, "model.layers.0.self_attn.q_proj", calibration[:4], batch_size=2)
    torch.testing.assert_close(h, expected)
    with pytest.raises(ValueError, match="not an nn.Linear"):
        quant.input_hessian(tiny, "model.layers.0.self_attn", calibration[:4])


def test_loading_through_transformers_without_gptqmodel_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(quant, "gptqmodel_available", lambda: False)
    with pytest.raises(ImportError, match=r"labkit\[gptq\]"):
        quant.load_with_transformers(tmp_path)


def test_library_failures_show_the_held_back_log():
    with pytest.raises(RuntimeError, match="(?s)demo failed.*banner line"):
        with quant._quiet("demo"):
            print("banner line")
            raise ValueError("boom")


@pytest.mark.parametrize("act_order", [False, True])
def test_layers_sharing_an_input_quantize_stacked_as_each_alone(act_order):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 512, generator=g)
    x[1] += x[0]
    h = 2 * x @ x.T / 512
    a, b = torch.randn(8, 64, generator=g), torch.randn(4, 64, generator=g)
    cfg = QuantConfig(bits=4, group_size=16, act_order=act_order)
    both = quant.gptq_quantize(torch.cat([a, b]), h, cfg)
    for w, part in ((a, both.rows(0, 8)), (b, both.rows(8, 12))):
        alone = quant.gptq_quantize(w, h, cfg)
        assert torch.equal(part.codes, alone.codes) and torch.equal(part.g_idx, alone.g_idx)
        assert torch.equal(part.zeros, alone.zeros)
        torch.testing.assert_close(part.scales, alone.scales)


@pytest.mark.parametrize("mask, file_mode, dir_mode", UMASK_CASES)
def test_gptq_checkpoints_get_the_modes_the_umask_gives(tiny, tmp_path, mask, file_mode, dir_mode):
    from transformers import PreTrainedTokenizerFast

    from labkit.tokenizer import train_bpe

    bpe = train_bpe(["hello world"] * 3, 270, progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe.to_hf(), eos_token="<|endoftext|>")
    qm = quant.quantize_model(tiny, QuantConfig(bits=4, group_size=32), method="rtn", progress=False)
    with umask(mask):
        dest = quant.save_gptq(qm, tokenizer, tmp_path / "q")
    found = modes(dest)
    assert {"model.safetensors", "config.json", "quantize_config.json", "tokenizer.json"} <= found.keys()
    assert found == dict.fromkeys(found, file_mode) | {".": dir_mode}
