"""The measurement harness: median timing with sync, per-region peak memory, decode speed, JSON lines."""

import json
import mmap

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


def test_time_interleaved_shows_a_bar_over_its_calls_when_asked(capsys):
    fns = {"a": lambda: None, "b": lambda: None, "c": lambda: None}
    bench.time_interleaved(fns, warmup=1, repeats=3)
    assert capsys.readouterr().err == ""
    bench.time_interleaved(fns, warmup=1, repeats=3, progress=True)
    assert "timing" in (bar := capsys.readouterr().err) and "0/12" in bar  # 3 functions x (1 warm-up + 3 rounds)


def test_time_fn_rejects_bad_counts():
    with pytest.raises(ValueError, match="repeats >= 1"):
        bench.time_fn(lambda: None, repeats=0)
    with pytest.raises(ValueError, match="warmup >= 0"):
        bench.time_fn(lambda: None, warmup=-1)


def _touch(mib: int) -> None:
    """Make `mib` MiB of new pages resident, then give them back. An anonymous mmap, not np.ones: malloc may
    serve a large array from memory the process freed earlier but still holds resident (after other tests in
    the same worker), and then the resident set does not grow at all — what made these tests fail now and then."""
    buf = mmap.mmap(-1, mib * 2**20)
    pages = np.frombuffer(buf, dtype=np.uint8)
    pages[:: mmap.PAGESIZE] = 1  # one write per page makes every page resident
    del pages
    buf.close()


def test_peak_memory_sees_an_allocation_inside_the_region():
    with bench.track_peak_memory("cpu") as mem:
        _touch(200)
    assert mem.kind in ("rss", "rss_since_process_start")
    if mem.kind == "rss":  # Linux: the counter is reset per region
        assert mem.delta_bytes >= 190 * 2**20
    assert mem.peak_bytes >= 200 * 2**20


def test_peak_memory_is_per_region_on_linux():
    with bench.track_peak_memory("cpu") as big:
        _touch(300)
    with bench.track_peak_memory("cpu") as small:
        pass
    if small.kind == "rss":
        assert small.delta_bytes < 50 * 2**20 < big.delta_bytes


def test_nested_regions_keep_the_outer_peak():
    """An inner region resets the shared counter; the outer one must still report what came before it."""
    with bench.track_peak_memory("cpu") as outer:
        _touch(300)  # 300 MiB, touched, then freed
        with bench.track_peak_memory("cpu") as inner:
            _touch(20)
        _touch(100)
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


def test_tokens_per_second():
    assert bench.tokens_per_second(1000, 0.5) == 2000
    with pytest.raises(ValueError):
        bench.tokens_per_second(1, 0)


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


def test_saved_for_backward_counts_each_saved_activation_once_without_the_weights():
    a = torch.randn(1000, requires_grad=True)
    with bench.saved_for_backward() as saved:
        b = a.exp()  # exp saves its result (its own derivative): 1000 fp32 numbers
        (b.sum() + b.exp().sum() + b.exp().sum()).backward()  # two more exps of b: two more results saved
    assert (saved.bytes, saved.tensors) == (3 * 4000, 3)  # sums save no tensor
    layer = torch.nn.Linear(10, 5)
    x = torch.randn(3, 10)
    with bench.saved_for_backward(exclude=layer) as saved:
        layer(x).sum().backward()  # linear saves its input (3 × 10 fp32) and its weight, a parameter
    assert saved.bytes == 3 * 10 * 4
