"""The trainer: schedules, exact accumulation, precision policy, checkpoints, and resume after kill -9."""

import copy
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from labkit import precision, shards
from labkit.bench import read_results
from labkit.checkpoint import config_changes, latest_checkpoint, load_checkpoint, saved_config
from labkit.data import pad_batch
from labkit.models import tiny_gpt2, tiny_llama
from labkit.train import (
    TrainConfig,
    accumulate_gradients,
    as_batch,
    fit,
    loss_sum,
    lr_at,
    make_optimizer,
    step_seconds,
    train_step,
)
from tests.numerics import FLOAT64

CPU = torch.device("cpu")
FP32 = precision.policy("fp32", "cpu")


def test_schedules():
    cos = TrainConfig(steps=11, lr=1.0, min_lr=0.1, warmup_steps=2)
    assert [lr_at(s, cos) for s in (0, 1)] == [0.5, 1.0]
    assert lr_at(2, cos) == pytest.approx(1.0) and lr_at(10, cos) == pytest.approx(0.1)
    assert lr_at(6, cos) == pytest.approx(0.55)  # half-way: the mean of lr and min_lr
    lin = TrainConfig(steps=11, lr=1.0, min_lr=0.0, schedule="linear")
    assert [round(lr_at(s, lin), 6) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    const = TrainConfig(steps=5, lr=0.3, schedule="constant", warmup_steps=1)
    assert {lr_at(s, const) for s in range(5)} == {0.3}


@pytest.mark.parametrize(
    "name, make, match",
    [
        ("checkpoint_dir", lambda t: (t / "f").write_text("x") and t / "f", "checkpoint_dir: .* is not a directory"),
        ("checkpoint_dir", lambda t: (t / "f").write_text("x") and t / "f" / "ck", "cannot be created: .* is a file"),
        ("log_path", lambda t: t, "log_path: .* is not a file"),
        ("log_path", lambda t: (t / "f").write_text("x") and t / "f" / "log.jsonl", "cannot be created"),
    ],
)
def test_unusable_output_paths_fail_before_the_first_step(data, tmp_path, name, make, match):
    model = tiny_gpt2(vocab_size=128)
    before = [p.clone() for p in model.parameters()]
    cfg = TrainConfig(steps=2, progress=False, **{name: make(tmp_path)})
    with pytest.raises(ValueError, match=match):
        fit(model, shards.make_loader(data, 16, 4), cfg)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_resume_skips_a_corrupted_newest_and_a_stray_directory_and_cleans_leftovers(data, tmp_path):
    def run(steps, ck):
        cfg = TrainConfig(  # a constant LR: a run of 4 steps then resumed to 6 follows the run of 6
            steps=steps,
            schedule="constant",
            checkpoint_dir=str(ck),
            checkpoint_every=2,
            keep_checkpoints=3,
            progress=False,
        )
        return fit(tiny_gpt2(vocab_size=128, seed=0), shards.make_loader(data, 16, 4, seed=1), cfg)

    straight = {r["step"]: r["loss"] for r in run(6, tmp_path / "a")}
    ck = tmp_path / "b"
    run(4, ck)  # step_000002, step_000004
    weights = ck / "step_000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)  # same size, different bytes
    (ck / "step_000009").mkdir()  # a stray directory, no checkpoint in it
    leftover = ck / ".step_000006.x1y2.tmp"  # what a kill during a save leaves
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    with pytest.warns(UserWarning) as caught:
        resumed = run(6, ck)
    said = [str(w.message) for w in caught]
    assert any("step_000009" in m and "no labkit-manifest.json" in m and "step_000002" in m for m in said)
    assert any("step_000004" in m and "SHA-256" in m for m in said)
    assert [r["step"] for r in resumed] == [3, 4, 5, 6]  # from step 2, the newest that verifies
    assert {r["step"]: r["loss"] for r in resumed} == {s: straight[s] for s in (3, 4, 5, 6)}
    assert not leftover.exists()
    # keep_checkpoints=3 counts back from each save: 2, 4, 6 stay; the stray 9 is never counted or deleted
    assert sorted(p.name for p in ck.iterdir()) == ["step_000002", "step_000004", "step_000006", "step_000009"]


def test_resume_fails_clearly_when_no_checkpoint_verifies(data, tmp_path):
    (tmp_path / "step_000003").mkdir()
    cfg = TrainConfig(steps=4, checkpoint_dir=str(tmp_path), progress=False)
    with pytest.raises(ValueError, match=r"no checkpoint in .* verifies \(step_000003: .*no labkit-manifest"):
        fit(tiny_gpt2(vocab_size=128), shards.make_loader(data, 16, 4), cfg)


def _run_in(ck, data, model=None, **changes):
    """fit a tiny GPT-2 for 2 constant-LR steps into checkpoint directory `ck`, with `changes` to that config."""
    base = {"steps": 2, "lr": 1e-3, "schedule": "constant", "checkpoint_dir": str(ck), "progress": False}
    model = model if model is not None else tiny_gpt2(vocab_size=128)
    return fit(model, shards.make_loader(data, 16, 4), TrainConfig(**{**base, **changes}))


@pytest.mark.parametrize(
    "saved, now, named",
    [
        ({}, {"lr": 5e-3}, r"lr 0\.001 \(saved\) vs 0\.005 \(now\)"),
        ({}, {"betas": (0.9, 0.99)}, r"betas \[0\.9, 0\.95\] \(saved\) vs \[0\.9, 0\.99\] \(now\)"),
        ({"schedule": "cosine"}, {"schedule": "cosine", "steps": 4}, r"steps 2 \(saved\) vs 4 \(now\)"),
    ],
    ids=["lr", "betas", "steps-of-a-cosine-run"],
)
def test_resume_refuses_other_trajectory_settings_naming_them_and_changes_nothing(data, tmp_path, saved, now, named):
    ck = tmp_path / "ck"
    _run_in(ck, data, **saved)
    (ck / ".step_000009.x1.tmp").mkdir()  # a killed save's leftover: a refused run must not even clean up
    files = {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()}
    model = tiny_gpt2(vocab_size=128, seed=1)
    before = [p.detach().clone() for p in model.parameters()]
    refusal = rf"step_000002 was saved by a run with other settings: {named}\. .*TrainConfig\(resume=\"any-config\"\)"
    with pytest.raises(ValueError, match=refusal):
        _run_in(ck, data, model, **now)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()} == files and (ck / ".step_000009.x1.tmp").is_dir()


def test_resume_may_change_outputs_and_extend_a_constant_run_and_any_config_overrides(data, tmp_path):
    ck = tmp_path / "ck"
    _run_in(ck, data)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing to warn about: these do not change the trajectory
        resumed = _run_in(ck, data, steps=3, log_path=str(tmp_path / "log.jsonl"), keep_checkpoints=1, progress=True)
    assert [r["step"] for r in resumed] == [3]
    with pytest.warns(UserWarning, match=r"changed settings \(lr 0\.001 \(saved\) vs 0\.002 \(now\)\)"):
        more = _run_in(ck, data, steps=4, lr=2e-3, resume="any-config")
    assert [(r["step"], r["lr"]) for r in more] == [(4, 2e-3)]
    old = saved_config(latest_checkpoint(ck))
    del old["resume"]  # a checkpoint of the previous version: no `resume` saved, the rest the same
    assert config_changes(old, TrainConfig(steps=9, lr=2e-3, schedule="constant")) == []
    with pytest.raises(ValueError, match="resume must be one of"):
        TrainConfig(steps=1, resume="yes")


def _variable_length_batch():
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (5, 31, 9, 17, 3, 28, 12, 22)]
    return docs


def _grads(model, micro, normalize="tokens"):
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, micro, FP32, normalize=normalize)
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_loss_sum_keeps_float64_and_lifts_bf16_logits_to_fp32():
    batch = as_batch(pad_batch(_variable_length_batch()[:3], pad_id=1), CPU)
    model = tiny_llama().double()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), reduction="sum")
    loss = loss_sum(model, batch, FP32)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected, **FLOAT64)
    assert loss_sum(tiny_llama().to(torch.bfloat16), batch, FP32).dtype == torch.float32


def test_loss_sum_asks_a_transformers_model_for_no_kv_cache_and_others_for_nothing_more():
    batch = as_batch(pad_batch(_variable_length_batch()[:2], pad_id=1), CPU)
    seen = []
    model = tiny_llama()
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs.get("use_cache")), with_kwargs=True)
    loss_sum(model, batch, FP32)
    assert seen == [False]  # training never reads a cache; with checkpointing transformers would warn

    class Plain(torch.nn.Module):  # any model taking input_ids and attention_mask, with no transformers config
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(512, 8)

        def forward(self, input_ids, attention_mask=None):
            return type("Out", (), {"logits": self.embed(input_ids) @ self.embed.weight.T})()

    assert loss_sum(Plain(), batch, FP32).isfinite()


def test_accumulation_equals_one_big_batch_with_padding():
    model = tiny_llama().double()  # equal in exact arithmetic: compared in float64 (tests/numerics.py)
    docs = _variable_length_batch()
    big = [as_batch(pad_batch(docs, pad_id=1), CPU)]
    micro = [as_batch(pad_batch(docs[i : i + 2], pad_id=1), CPU) for i in range(0, 8, 2)]
    reference = _grads(model, big)
    assert reference.dtype == torch.float64
    torch.testing.assert_close(_grads(model, micro), reference, **FLOAT64)
    naive = _grads(model, micro, normalize="per_microbatch_mean")
    assert (naive - reference).abs().max() > 100 * (_grads(model, micro) - reference).abs().max()


def test_empty_window_and_bad_normalization_are_refused():
    model = tiny_llama()
    batch = as_batch(pad_batch([[5]], pad_id=1), CPU)  # one token: nothing to predict
    with pytest.raises(ValueError, match="no target tokens"):
        accumulate_gradients(model, [batch], FP32)
    with pytest.raises(ValueError, match="normalize"):
        accumulate_gradients(model, [batch], FP32, normalize="mean")


def test_weight_decay_only_on_matrices():
    model = tiny_llama()
    opt = make_optimizer(model, TrainConfig(steps=1, weight_decay=0.1))
    decay, no_decay = opt.param_groups
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


def test_train_step_reports_pre_clip_norm_and_refuses_nan():
    model = tiny_llama()
    batch = as_batch((torch.randint(0, 512, (2, 8)), torch.randint(0, 512, (2, 8))), CPU)
    opt = make_optimizer(model, TrainConfig(steps=1))
    model.zero_grad()
    accumulate_gradients(model, [batch], FP32)
    expected = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    model.zero_grad(set_to_none=True)
    metrics = train_step(model, opt, [batch], FP32, FP32.scaler(), grad_clip=1e-3)
    assert metrics["grad_norm"] == pytest.approx(expected, rel=1e-4) and metrics["grad_norm"] > 1e-3
    with torch.no_grad():
        model.model.embed_tokens.weight[0, 0] = float("nan")
    nan_batch = as_batch((torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)), CPU)
    with pytest.raises(FloatingPointError, match="non-finite loss"):
        train_step(model, opt, [nan_batch], FP32, FP32.scaler(), grad_clip=1.0)


@pytest.fixture
def data(tmp_path):
    stream = (torch.arange(3000) * 7 % 128).numpy()  # a learnable pattern: each token determines the next
    return shards.write_shards(stream, tmp_path / "data", 1000, vocab_size=128, tokenizer="t")


def test_fit_in_float64_matches_a_plain_float64_loop(data):
    """The trainer adds nothing to float64 arithmetic: the loss and the weights of a bare loop, to 1e-12."""
    cfg = TrainConfig(steps=4, lr=1e-2, schedule="constant", weight_decay=0.0, grad_clip=None, progress=False)
    model = tiny_llama(vocab_size=128).double()
    plain = copy.deepcopy(model)
    history = fit(model, shards.make_loader(data, block_size=16, batch_size=4, seed=1), cfg)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, betas=cfg.betas, weight_decay=0.0)
    losses = []
    for (x, y), _ in zip(shards.make_loader(data, block_size=16, batch_size=4, seed=1), range(cfg.steps)):
        logits = plain(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert logits.dtype == torch.float64
    assert max(abs(r["loss"] - want) for r, want in zip(history, losses)) < 1e-12
    assert max((a - b).abs().max().item() for a, b in zip(model.parameters(), plain.parameters())) < 1e-12


def test_fit_learns_and_logs_bf16_on_cpu(data, tmp_path):
    model = tiny_llama(vocab_size=128)
    loader = shards.make_loader(data, block_size=16, batch_size=4)
    log = tmp_path / "log.jsonl"
    history = fit(model, loader, TrainConfig(steps=30, lr=1e-2, precision="bf16", log_path=str(log), progress=False))
    assert history[-1]["loss"] < history[0]["loss"] - 1.0
    assert all(math.isfinite(h["loss"]) and h["tokens"] == 64 for h in history)
    assert [r["step"] for r in read_results(log)] == list(range(1, 31))


def test_memory_figure_is_the_peak_of_each_step(data):
    """memory_bytes is the step's peak (allocator on CUDA, resident set on CPU), not what is left after it."""
    import numpy as np

    from labkit.bench import _proc_status_kib

    model = tiny_llama(vocab_size=128)
    starts = []

    def spike(*_):  # a 200 MiB temporary inside every step's forward, freed before the step ends
        starts.append(_proc_status_kib("VmRSS") * 1024)
        np.ones(200 * 2**20 // 8).sum()

    model.model.layers[0].register_forward_hook(spike)
    history = fit(model, shards.make_loader(data, block_size=16, batch_size=2), TrainConfig(steps=3, progress=False))
    if _proc_status_kib("VmHWM") is None:
        pytest.skip("no /proc/self/status: the resident-set peak is not per region here")
    for record, start in zip(history, starts):
        assert record["memory_bytes"] >= start + 190 * 2**20


def test_checkpoint_round_trip_and_errors(data, tmp_path):
    model = tiny_gpt2(vocab_size=128)
    cfg = TrainConfig(
        steps=4, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2, keep_checkpoints=1, progress=False
    )
    fit(model, shards.make_loader(data, 16, 4), cfg)
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["step_000004"]  # older ones pruned
    path = latest_checkpoint(tmp_path / "ck")
    fresh = tiny_gpt2(vocab_size=128, seed=9)
    state = load_checkpoint(path, fresh)
    assert state["step"] == 4 and state["data"] == {"epoch": 0, "index": 4}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    with pytest.raises(ValueError, match=r"another model shape.*model \(256, 64\), checkpoint \(128, 64\)"):
        load_checkpoint(path, tiny_gpt2(vocab_size=256))
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match="unusable.*truncated"):
        load_checkpoint(path, fresh)
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", fresh)


SCRIPT = Path(__file__).parent / "scripts" / "train_tiny.py"


def _run(work, log, delay=0.0):
    cmd = [sys.executable, str(SCRIPT), str(work), str(log), "--delay", str(delay)]
    return subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})


@pytest.mark.slow
def test_resume_after_kill_9_continues_the_exact_trajectory(tmp_path):
    reference = tmp_path / "reference.jsonl"
    assert _run(tmp_path / "a", reference).wait(timeout=300) == 0
    expected = {r["step"]: r["loss"] for r in read_results(reference)}
    assert len(expected) == 24

    first = tmp_path / "killed.jsonl"
    proc = _run(tmp_path / "b", first, delay=0.05)
    deadline = time.time() + 240
    while time.time() < deadline and (not first.exists() or len(read_results(first)) < 14):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = len(read_results(first))
    assert 14 <= killed_at < 24, "the run must be killed mid-way"

    resumed = tmp_path / "resumed.jsonl"
    assert _run(tmp_path / "b", resumed).wait(timeout=300) == 0
    after = {r["step"]: r["loss"] for r in read_results(resumed)}
    assert min(after) == 4 * (killed_at // 4) + 1  # restarted right after the last checkpoint
    assert after == {s: expected[s] for s in after}  # bit-identical losses
    assert max(after) == 24


def test_data_stream_rolls_over_epochs_and_restores_position(data):
    from labkit.checkpoint import DataStream

    loader = shards.make_loader(data, 16, 64, seed=2)  # 186 blocks: 3 batches per epoch
    stream = DataStream(loader)
    first = [next(stream)[0] for _ in range(5)]
    assert stream.state() == {"epoch": 1, "index": 2}
    again = DataStream(loader, epoch=1, index=1)
    assert torch.equal(next(again)[0], first[4])
    with pytest.raises(ValueError, match="no batches"):
        next(DataStream([]))


@pytest.mark.parametrize("training", [False, True])
def test_fit_gives_back_the_mode_checkpointing_and_rng_it_found(data, training):
    model = tiny_llama(vocab_size=128).train(training)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    cfg = TrainConfig(steps=2, activation_checkpointing=True, progress=False)
    fit(model, shards.make_loader(data, 16, 4), cfg)
    assert model.training is training and all(m.training is training for m in model.modules())
    assert not model.is_activation_checkpointing
    assert torch.equal(torch.rand(3), expected)


def test_activation_checkpointing_gives_the_same_losses(data):
    def run(checkpointing):
        loader = shards.make_loader(data, 16, 4)
        cfg = TrainConfig(steps=3, activation_checkpointing=checkpointing, progress=False)
        return [h["loss"] for h in fit(tiny_llama(vocab_size=128), loader, cfg)]

    assert run(True) == pytest.approx(run(False), rel=1e-6)
    with pytest.raises(ValueError, match="transformers model"):
        fit(torch.nn.Linear(2, 2), [], TrainConfig(steps=1, activation_checkpointing=True, progress=False))


@pytest.mark.slow
def test_compiled_model_trains_like_eager(data):
    def run(compiled):
        cfg = TrainConfig(steps=2, compile=compiled, progress=False)
        return [h["loss"] for h in fit(tiny_llama(vocab_size=128), shards.make_loader(data, 16, 4), cfg)]

    assert run(True) == pytest.approx(run(False), rel=1e-4)


def test_loss_scaler_skips_an_overflowing_step_instead_of_failing():
    # the scaler's skip logic without autocast: an inf planted in the weights overflows whatever the scale
    scaled = precision.Policy(mode="fp16", device_type="cpu", autocast_dtype=None, use_scaler=True, tf32=False)
    model = tiny_llama()
    opt = make_optimizer(model, TrainConfig(steps=1))
    with torch.no_grad():
        model.model.embed_tokens.weight[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    batch = as_batch((torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)), CPU)
    scaler = scaled.scaler()
    metrics = train_step(model, opt, [batch], scaled, scaler, grad_clip=1.0)
    assert metrics["skipped"] and scaler.get_scale() < 2.0**16
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the step was skipped


def test_activation_checkpointing_recomputes_the_same_gradients():
    """What the lab's memory-for-time trade rests on: recomputing activations changes no gradient."""
    from labkit.torchutil import activation_checkpointing

    model = tiny_llama(vocab_size=128, num_layers=2).train()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    grads = []
    for on in (False, True):
        activation_checkpointing(model, on=on)
        model.zero_grad(set_to_none=True)
        accumulate_gradients(model, [as_batch((ids, ids), torch.device("cpu"))], precision.policy("fp32", "cpu"))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.equal(grads[0], grads[1])


def test_an_fp16_run_logs_loss_scales_that_follow_the_scaler_rule(data):
    """fp16 with dynamic loss scaling on a CPU: each step's logged scale is the previous one updated by the
    rule (precision.update_loss_scale, itself tested against torch's kernel) from whether that step overflowed."""
    cfg = TrainConfig(steps=12, lr=1e-2, precision="fp16", scale_growth_interval=2, progress=False)
    history = fit(tiny_llama(vocab_size=128), shards.make_loader(data, 16, 4), cfg)
    scales = [h["loss_scale"] for h in history]
    assert scales[0] == 2.0**16 and all(math.isfinite(h["loss"]) for h in history)
    good = 0
    for before, after, h in zip(scales, scales[1:], history):
        expected, good = precision.update_loss_scale(before, good, h["skipped"], 2.0, 0.5, 2)
        assert after == expected
    assert len(set(scales)) > 1  # the scale moved: it grew every two clean steps or backed off
    with pytest.raises(ValueError, match="scale_growth_interval"):
        TrainConfig(steps=1, scale_growth_interval=0)


def test_step_seconds_times_real_steps_in_a_mode():
    model = tiny_llama(vocab_size=128)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    before = [p.detach().clone() for p in model.parameters()]
    assert step_seconds(model, as_batch((ids, ids), CPU), "bf16", repeats=1) > 0
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # it trained
    with pytest.raises(ValueError, match="TF32 needs"):
        step_seconds(model, as_batch((ids, ids), CPU), "tf32")
