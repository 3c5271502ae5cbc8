"""FLOPs per token equal torch's FlopCounterMode; data-sheet peaks by GPU name; matmul and copy sweeps."""

import pytest
import torch

from labkit import bench, flops

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_flop_formulas():
    assert flops.matmul_flops(2, 3, 4) == 48
    # 6N + 12·L·d·T for N=1e6, L=2, d=64, T=128
    assert flops.transformer_flops_per_token(10**6, 2, 64, 128) == 6e6 + 12 * 2 * 64 * 128
    assert flops.transformer_flops_per_token(10**6, 2, 64, 128, training=False) == pytest.approx(
        (6e6 + 12 * 2 * 64 * 128) / 3
    )


def _on_meta(make):
    """A full-size model with no memory behind it: FLOP counting needs shapes only."""
    with torch.device("meta"):
        model = make()
    model.set_attn_implementation("eager")  # attention as matmuls, which FlopCounterMode counts
    return model


def _gpt2(layers, width, heads, vocab):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=2048))


def _llama(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(  # SmolLM2-135M's shape
            num_hidden_layers=30,
            hidden_size=576,
            num_attention_heads=9,
            num_key_value_heads=3,
            intermediate_size=1536,
            vocab_size=49152,
            tie_word_embeddings=tied,
            max_position_embeddings=2048,
        )
    )


@pytest.mark.parametrize(
    "make, seq_len",
    [
        (lambda: _gpt2(12, 768, 12, 50257), 256),  # GPT-2 small, tied head
        (lambda: _gpt2(2, 64, 4, 512), 1024),  # attention-dominated
        (lambda: _llama(tied=True), 512),
        (lambda: _llama(tied=False), 512),
    ],
    ids=["gpt2-small", "gpt2-tiny-long", "llama-tied", "llama-untied"],
)
def test_model_flops_per_token_equals_torch_flop_counter(make, seq_len):
    from torch.utils.flop_counter import FlopCounterMode

    model = _on_meta(make)
    x = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(input_ids=x, labels=x).loss.backward()
    assert flops.model_flops_per_token(model, seq_len) == pytest.approx(counter.get_total_flops() / seq_len, rel=0.02)


def test_matmul_parameters_count_the_tied_lm_head():
    model = _on_meta(lambda: _gpt2(12, 768, 12, 50257))
    # per layer: qkv 768×2304, out 768×768, MLP 768×3072 and 3072×768; then the head 768×50257 (tied to wte)
    assert flops.matmul_parameters(model) == 12 * (768 * 2304 + 768**2 + 2 * 768 * 3072) + 768 * 50257
    # the numbers: 6N without the head gives 540 M FLOPs per token at T = 256, the model does 770 M
    assert flops.model_flops_per_token(model, 256) / 1e6 == pytest.approx(769.5, abs=0.1)


@pytest.mark.parametrize(
    "name, dtype, peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156e12),
        ("NVIDIA A10", "fp16", 125e12),
        ("NVIDIA GeForce RTX 4090", "bf16", None),
        ("Tesla T4", "bf16", None),
    ],
)
def test_device_peak_flops_matches_gpu_names(monkeypatch, name, dtype, peak):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert flops.device_peak_flops(dtype, "cuda") == peak


def test_no_peak_and_no_mfu_on_cpu():
    assert flops.device_peak_flops("fp32", "cpu") is None
    assert flops.mfu(1e12, None) is None
    assert flops.mfu(5e11, 1e12) == 0.5


def test_matmul_sweep_stops_a_dtype_whose_next_size_would_exceed_the_budget(monkeypatch):
    def fake(size, dtype, **kwargs):  # fp16 "emulated": 10x slower than fp32
        return {"size": size, "dtype": dtype, "median_s": size**3 * (1e-9 if dtype == "fp32" else 1e-8)}

    monkeypatch.setattr(flops, "matmul_throughput", fake)
    rows, skipped = flops.matmul_sweep([64, 256, 1024], ["fp32", "fp16"], budget_s=2.0)
    assert [(r["dtype"], r["size"]) for r in rows] == [
        ("fp32", 64),
        ("fp32", 256),
        ("fp32", 1024),
        ("fp16", 64),
        ("fp16", 256),
    ]
    assert len(skipped) == 1 and skipped[0].startswith("fp16 n >= 1024")
    assert flops.next_size_fits(0.1, 512, 1024, 1.0) and not flops.next_size_fits(0.2, 512, 1024, 1.0)


def test_matmul_throughput_on_cpu_and_its_errors():
    r = flops.matmul_throughput(32, "fp32", device="cpu", warmup=0, repeats=2)
    assert r["size"] == 32 and r["flops_per_s"] > 0 and r["peak_flops_per_s"] is None
    with pytest.raises(ValueError, match="unknown dtype"):
        flops.matmul_throughput(32, "int4", device="cpu")
    with pytest.raises(ValueError, match="positive"):
        flops.matmul_throughput(0, "fp32", device="cpu")


def test_cpu_fp32_ceiling_by_hand():
    assert flops.cpu_fp32_ceiling(2, {"avx2": True, "avx512f": False}) == 2 * 6.5e9 * 2 * 2 * 8  # 416 GFLOP/s
    assert flops.cpu_fp32_ceiling(1, {"avx2": True, "avx512f": True}) == 6.5e9 * 64
    assert flops.cpu_fp32_ceiling(4, {"avx2": False}) == 4 * 6.5e9 * 16  # SSE: 4 lanes
    assert flops.cpu_fp32_ceiling(8, {}) is None  # features unknown: no ceiling claimed
    with pytest.raises(ValueError, match="cores"):
        flops.cpu_fp32_ceiling(0, {"avx2": True})


def test_a_measured_cpu_matmul_stays_under_the_physical_ceiling():
    """A timing that drops work or reads the clock wrong lands above it; this machine's real sgemm does not."""
    import os

    from labkit import env

    ceiling = flops.cpu_fp32_ceiling(os.cpu_count(), env.cpu_features())
    if ceiling is None:
        pytest.skip("CPU features unknown here (not Linux on x86)")
    measured = flops.matmul_throughput(512, "fp32", device="cpu", warmup=1, repeats=3)["flops_per_s"]
    assert 0 < measured <= ceiling  # above the ceiling means a clock read too early; no speed is asserted


def test_gpu_only_checks_say_why_on_cpu():
    support = flops.dtype_support("cpu")
    assert support["fp32"] is None and "NVIDIA" in support["tf32"]
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        flops.copy_bandwidth(1, pinned=True, device="cpu")


@cuda
def test_copy_bandwidth_and_matmul_on_gpu():
    pinned = flops.copy_bandwidth(16, pinned=True, device="cuda", warmup=1, repeats=3)
    assert pinned["bytes_per_s"] > 0
    r = flops.matmul_throughput(1024, "bf16", device="cuda", warmup=1, repeats=3)
    assert r["fraction_of_peak"] is None or 0 < r["fraction_of_peak"] < 1.05


def test_step_memory_items_and_lm_head_share_by_hand():
    from labkit.models import tiny_llama

    model = tiny_llama()  # vocab 512, width 64, 2 layers, 4 heads of 16 (2 for k/v), MLP 128, tied head
    layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128  # q, o; k, v; gate, up, down
    params = 512 * 64 + 2 * (layer + 2 * 64) + 64  # embedding (= head), layers with their 2 norms, final norm
    items = flops.step_memory_items(model, batch_size=2, seq_len=8)
    assert items == {
        "weights": 4 * params,
        "gradients": 4 * params,
        "AdamW moments": 8 * params,
        "logits (one fp32 copy)": 4 * 2 * 8 * 512,
    }
    assert flops.lm_head_share(model) == pytest.approx(512 * 64 / (512 * 64 + 2 * layer))
    with pytest.raises(ValueError, match="batch_size >= 1"):
        flops.step_memory_items(model, 0, 8)


def test_memory_bandwidth_counts_a_read_and_a_write_per_byte(monkeypatch):
    timings = []

    def fake_time_fn(fn, **kwargs):  # the copy runs once, then takes 0.5 s by decree
        fn()
        timings.append(kwargs)
        return bench.time_fn(lambda: None, warmup=0, repeats=1, clock=iter([0.0, 0.5]).__next__)

    monkeypatch.setattr(flops, "time_fn", fake_time_fn)
    result = flops.memory_bandwidth(8, device="cpu", repeats=3)
    assert result["bytes_per_s"] == 2 * 8 * 2**20 / 0.5 and timings[0]["repeats"] == 3
    with pytest.raises(ValueError, match="megabytes must be"):
        flops.memory_bandwidth(0)
