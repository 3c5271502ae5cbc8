"""The measurement harness: median timing with sync, per-region peak memory, FLOPs, JSON lines."""

import json

import numpy as np
import pytest
import torch

from labkit import bench


def test_time_fn_warms_up_then_reports_median_of_repeats():
    calls = []
    ticks = iter([0.0, 1.0, 1.0, 4.0, 4.0, 6.0])  # three timed calls: 1 s, 3 s, 2 s
    t = bench.time_fn(lambda: calls.append(1), warmup=2, repeats=3, clock=lambda: next(ticks))
    assert len(calls) == 5
    assert t.times == [1.0, 3.0, 2.0]
    assert (t.median, t.min, t.max, t.repeats, t.warmup) == (2.0, 1.0, 3.0, 3, 2)
    assert t.summary() == {"median_s": 2.0, "min_s": 1.0, "max_s": 3.0, "repeats": 3}


def test_time_fn_synchronizes_before_each_clock_read(monkeypatch):
    events = []
    monkeypatch.setattr(bench, "synchronize", lambda device=None: events.append("sync"))
    clock = lambda: events.append("clock") or 0.0  # noqa: E731
    bench.time_fn(lambda: events.append("fn"), warmup=0, repeats=2, clock=clock)
    assert events == ["sync", "clock", "fn", "sync", "clock"] * 2


def test_stopwatch_syncs_at_both_ends(monkeypatch):
    events = []
    monkeypatch.setattr(bench, "synchronize", lambda device=None: events.append("sync"))
    ticks = iter([10.0, 12.5])
    with bench.stopwatch(clock=lambda: events.append("clock") or next(ticks)) as elapsed:
        events.append("work")
    assert events == ["sync", "clock", "work", "sync", "clock"]
    assert elapsed.seconds == 2.5


def test_time_fn_runs_before_untimed_ahead_of_each_repeat(monkeypatch):
    events = []
    monkeypatch.setattr(bench, "synchronize", lambda device=None: events.append("sync"))
    clock = lambda: events.append("clock") or 0.0  # noqa: E731
    bench.time_fn(
        lambda: events.append("fn"), warmup=1, repeats=1, clock=clock, before=lambda: events.append("barrier")
    )
    assert events == ["fn", "barrier", "sync", "clock", "fn", "sync", "clock"]


def test_time_interleaved_alternates_the_functions_and_keeps_their_times_apart():
    calls = []
    ticks = iter([0.0, 1.0, 1.0, 3.0, 3.0, 4.0, 4.0, 7.0])  # a 1 s, b 2 s, a 1 s, b 3 s
    t = bench.time_interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, warmup=1, repeats=2, clock=lambda: next(ticks)
    )
    assert calls == ["a", "b", "a", "b", "a", "b"]  # warm-up of each, then alternating rounds
    assert (t["a"].times, t["b"].times, t["b"].median) == ([1.0, 1.0], [2.0, 3.0], 2.5)
    with pytest.raises(ValueError, match="repeats >= 1"):
        bench.time_interleaved({"a": lambda: None}, repeats=0)


def test_time_fn_rejects_bad_counts():
    with pytest.raises(ValueError, match="repeats >= 1"):
        bench.time_fn(lambda: None, repeats=0)
    with pytest.raises(ValueError, match="warmup >= 0"):
        bench.time_fn(lambda: None, warmup=-1)


def test_peak_memory_sees_an_allocation_inside_the_region():
    with bench.track_peak_memory("cpu") as mem:
        block = np.ones(200 * 2**20 // 8)  # 200 MiB, touched
        del block
    assert mem.kind in ("rss", "rss_since_process_start")
    if mem.kind == "rss":  # Linux: the counter is reset per region
        assert mem.delta_bytes >= 190 * 2**20
    assert mem.peak_bytes >= 200 * 2**20


def test_peak_memory_is_per_region_on_linux():
    with bench.track_peak_memory("cpu") as big:
        block = np.ones(300 * 2**20 // 8)
        del block
    with bench.track_peak_memory("cpu") as small:
        pass
    if small.kind == "rss":
        assert small.delta_bytes < 50 * 2**20 < big.delta_bytes


def test_nested_regions_keep_the_outer_peak():
    """An inner region resets the shared counter; the outer one must still report what came before it."""
    with bench.track_peak_memory("cpu") as outer:
        block = np.ones(300 * 2**20 // 8)  # 300 MiB, touched, then freed
        del block
        bench.release_memory()
        with bench.track_peak_memory("cpu") as inner:
            small = np.ones(20 * 2**20 // 8)
            del small
        after = np.ones(100 * 2**20 // 8)
        del after
    if outer.kind == "rss":
        assert inner.delta_bytes < 100 * 2**20
        assert outer.delta_bytes >= 290 * 2**20  # without nesting: ~100 MiB, the peak after the inner reset


def test_decode_benchmark_loads_measures_and_frees_the_model():
    import weakref

    from labkit.models import tiny_llama

    loaded = []

    def load():
        model = tiny_llama(
            vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64
        ).eval()
        loaded.append(weakref.ref(model))
        return model

    result = bench.decode_benchmark(load, torch.zeros(2, 5, dtype=torch.long), 7, device="cpu", repeats=2)
    assert result["new_tokens"] == 7 and result["timing"].repeats == 2
    assert result["tokens_per_s"] == pytest.approx(2 * 7 / result["timing"].median)
    assert len(loaded) == 1 and loaded[0]() is None  # loaded once, and not kept alive by the benchmark
    with pytest.raises(ValueError, match="new_tokens"):
        bench.decode_benchmark(load, torch.zeros(1, 5, dtype=torch.long), 0)


def test_flop_formulas():
    assert bench.matmul_flops(2, 3, 4) == 48
    # 6N + 12·L·d·T for N=1e6, L=2, d=64, T=128
    assert bench.transformer_flops_per_token(10**6, 2, 64, 128) == 6e6 + 12 * 2 * 64 * 128
    assert bench.transformer_flops_per_token(10**6, 2, 64, 128, training=False) == pytest.approx(
        (6e6 + 12 * 2 * 64 * 128) / 3
    )
    assert bench.tokens_per_second(1000, 0.5) == 2000
    with pytest.raises(ValueError):
        bench.tokens_per_second(1, 0)


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
    assert bench.model_flops_per_token(model, seq_len) == pytest.approx(counter.get_total_flops() / seq_len, rel=0.02)


def test_matmul_parameters_count_the_tied_lm_head():
    model = _on_meta(lambda: _gpt2(12, 768, 12, 50257))
    # per layer: qkv 768×2304, out 768×768, MLP 768×3072 and 3072×768; then the head 768×50257 (tied to wte)
    assert bench.matmul_parameters(model) == 12 * (768 * 2304 + 768**2 + 2 * 768 * 3072) + 768 * 50257
    # the numbers: 6N without the head gives 540 M FLOPs per token at T = 256, the model does 770 M
    assert bench.model_flops_per_token(model, 256) / 1e6 == pytest.approx(769.5, abs=0.1)


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
    assert bench.device_peak_flops(dtype, "cuda") == peak


def test_no_peak_and_no_mfu_on_cpu():
    assert bench.device_peak_flops("fp32", "cpu") is None
    assert bench.mfu(1e12, None) is None
    assert bench.mfu(5e11, 1e12) == 0.5


def test_matmul_sweep_stops_a_dtype_whose_next_size_would_exceed_the_budget(monkeypatch):
    def fake(size, dtype, **kwargs):  # fp16 "emulated": 10x slower than fp32
        return {"size": size, "dtype": dtype, "median_s": size**3 * (1e-9 if dtype == "fp32" else 1e-8)}

    monkeypatch.setattr(bench, "matmul_throughput", fake)
    rows, skipped = bench.matmul_sweep([64, 256, 1024], ["fp32", "fp16"], budget_s=2.0)
    assert [(r["dtype"], r["size"]) for r in rows] == [
        ("fp32", 64),
        ("fp32", 256),
        ("fp32", 1024),
        ("fp16", 64),
        ("fp16", 256),
    ]
    assert len(skipped) == 1 and skipped[0].startswith("fp16 n >= 1024")
    assert bench.next_size_fits(0.1, 512, 1024, 1.0) and not bench.next_size_fits(0.2, 512, 1024, 1.0)


def test_matmul_throughput_on_cpu_and_its_errors():
    r = bench.matmul_throughput(32, "fp32", device="cpu", warmup=0, repeats=2)
    assert r["size"] == 32 and r["flops_per_s"] > 0 and r["peak_flops_per_s"] is None
    with pytest.raises(ValueError, match="unknown dtype"):
        bench.matmul_throughput(32, "int4", device="cpu")
    with pytest.raises(ValueError, match="positive"):
        bench.matmul_throughput(0, "fp32", device="cpu")


def test_gpu_only_checks_say_why_on_cpu():
    support = bench.dtype_support("cpu")
    assert support["fp32"] is None and "NVIDIA" in support["tf32"]
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        bench.copy_bandwidth(1, pinned=True, device="cpu")


def test_log_and_read_results(tmp_path):
    path = tmp_path / "results" / "lab00.jsonl"
    bench.log_result(path, {"lab": "00", "tflops": 1.5})
    bench.log_result(path, {"lab": "00", "tflops": 2.5})
    with open(path, "a") as f:
        f.write('{"lab": "00", "tfl')  # a writer killed mid-line
    records = bench.read_results(path)
    assert [r["tflops"] for r in records] == [1.5, 2.5]
    assert {"device", "torch", "time"} <= set(records[0])
    path.write_text('{"a": 1}\nnot json\n{"a": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        bench.read_results(path)


def test_human_formats():
    assert bench.fmt_bytes(1536) == "1.5 KiB"
    assert bench.fmt_bytes(3 * 2**30) == "3.0 GiB"
    assert bench.fmt_seconds(2.5e-5) == "25.0 µs"
    assert bench.fmt_seconds(0.25) == "250.00 ms"
    assert json.dumps(bench.fmt_seconds(3)) == '"3.00 s"'


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_cuda_peak_memory_counts_an_allocation():
    with bench.track_peak_memory("cuda") as mem:
        x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        del x
    assert mem.kind == "cuda_allocated" and mem.delta_bytes >= 64 * 2**20


@cuda
def test_copy_bandwidth_and_matmul_on_gpu():
    pinned = bench.copy_bandwidth(16, pinned=True, device="cuda", warmup=1, repeats=3)
    assert pinned["bytes_per_s"] > 1e8
    r = bench.matmul_throughput(1024, "bf16", device="cuda", warmup=1, repeats=3)
    assert r["fraction_of_peak"] is None or 0 < r["fraction_of_peak"] < 1.05
