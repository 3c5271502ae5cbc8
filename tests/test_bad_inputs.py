"""Bad input at the public boundary: the right exception, a message that names the argument and what is
allowed, and nothing changed before it. One row per case; the modules' own tests hold the good paths."""

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from labcourse import figures, gpucheck, results
from labkit import (
    bench,
    calibration,
    cli,
    data,
    evaluate,
    flops,
    lora,
    models,
    monitor,
    precision,
    profiler,
    profiles,
    shards,
    tasks,
    torchutil,
    train,
)
from labkit import bpe as T
from labkit.parallel import fsdp, launch, memory, pipeline, ring, slurm, tensor, zero
from labkit.prune import calibrated, masks, structured
from labkit.quant import awq, formats, gptq, nf4
from labkit.quant import gptq_format as qcheckpoint
from labkit.quant import whole_model as qmodel

SCRIPT = Path(__file__).parents[1] / "labs" / "scripts" / "ddp_train.py"


@functools.cache
def _llama():
    return models.tiny_llama(vocab_size=64)


@functools.cache
def _bpe():
    return T.train_bpe(["hello world, hello there"], 270, progress=False)


def _loader(tmp: Path):
    paths = shards.write_shards(np.arange(400) % 64, tmp / "data", 200, vocab_size=64, tokenizer="t")
    return shards.make_loader(paths, 8, 2)


W = torch.randn(8, 16)
RULES = formats.QuantConfig(group_size=-1)
CAL = torch.randint(0, 64, (2, 8))  # calibration ids for _llama
EMPTY_CAL = torch.zeros(0, 8, dtype=torch.long)
DOWN = "model.layers.0.mlp.down_proj"
TMP = Path(tempfile.gettempdir())  # an existing folder, where a file is wanted
L48, L84 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)


def _fresh(**sizes):
    """A Llama of its own, for a call that the code before these checks changed in place."""
    return models.tiny_llama(vocab_size=64, **sizes)


@functools.cache
def _gpt2():
    return models.tiny_gpt2(vocab_size=64)  # its blocks hold Conv1D layers: no nn.Linear to prune or scale


def _nan_llama():
    model = _fresh()
    model.model.layers[1].mlp.down_proj.weight.data[0, 0] = float("nan")
    return model


def _unused_linear():
    model = _fresh()
    model.unused = torch.nn.Linear(64, 64)  # held, never called by the forward
    return model


@functools.cache
def _sampler():
    return monitor.Sampler(rapl=None)


def _trace():
    row = {"name": "aten::mm", "calls": 1.0, "self_s": 1.0, "total_s": 1.0}
    return profiler.Trace(Path("t.pt.trace.json"), 1, "cpu", [row], {})


def _enter(context) -> None:
    with context:
        pass


def _in_process_group(call):
    """Run `call` in a one-rank gloo process group, gone again afterwards (also after an error)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return call()
    finally:
        dist.destroy_process_group()


# (id, call, exception, what the message must say: the argument and the allowed values)
CASES = [
    # tokenizer
    ("train_bpe-one-string", lambda: T.train_bpe("one string", 300), TypeError, "texts must be an iterable.*pass \\[text\\]"),
    ("train_bpe-vocab-text", lambda: T.train_bpe(["a b"], "big"), TypeError, "vocab_size must be an int, got 'big'"),
    ("train_bpe-vocab-small", lambda: T.train_bpe(["a b"], 100), ValueError, "vocab_size 100 is too small.*257"),
    ("train_bpe-empty", lambda: T.train_bpe([""], 300), ValueError, "empty corpus"),
    ("decode-negative", lambda: _bpe().decode([-1]), ValueError, "token id -1 is not in the vocabulary.*\\[0, 270\\)"),
    ("decode-too-big", lambda: _bpe().decode([270]), ValueError, "token id 270 is not in the vocabulary"),
    ("decode-float", lambda: _bpe().decode([1.0]), ValueError, "token id 1.0 is not in the vocabulary.*ints"),
    ("encode-bytes", lambda: _bpe().encode(b"x"), TypeError, "expected str, got bytes"),
    ("encode-surrogate", lambda: _bpe().encode("a\ud800"), ValueError, "unpaired surrogate"),
    # data
    ("load_corpus-split", lambda: data.load_corpus("wiki", "dev"), ValueError, "unknown split 'dev'.*'train'"),
    ("load_corpus-missing", lambda: data.load_corpus("/no/such.txt"), FileNotFoundError, "'wiki'.*\\.txt/\\.jsonl"),
    ("pack_blocks-zero", lambda: data.pack_blocks(np.arange(10), 0), ValueError, "block_size must be positive"),
    ("pack_blocks-short", lambda: data.pack_blocks(np.arange(3), 8), ValueError, "3 tokens, fewer than one block of 8"),
    ("pad_batch-empty", lambda: data.pad_batch([], 0), ValueError, "at least one document"),
    ("pad_batch-max-length", lambda: data.pad_batch([[1]], 0, max_length=0), ValueError, "max_length must be None or an int >= 1"),
    ("concat-eos-text", lambda: data.concat_with_separator([[1]], "x"), TypeError, "eos_id must be a token id"),
    # shards
    ("make_loader-block", lambda: shards.make_loader([], 0, 4), ValueError, "block_size must be positive, got 0"),
    ("make_loader-batch", lambda: shards.make_loader([], 16, 0), ValueError, "batch_size >= 1.*got 0"),
    ("write_shard-vocab", lambda: shards.write_shard("/tmp/x.bin", np.arange(5), 0, "t"), ValueError, "vocab_size must be in \\(0, 2\\*\\*32\\]"),
    ("write_shard-ids", lambda: shards.write_shard("/tmp/x.bin", np.arange(5), 3, "t"), ValueError, "token ids must lie in \\[0, 3\\)"),
    # evaluate
    ("windows-stride", lambda: evaluate.windows(10, 8, 0), ValueError, "0 < stride <= max_length.*stride=0"),
    ("windows-max-length", lambda: evaluate.windows(10, 1, 1), ValueError, "max_length >= 2"),
    ("windows-text", lambda: evaluate.windows("10", 8, 4), TypeError, "n_tokens must be an int, got '10'"),
    ("generate-tokens", lambda: evaluate.generate(_llama(), _bpe(), "hi", max_new_tokens=0), ValueError, "max_new_tokens must be positive"),
    ("generate-temperature", lambda: evaluate.generate(_llama(), _bpe(), "hi", temperature=-1), ValueError, "temperature >= 0"),
    # precision
    ("policy-mode", lambda: precision.policy("fp8", "cpu"), ValueError, "unknown precision 'fp8'.*'fp32'"),
    ("policy-device", lambda: precision.policy("fp32", "gpu9"), ValueError, "device must be a torch device.*'gpu9'"),
    ("kept_fraction-scale", lambda: precision.kept_fraction(W, torch.float16, 0), ValueError, "scale must be a positive number"),
    ("kept_fraction-dtype", lambda: precision.kept_fraction(W, "float16"), TypeError, "dtype must be a torch floating-point dtype"),
    ("loss-scale-factors", lambda: precision.update_loss_scale(1.0, 0, False, 0.5), ValueError, "growth_factor > 1"),
    ("loss-scale-interval", lambda: precision.update_loss_scale(1.0, 0, False, 2.0, 0.5, 0), ValueError, "growth_interval must be an int >= 1"),
    ("format_facts-int", lambda: precision.format_facts(torch.int8), ValueError, "dtype must be one of torch.float32"),
    # bench, flops, profiles
    ("as_device", lambda: bench.as_device("gpu0"), ValueError, "device must be a torch device.*'gpu0'"),
    ("time_fn-repeats", lambda: bench.time_fn(lambda: None, repeats=0), ValueError, "repeats >= 1.*repeats=0"),
    ("time_fn-callable", lambda: bench.time_fn(3), TypeError, "fn must be callable"),
    ("tokens_per_second", lambda: bench.tokens_per_second(10, 0), ValueError, "seconds must be positive"),
    ("matmul_flops", lambda: flops.matmul_flops(-1, 2, 3), ValueError, "matrix sizes must be >= 0.*m=-1"),
    ("peak_flops-dtype", lambda: flops.device_peak_flops("fp7"), ValueError, "dtype must be one of \\('fp32'"),
    ("mfu-negative", lambda: flops.mfu(-1, 10), ValueError, "FLOP rates must be >= 0"),
    ("model_flops-seq", lambda: flops.model_flops_per_token(_llama(), 0), ValueError, "seq_len >= 1"),
    ("get_profile", lambda: profiles.get_profile("turbo"), ValueError, "unknown profile 'turbo'.*smoke, cpu, gpu"),
    # tasks
    ("title_examples-split", lambda: tasks.title_examples("dev"), ValueError, "unknown split 'dev'"),
    ("title_examples-limit", lambda: tasks.title_examples(limit=-1), ValueError, "limit must be None or an int >= 0"),
    # models
    ("tiny_llama-kv", lambda: models.tiny_llama(num_kv_heads=3), ValueError, "num_heads \\(4\\) must be a multiple of num_kv_heads"),
    ("tiny_gpt2-width", lambda: models.tiny_gpt2(hidden_size=30), ValueError, "hidden_size \\(30\\) must be a multiple"),
    ("load_model-name", lambda: models.load_model("no/such/model/here"), ValueError, "unknown model.*offline name"),
    ("count_parameters", lambda: models.count_parameters("m"), TypeError, "model must be a torch.nn.Module"),
    # train
    ("TrainConfig-steps", lambda: train.TrainConfig(steps=0), ValueError, "steps must be >= 1"),
    ("TrainConfig-steps-text", lambda: train.TrainConfig(steps="3"), TypeError, "steps must be an int, got '3'"),
    ("TrainConfig-schedule", lambda: train.TrainConfig(steps=3, schedule="step"), ValueError, "unknown schedule 'step'.*'cosine'"),
    ("TrainConfig-precision", lambda: train.TrainConfig(steps=3, precision="fp8"), ValueError, "unknown precision 'fp8'"),
    ("TrainConfig-lr", lambda: train.TrainConfig(steps=3, lr=float("nan")), TypeError, "lr must be a finite number"),
    ("lr_at-step", lambda: train.lr_at(-1, train.TrainConfig(steps=3)), ValueError, "step must be in \\[0, 3\\)"),
    ("as_batch", lambda: train.as_batch(3, "cpu"), TypeError, "\\(input, target\\) pair or a dict"),
    ("normalize", lambda: train.accumulate_gradients(_llama(), [{}], None, normalize="mean"), ValueError, "normalize must be one of \\('tokens'"),
    # quant
    ("QuantConfig-bits", lambda: formats.QuantConfig(bits=5), ValueError, "bits must be one of \\(2, 3, 4, 8\\), got 5"),
    ("QuantConfig-bits-float", lambda: formats.QuantConfig(bits=4.0), ValueError, "bits must be one of .* got 4.0"),
    ("QuantConfig-group", lambda: formats.QuantConfig(group_size=0), ValueError, "group_size must be a positive int or -1"),
    ("QuantConfig-damp", lambda: formats.QuantConfig(damp=1.0), ValueError, "damp must be in \\[0, 1\\)"),
    ("QuantConfig-sym", lambda: formats.QuantConfig(sym="yes"), ValueError, "sym must be True or False"),
    ("QuantConfig-width", lambda: formats.QuantConfig(group_size=64).width(100), ValueError, "group_size 64 does not divide in_features 100"),
    ("quantize_rtn-1d", lambda: formats.quantize_rtn(torch.randn(8), RULES), ValueError, "expected a 2-D weight"),
    ("quantize_rtn-nan", lambda: formats.quantize_rtn(torch.full((4, 8), float("nan")), RULES), ValueError, "NaN or inf"),
    ("pack_rows-range", lambda: qcheckpoint.pack_rows(torch.full((8, 4), 16, dtype=torch.int32), 4), ValueError, "values must lie in \\[0, 15\\]"),
    ("gptq-hessian", lambda: gptq.gptq_quantize(W, torch.eye(8), RULES), ValueError, "hessian must be \\[16, 16\\], got \\(8, 8\\)"),
    ("calibration_blocks", lambda: calibration.calibration_blocks(_bpe(), ["hello"], 0, 8), ValueError, "n_blocks >= 1"),
    ("quantize_model-method", lambda: qmodel.quantize_model(_llama(), RULES, method="awq"), ValueError, "method must be one of \\('rtn', 'gptq'\\)"),
    ("quantize_model-ids", lambda: qmodel.quantize_model(_llama(), RULES, torch.full((1, 8), 999)), ValueError, "calibration ids hold token id 999.*\\[0, 64\\)"),
    # prune
    ("magnitude-sparsity", lambda: masks.magnitude_prune(_llama(), 1.0), ValueError, "sparsity must be in \\[0, 1\\)"),
    ("magnitude-scope", lambda: masks.magnitude_prune(_llama(), 0.5, scope="block"), ValueError, "scope must be one of \\('layer', 'global'\\)"),
    ("nm-n-m", lambda: masks.nm_masks({"w": W}, n=5, m=4), ValueError, "need 0 < n <= m, got n=5, m=4"),
    ("nm-width", lambda: masks.nm_masks({"w": torch.randn(4, 6)}), ValueError, "4 must divide the input width"),
    ("mlp-importance", lambda: structured.prune_mlp_channels(_llama(), 0.5, importance="random"), ValueError, "importance must be one of"),
    # lora
    ("add_lora-rank", lambda: lora.add_lora(models.tiny_llama(), r=0), ValueError, "rank r must be a positive int, got 0"),
    ("add_lora-alpha", lambda: lora.add_lora(models.tiny_llama(), alpha=0), ValueError, "alpha must be a positive number"),
    ("add_lora-dropout", lambda: lora.add_lora(models.tiny_llama(), dropout=1.0), ValueError, "dropout must be in \\[0, 1\\)"),
    ("add_lora-targets", lambda: lora.add_lora(models.tiny_llama(), ["qq_proj"]), ValueError, "no linear layer named.*available"),
    ("energy_rank", lambda: lora.energy_rank(torch.ones(3), 0), ValueError, "share must be in \\(0, 1\\]"),
    # parallel
    ("launch-nproc", lambda: launch.launch(SCRIPT, nproc=0), ValueError, "nproc must be an int >= 1, got 0"),
    ("launch-timeout", lambda: launch.launch(SCRIPT, nproc=1, timeout=0), ValueError, "timeout must be a positive"),
    ("launch-script", lambda: launch.launch("no_such.py", nproc=1), FileNotFoundError, "no such script: no_such.py"),
    ("placement-prefer", lambda: launch.placement(2, 0, prefer="tpu"), ValueError, "prefer .* must be 'cpu' or 'cuda'"),
    ("slurm-nodes", lambda: slurm.slurm_script(SCRIPT, nodes=0), ValueError, "nodes >= 1"),
    ("slurm-nodes-text", lambda: slurm.slurm_script(SCRIPT, nodes="2"), TypeError, "nodes must be an int, got '2'"),
    ("ring-rank", lambda: ring.ring_send_chunk(3, 2, 0), ValueError, "0 <= rank < world, got rank=3, world=2"),
    ("ring-tensors", lambda: ring.simulate_ring_all_reduce([torch.zeros(3), torch.zeros(4)]), ValueError, "all of the same shape"),
    ("megatron-rank", lambda: tensor.megatron_mlp_shard(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4), 2, 2), ValueError, "0 <= rank < world"),
    ("pipeline-schedule", lambda: pipeline.schedule_order("zb", 0, 2, 4), ValueError, "schedule must be one of \\('gpipe', '1f1b'\\)"),
    ("pipeline-layers", lambda: pipeline.layer_ranges(2, 4), ValueError, "cannot split 2 layers into 4 stages"),
    # ---- modules added since the last round (issue 39)
    # torchutil
    ("seeded-seed", lambda: _enter(torchutil.seeded("1")), TypeError, "seed must be an int, got '1'"),
    ("environ-value", lambda: _enter(torchutil.environ(LABKIT_TEST=1)), TypeError, "environment variables take str values"),
    ("quiet-ignore-str", lambda: _enter(torchutil.quiet("x", ignore_warnings="noise")), TypeError, "ignore_warnings must be a tuple of message regexes"),
    ("eval_mode-module", lambda: _enter(torchutil.eval_mode("m")), TypeError, "model must be a torch.nn.Module, got str"),
    ("checkpointing-on", lambda: torchutil.activation_checkpointing(_fresh(), on="yes"), TypeError, "on must be True or False, got 'yes'"),
    # data
    ("split_of-int", lambda: data.split_of(3), TypeError, "title must be a str, got 3"),
    ("load_corpus-none", lambda: data.load_corpus(None), TypeError, "name must be 'wiki' or a path to a .txt/.jsonl file, got None"),
    ("encode_texts-str", lambda: data.encode_texts(_bpe(), "hello"), TypeError, "texts must be an iterable of texts, got one str"),
    ("pack_blocks-text", lambda: data.pack_blocks(np.arange(10), "4"), TypeError, "block_size must be an int, got '4'"),
    ("pack_blocks-bool", lambda: data.pack_blocks(np.arange(10), True), TypeError, "block_size must be an int, got True"),
    ("pad_batch-pad-text", lambda: data.pad_batch([[1]], "x"), TypeError, "pad_id must be a token id"),
    ("pad_batch-max-length-bool", lambda: data.pad_batch([[1]], 0, max_length=True), ValueError, "max_length must be None or an int >= 1, got True"),
    # parallel.memory
    ("state_bytes-policy", lambda: memory.state_bytes(10, "ddp", 2, "fp32"), TypeError, "policy must be a DtypePolicy"),
    ("state_bytes-offload", lambda: memory.state_bytes(10, "zero3", 2, offload="yes"), TypeError, "offload must be True or False"),
    ("gathered_bytes-policy", lambda: memory.gathered_bytes(10, None), TypeError, "policy must be a DtypePolicy"),
    ("activation_bytes-flag", lambda: memory.activation_bytes(1, 1, 1, checkpointing="no"), TypeError, "checkpointing must be True or False"),
    ("largest_model-policy", lambda: memory.largest_model(10**9, "ddp", 2, {"param": 2}), TypeError, "policy must be a DtypePolicy"),
    ("moment_bytes-model", lambda: memory.moment_bytes(_llama()), TypeError, "optimizer must be a torch.optim.Optimizer, got LlamaForCausalLM"),
    ("held_bytes-model", lambda: memory.held_bytes("model"), TypeError, "model must be a torch.nn.Module, got str"),
    ("held_bytes-optimizer", lambda: memory.held_bytes(_llama(), []), TypeError, "optimizer must be a torch.optim.Optimizer, got list"),
    ("held_bytes-device", lambda: memory.held_bytes(_llama(), device="gpu0"), ValueError, "device must be a torch device.*'gpu0'"),
    # parallel.zero
    ("Zero1AdamW-lr", lambda: zero.Zero1AdamW([torch.nn.Parameter(torch.zeros(4))], lr=-1.0), ValueError, "Zero1AdamW's AdamW arguments.*Invalid learning rate"),
    ("Zero1AdamW-betas", lambda: zero.Zero1AdamW([torch.nn.Parameter(torch.zeros(4))], betas=(1.5, 0.9)), ValueError, "Invalid beta parameter"),
    ("Zero1AdamW-keyword", lambda: zero.Zero1AdamW([torch.nn.Parameter(torch.zeros(4))], lrate=0.1), TypeError, "AdamW arguments.*'lrate'"),
    ("Zero1AdamW-tensor", lambda: zero.Zero1AdamW(torch.nn.Parameter(torch.zeros(4))), TypeError, "params must be an iterable of parameters.*got Parameter"),
    ("Zero1AdamW-items", lambda: zero.Zero1AdamW([1, 2]), TypeError, "params must hold tensors.*got 1"),
    # parallel.tensor
    ("megatron-fc1", lambda: tensor.megatron_mlp_shard("fc1", L84, 0, 2), TypeError, "fc1 must be an nn.Linear, got str"),
    ("megatron-widths", lambda: tensor.megatron_mlp_shard(L48, torch.nn.Linear(6, 4), 0, 2), ValueError, "fc2 must read fc1's 8 outputs, but it has 6 inputs"),
    ("megatron-world-text", lambda: tensor.megatron_mlp_shard(L48, L84, 0, "2"), TypeError, "world must be an int, got '2'"),
    ("megatron-rank-float", lambda: tensor.megatron_mlp_shard(L48, L84, 0.5, 2), TypeError, "rank must be an int, got 0.5"),
    ("tp_mlp-x", lambda: tensor.tensor_parallel_mlp([1.0], L48, L84), TypeError, "x must be a torch.Tensor, got list"),
    ("tp_mlp-width", lambda: tensor.tensor_parallel_mlp(torch.zeros(2, 5), L48, L84), ValueError, "x must end in a's 4 input features, got shape \\(2, 5\\)"),
    ("tp_mlp-activation", lambda: tensor.tensor_parallel_mlp(torch.zeros(2, 4), L48, L84, "gelu"), TypeError, "activation must be callable"),
    ("copy_to_parallel", lambda: tensor.copy_to_parallel([1.0]), TypeError, "x must be a torch.Tensor, got list"),
    ("reduce_from_parallel", lambda: tensor.reduce_from_parallel(None), TypeError, "x must be a torch.Tensor, got NoneType"),
    ("parallelize_block-mesh", lambda: tensor.parallelize_block(_llama().model.layers[0], "mesh"), TypeError, "mesh must be a torch DeviceMesh"),
    # parallel.fsdp
    ("shard_model-model", lambda: fsdp.shard_model("m"), TypeError, "model must be a torch.nn.Module, got str"),
    ("shard_model-blocks", lambda: fsdp.shard_model(L48), ValueError, "cannot find the decoder blocks of Linear"),
    ("shard_model-offload", lambda: fsdp.shard_model(_llama(), offload="yes"), TypeError, "offload must be True or False"),
    ("shard_model-dtype", lambda: fsdp.shard_model(_llama(), param_dtype="bf16"), TypeError, "param_dtype must be None or a torch floating-point dtype"),
    # profiler
    ("phase-name", lambda: _enter(profiler.phase("eval")), ValueError, "phase must be one of \\('data', 'forward'"),
    ("top-n-text", lambda: _trace().top("3"), TypeError, "n must be an int, got '3'"),
    ("top-n-zero", lambda: _trace().top(0), ValueError, "n must be an int >= 1, got 0"),
    ("share-regex", lambda: _trace().share("("), ValueError, "pattern '\\(' is not a valid regex"),
    ("count-pattern", lambda: _trace().count(3), TypeError, "pattern must be a regex string"),
    ("breakdown-events", lambda: profiler.breakdown({"traceEvents": []}), TypeError, "events must be a list of Chrome-trace event dicts"),
    ("device_busy-steps", lambda: profiler.device_busy([{"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 1}]), ValueError, "no ProfilerStep# events"),
    ("profile_steps-out-none", lambda: profiler.profile_steps(lambda: None, None), TypeError, "out_dir must be a path.*got None"),
    ("profile_steps-out-file", lambda: profiler.profile_steps(lambda: None, __file__), NotADirectoryError, "out_dir .*test_bad_inputs.py is a file"),
    # monitor
    ("Sampler-clock", lambda: monitor.Sampler(clock=3), TypeError, "clock must be callable"),
    ("Sampler-rapl", lambda: monitor.Sampler(rapl=3), TypeError, "rapl must be a path.*got 3"),
    ("series-name", lambda: _sampler().series(3), TypeError, "name must be a measure's name"),
    ("series-since", lambda: _sampler().series("power_w", since="0"), TypeError, "since must be a finite number, got '0'"),
    ("mean-since-nan", lambda: _sampler().mean("power_w", since=float("nan")), TypeError, "since must be a finite number, got nan"),
    ("integrate-text", lambda: monitor.integrate("abc", "abc"), TypeError, "times must be a list of numbers"),
    ("integrate-nan", lambda: monitor.integrate([0.0, 1.0], [1.0, float("nan")]), ValueError, "values must hold finite numbers"),
    ("energy_per_token-text", lambda: monitor.energy_per_token(1.0, "10"), TypeError, "tokens must be an int, got '10'"),
    ("energy_per_token-nan", lambda: monitor.energy_per_token(float("nan"), 10), TypeError, "joules must be a finite number, got nan"),
    ("busy_but_idle-seconds", lambda: monitor.busy_but_idle(seconds=0), ValueError, "seconds must be positive, got 0"),
    ("busy_but_idle-size", lambda: monitor.busy_but_idle(size=0), ValueError, "size must be an int >= 1, got 0"),
    ("busy_but_idle-peak", lambda: monitor.busy_but_idle(peak_size="big"), TypeError, "peak_size must be an int, got 'big'"),
    ("TensorBoardLog-none", lambda: monitor.TensorBoardLog(None), TypeError, "logdir must be a path.*got None"),
    ("read_scalars-none", lambda: monitor.read_scalars(None), TypeError, "logdir must be a path.*got None"),
    # results
    ("save_run-root", lambda: results.save_run("x", {"a": 1}, root=None), TypeError, "root must be a path.*got None"),
    ("runs-name", lambda: results.runs("../etc"), ValueError, "benchmark name must be lower-case letters, digits and '_', got '../etc'"),
    ("runs-name-none", lambda: results.runs(None), ValueError, "benchmark name must be .* got None"),
    ("latest-name", lambda: results.latest("Perplexity"), ValueError, "benchmark name must be .* got 'Perplexity'"),
    ("publish-text", lambda: results.publish(3, {}), TypeError, "text must be a str"),
    ("publish-payload", lambda: results.publish("x", ["a"]), TypeError, "payload must be a dict"),
    ("publish-object", lambda: results.publish("x", {"m": object()}), TypeError, "cannot store object"),
    ("saved_notebook-none", lambda: results.saved_notebook(None), TypeError, "path must be a path.*got None"),
    # figures
    ("significant-digits", lambda: figures.significant(1.0, 0), ValueError, "digits must be an int >= 1, got 0"),
    ("significant-digits-text", lambda: figures.significant(1.0, "3"), TypeError, "digits must be an int, got '3'"),
    ("significant-value", lambda: figures.significant("12", 3), TypeError, "value must be a number, got '12'"),
    ("fmt-spec", lambda: figures.fmt(1.0, 3), TypeError, "spec must be a str .* got 3"),
    ("fmt-spec-none", lambda: figures.fmt(1.0, None), TypeError, "spec must be a str .* got None"),
    ("fmt-min-text", lambda: figures.fmt("abc", "min"), figures.FigureError, "cannot format 'abc' with 'min'.*seconds"),
    ("fmt-min-inf", lambda: figures.fmt("inf", "min"), figures.FigureError, "cannot format inf with 'min': it takes a finite number"),
    ("fmt-digits-none", lambda: figures.fmt(None, "~3"), figures.FigureError, "cannot format None with '~3': it takes a number"),
    ("lookup-path", lambda: figures.lookup({}, 3), TypeError, "path must be a str"),
    ("evaluate-figures", lambda: figures.evaluate([1], "a", by_name=True), TypeError, "figures must be a dict"),
    ("evaluate-expression", lambda: figures.evaluate({}, None, by_name=True), TypeError, "expression must be a str"),
    ("Sources-root", lambda: figures.Sources(None), TypeError, "root must be a path.*got None"),
    ("Sources-get", lambda: figures.Sources().get(4), TypeError, "name must be a source such as 'lab04'"),
    ("render_line-sources", lambda: figures.render_line("x", {}), TypeError, "sources must be a figures.Sources, got dict"),
    ("render-template", lambda: figures.render(None, figures.Sources()), TypeError, "template must be a str"),
    ("typed_rows", lambda: figures.typed_rows(["| a |"]), TypeError, "template must be a str"),
    ("rendered-target", lambda: figures.rendered(Path("nope.md")), ValueError, "target must be one of README.md"),
    # quant.nf4
    ("quantize_blockwise-list", lambda: nf4.quantize_blockwise([1.0]), TypeError, "x must be a tensor, got list"),
    ("quantize_blockwise-empty", lambda: nf4.quantize_blockwise(torch.zeros(0)), ValueError, "x must hold at least one value"),
    ("quantize_blockwise-block", lambda: nf4.quantize_blockwise(torch.ones(4), 0), ValueError, "blocksize must be an int >= 1, got 0"),
    ("dequantize_blockwise-codes", lambda: nf4.dequantize_blockwise(torch.zeros(4), torch.ones(1)), TypeError, "codes must be a uint8 tensor"),
    ("dequantize_blockwise-absmax", lambda: nf4.dequantize_blockwise(torch.zeros(300, dtype=torch.uint8), torch.ones(1)), ValueError, "absmax must be a tensor of 2 block scale"),
    ("NF4Weight-dtype", lambda: nf4.quantize_nf4(torch.randn(2, 64)).dequantize(torch.int8), TypeError, "dtype must be a torch floating-point dtype"),
    ("nf4_model-model", lambda: nf4.quantize_model_nf4("m"), TypeError, "model must be a torch.nn.Module, got str"),
    ("nf4_model-inplace", lambda: nf4.quantize_model_nf4(_fresh(), inplace="no"), TypeError, "inplace must be True or False"),
    # quant.awq
    ("activation_scale-1d", lambda: awq.activation_scale(torch.ones(4)), ValueError, "hessian must be a square 2-D tensor"),
    ("scaled_rtn-cfg", lambda: awq.scaled_rtn(W, torch.ones(16), "rtn"), TypeError, "cfg must be a QuantConfig, got str"),
    ("scaled_rtn-scale", lambda: awq.scaled_rtn(W, torch.ones(8), RULES), ValueError, "scale must be a tensor of 16 input-channel scales"),
    ("search_scale-cfg", lambda: awq.search_scale(W, torch.eye(16), None), TypeError, "cfg must be a QuantConfig, got NoneType"),
    ("search_scale-hessian", lambda: awq.search_scale(W, torch.eye(8), RULES), ValueError, "hessian must be \\[16, 16\\], got \\(8, 8\\)"),
    ("search_scale-grid", lambda: awq.search_scale(W, torch.eye(16), RULES, grid=True), ValueError, "grid must be a positive int, got True"),
    ("awq-nothing", lambda: awq.awq_model(_gpt2(), CAL, RULES, progress=False), ValueError, "nothing to scale in GPT2LMHeadModel.*self_attn.q_proj"),
    ("awq-model", lambda: awq.awq_model("m", CAL, RULES), TypeError, "model must be a torch.nn.Module, got str"),
    ("awq-batch", lambda: awq.awq_model(_llama(), CAL, RULES, batch_size=0), ValueError, "batch_size must be an int >= 1, got 0"),
    ("awq-inplace", lambda: awq.awq_model(_fresh(), CAL, RULES, inplace=1, progress=False), TypeError, "inplace must be True or False, got 1"),
    ("awq-empty-calibration", lambda: awq.awq_model(_llama(), EMPTY_CAL, RULES), ValueError, "AWQ-style scaling needs at least one calibration block.*\\(0, 8\\)"),
    # calibration (the engine under GPTQ, AWQ, Wanda and SparseGPT)
    ("calibration_blocks-str", lambda: calibration.calibration_blocks(_bpe(), "hello world", 1, 2), TypeError, "texts must be a list of texts, got one str"),
    ("calibration_blocks-n", lambda: calibration.calibration_blocks(_bpe(), ["hi"], "2", 8), TypeError, "n_blocks must be an int, got '2'"),
    ("calibration_blocks-seed", lambda: calibration.calibration_blocks(_bpe(), ["hello"] * 9, 1, 2, seed="0"), TypeError, "seed must be an int, got '0'"),
    ("check_calibration-empty", lambda: calibration.check_calibration(_llama(), EMPTY_CAL, "GPTQ"), ValueError, "GPTQ needs at least one calibration block of at least one token"),
    ("input_hessian-float", lambda: calibration.input_hessian(_llama(), DOWN, torch.zeros(2, 8)), ValueError, "input_hessian needs calibration token ids as a \\[n_blocks, block_size\\] long tensor"),
    ("input_hessian-empty", lambda: calibration.input_hessian(_llama(), DOWN, EMPTY_CAL), ValueError, "input_hessian needs at least one calibration block"),
    ("input_hessian-unused", lambda: calibration.input_hessian(_unused_linear(), "unused", CAL), ValueError, "'unused' saw no input: the model's forward does not reach it"),
    ("input_hessian-batch", lambda: calibration.input_hessian(_llama(), DOWN, CAL, batch_size=0), ValueError, "batch_size must be an int >= 1, got 0"),
    ("sweep-solve", lambda: calibration.calibrated_sweep(_llama(), CAL, None), TypeError, "solve must be callable"),
    ("sweep-empty", lambda: calibration.calibrated_sweep(_llama(), EMPTY_CAL, print), ValueError, "the calibrated sweep needs at least one calibration block"),
    ("sweep-float", lambda: calibration.calibrated_sweep(_llama(), CAL.float(), print), ValueError, "the calibrated sweep needs calibration token ids as a .* long tensor"),
    # quant.whole_model
    ("gptq-empty-blocks", lambda: qmodel.quantize_model(_llama(), RULES, torch.zeros(1, 0, dtype=torch.long)), ValueError, "GPTQ needs at least one calibration block.*\\(1, 0\\)"),
    ("quantize_model-model", lambda: qmodel.quantize_model("m", RULES, method="rtn"), TypeError, "model must be a torch.nn.Module, got str"),
    ("quantize_model-batch", lambda: qmodel.quantize_model(_llama(), RULES, method="rtn", batch_size="8"), TypeError, "batch_size must be an int, got '8'"),
    ("quantize_model-inplace", lambda: qmodel.quantize_model(_fresh(), RULES, method="rtn", inplace="yes"), TypeError, "inplace must be True or False"),
    ("quantize_model-progress", lambda: qmodel.quantize_model(_llama(), RULES, method="rtn", progress="no"), TypeError, "progress must be True or False"),
    ("quantize_model-nan", lambda: qmodel.quantize_model(_nan_llama(), RULES, method="rtn"), ValueError, "the weight of model.layers.1.mlp.down_proj holds NaN or inf"),
    ("weight_bytes", lambda: qmodel.weight_bytes({}), TypeError, "qm must be a QuantizedModel"),
    # prune.calibrated
    ("calibrated-nothing", lambda: calibrated.calibrated_prune(_gpt2(), CAL, progress=False), ValueError, "nothing to prune in GPT2LMHeadModel.*nn.Linear.*Conv1D"),
    ("calibrated-model", lambda: calibrated.calibrated_prune("m", CAL), TypeError, "model must be a torch.nn.Module, got str"),
    ("calibrated-batch-bool", lambda: calibrated.calibrated_prune(_fresh(), CAL, batch_size=True, progress=False), ValueError, "batch_size must be a positive int, got True"),
    ("calibrated-block-bool", lambda: calibrated.calibrated_prune(_fresh(), CAL, method="sparsegpt", block_size=True, progress=False), ValueError, "block_size must be a positive int .* got True"),
    ("calibrated-permanent", lambda: calibrated.calibrated_prune(_fresh(), CAL, permanent="yes", progress=False), TypeError, "permanent must be True or False"),
    ("calibrated-empty", lambda: calibrated.calibrated_prune(_fresh(), EMPTY_CAL), ValueError, "calibrated pruning needs at least one calibration block"),
    ("wanda_mask-weight", lambda: calibrated.wanda_mask([[1.0]], torch.eye(1), 0.5), ValueError, "weight must be a 2-D tensor \\[out, in\\]"),
    ("wanda_mask-hessian", lambda: calibrated.wanda_mask(W, None, 0.5), TypeError, "hessian must be a tensor \\[in, in\\], got NoneType"),
    ("sparsegpt-damp", lambda: calibrated.sparsegpt_weight(W, torch.eye(16), 0.5, damp=2.0), ValueError, "damp must be in \\[0, 1\\), got 2.0"),
    ("sparsegpt-damp-nan", lambda: calibrated.sparsegpt_weight(W, torch.eye(16), 0.5, damp=float("nan")), ValueError, "damp must be in \\[0, 1\\), got nan"),
    # gpucheck
    ("plan-gpus-text", lambda: gpucheck.plan("2", TMP), TypeError, "gpus must be an int, got '2'"),
    ("plan-gpus-negative", lambda: gpucheck.plan(-1, TMP), ValueError, "gpus must be an int >= 0, got -1"),
    ("plan-runs", lambda: gpucheck.plan(1, None), TypeError, "runs must be a path.*got None"),
    ("goals-root", lambda: gpucheck.goals(None), TypeError, "root must be a path.*got None"),
    ("run_step-step", lambda: gpucheck.run_step("echo", 1, TMP), TypeError, "step must be a gpucheck.Step"),
    ("run_step-echo", lambda: gpucheck.run_step(gpucheck.Step("x", ["true"], 1), 1, TMP, echo=3), TypeError, "echo must be callable"),
    ("gpu_check-output-dir", lambda: gpucheck.gpu_check(TMP), IsADirectoryError, "output .* is a directory: give a file name"),
    ("gpu_check-run_labs", lambda: gpucheck.gpu_check(TMP / "labkit-gpu-check.json", run_labs="no"), TypeError, "run_labs must be True or False"),
    ("summary-report", lambda: gpucheck.summary({}), ValueError, "report must be gpu_check's result"),
]  # fmt: skip


@pytest.mark.parametrize("call, error, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_error(call, error, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. GPTQ's few-calibration-tokens warning: the error is what counts
        with pytest.raises(error, match=message):
            call()


def test_the_table_covers_at_least_two_hundred_cases_across_the_api():
    assert len(CASES) >= 200 and len({c[0] for c in CASES}) == len(CASES)


def _state(thing):
    """What a bad call must leave as it was: a model's parameters (values, storage, device) and modules, a folder's
    listing, or the environment variables."""
    if isinstance(thing, torch.nn.Module):
        params = [(n, p.device, p.data_ptr(), p.detach().clone()) for n, p in thing.named_parameters()]
        return params, [(n, type(m)) for n, m in thing.named_modules()]
    if isinstance(thing, Path):
        return sorted(p.relative_to(thing) for p in thing.rglob("*"))
    return dict(thing)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())  # NaN where it was
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# (id, what to build in tmp_path, the bad call on it, exception, message): what was built comes out as it went in
UNCHANGED = [
    ("nf4-inplace-blocksize", lambda tmp: _fresh(), lambda m: nf4.quantize_model_nf4(m, blocksize=4096, inplace=True, progress=False), ValueError, "2048 weights do not fill whole blocks of 4096"),
    ("nf4-inplace-nan", lambda tmp: _nan_llama(), lambda m: nf4.quantize_model_nf4(m, inplace=True, progress=False), ValueError, "NaN or inf"),
    ("rtn-inplace-nan", lambda tmp: _nan_llama(), lambda m: qmodel.quantize_model(m, RULES, method="rtn", inplace=True, progress=False), ValueError, "model.layers.1.mlp.down_proj holds NaN or inf"),
    ("awq-inplace-group", lambda tmp: _fresh(intermediate_size=96), lambda m: awq.awq_model(m, CAL, formats.QuantConfig(group_size=64), inplace=True, progress=False), ValueError, "group_size 64 does not divide in_features 96"),
    ("zero1-lr", lambda tmp: _fresh(), lambda m: _in_process_group(lambda: zero.Zero1AdamW(m.parameters(), lr=-1.0)), ValueError, "Invalid learning rate: -1.0"),
    ("environ-part-set", lambda tmp: os.environ, lambda env: _enter(torchutil.environ(LABKIT_TEST_A="1", LABKIT_TEST_B=2)), TypeError, "take str values, got \\{'LABKIT_TEST_B': 2\\}"),
    ("profile_steps-step", lambda tmp: tmp, lambda tmp: profiler.profile_steps(None, tmp / "trace"), TypeError, "step must be callable"),
    ("profile_steps-flag", lambda tmp: tmp, lambda tmp: profiler.profile_steps(lambda: None, tmp / "trace", with_stack="yes"), TypeError, "with_stack must be True or False"),
    ("save_run-profile", lambda tmp: tmp, lambda tmp: results.save_run("x", {"a": 1}, profile="turbo", root=tmp), ValueError, "unknown profile 'turbo'"),
    ("save_run-profile-type", lambda tmp: tmp, lambda tmp: results.save_run("x", {"a": 1}, profile=3, root=tmp), TypeError, "profile must be None or a profile's name"),
]  # fmt: skip


@pytest.mark.parametrize("build, call, error, message", [u[1:] for u in UNCHANGED], ids=[u[0] for u in UNCHANGED])
def test_a_refused_call_changes_nothing(build, call, error, message, tmp_path):
    thing = build(tmp_path)
    before = _state(thing)
    with warnings.catch_warnings(), pytest.raises(error, match=message):
        warnings.simplefilter("ignore")
        call(thing)
    assert _same(before, _state(thing))


MIME = results.MIME
RUN = "results/r/20260101-000000-h.json"
LAB = "labs/04_data.ipynb"


def _notebook(executed, figures_):
    cell = {"cell_type": "code", "outputs": [{"data": {MIME: {"figures": figures_}}}]}
    return json.dumps({"cells": [cell], "metadata": {"labkit": {"executed": executed}}})


# (id, file under tmp_path, its text, how it is read, what the message must say after the file's path)
MALFORMED = [
    ("run-not-json", RUN, '{"figures": ', lambda tmp: results.runs("r", tmp / "results"), "not a JSON record"),
    ("run-a-list", RUN, "[1, 2]", lambda tmp: results.runs("r", tmp / "results"), "the file holds a JSON list, not an object"),
    ("run-no-benchmark", RUN, '{"machine": {}, "figures": {}}', lambda tmp: results.runs("r", tmp / "results"), "no 'benchmark'"),
    ("run-machine-list", RUN, '{"benchmark": "r", "machine": [], "figures": {}}', lambda tmp: results.latest("r", tmp / "results"), "'machine' is a list"),
    ("run-figures-null", RUN, '{"benchmark": "r", "machine": {}, "figures": null}', lambda tmp: results.latest("r", tmp / "results"), "'figures' is a NoneType"),
    ("figures-run-machine", RUN, '{"benchmark": "r", "machine": "vm", "figures": {"a": 1}}', lambda tmp: figures.Sources(tmp).get("bench/r"), "'machine' is a str"),
    ("notebook-not-json", LAB, "{", lambda tmp: results.saved_notebook(tmp / LAB), "not a notebook's JSON"),
    ("notebook-a-list", LAB, "[]", lambda tmp: results.saved_notebook(tmp / LAB), "not a notebook \\(needs an object whose 'cells' is a list of objects\\)"),
    ("notebook-cells", LAB, '{"cells": {"a": 1}}', lambda tmp: results.notebook_figures(tmp / LAB), "'cells' is a list of objects"),
    ("notebook-outputs", LAB, '{"cells": [{"cell_type": "code", "outputs": [3]}]}', lambda tmp: results.saved_notebook(tmp / LAB), "outputs must be objects"),
    ("notebook-payload", LAB, _notebook({"seconds": 1}, 1).replace('{"figures": 1}', "[1]"), lambda tmp: results.saved_notebook(tmp / LAB), "payload must be JSON objects"),
    ("notebook-metadata", LAB, '{"cells": [], "metadata": {"labkit": []}}', lambda tmp: results.saved_notebook(tmp / LAB), "metadata.labkit .* must be JSON objects"),
    ("figures-lab-executed", LAB, _notebook([1], {}), lambda tmp: figures.Sources(tmp).get("lab04"), "metadata.labkit.executed is a list, not an object"),
    ("figures-lab-figures", LAB, _notebook({"seconds": 1}, [1]), lambda tmp: figures.Sources(tmp).get("lab04"), "published 'figures' that are not an object"),
]  # fmt: skip


@pytest.mark.parametrize("name, text, read, message", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_a_malformed_file_is_named_with_what_is_wrong(name, text, read, message, tmp_path):
    path = tmp_path / name
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(ValueError, match=f"{re.escape(name)}.*{message}"):
        read(tmp_path)


def test_add_lora_changes_nothing_before_an_error():
    model = models.tiny_llama()
    with pytest.raises(ValueError, match="dropout"):
        lora.add_lora(model, dropout=2.0)
    assert all(p.requires_grad for p in model.parameters())  # not frozen
    lora.add_lora(model, r=2)
    with pytest.raises(ValueError, match="already has 4 LoRA adapter\\(s\\).*merge_lora"):
        lora.add_lora(model, r=2)


def test_fit_names_an_id_outside_the_vocabulary_before_the_first_step(tmp_path):
    model = models.tiny_llama(vocab_size=32)  # the shards hold ids up to 63
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="input ids hold token id (3[2-9]|[4-6][0-9]), outside .* \\[0, 32\\)"):
        train.fit(model, _loader(tmp_path), train.TrainConfig(steps=2, progress=False))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_quantize_model_in_place_leaves_the_model_alone_on_bad_calibration():
    model = models.tiny_llama(vocab_size=64)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="token id -1"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel.quantize_model(model, RULES, torch.full((2, 128), -1), inplace=True)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_an_empty_split_of_a_small_corpus_is_an_error_with_the_reason(tmp_path):
    """No caller can use an empty split (a tokenizer, perplexity, calibration would fail on it later), so asking for
    one is refused, not answered with [] and a warning a script may never show."""
    name = next(f"c{i}.txt" for i in range(100) if data.split_of(f"c{i}.txt#0") != "train")
    path = tmp_path / name
    path.write_text("one document only")
    with pytest.raises(ValueError, match="'train' split of .* is empty: its 1 document.*split='all'"):
        data.load_corpus(str(path), "train")
    assert data.load_corpus(str(path), "all") == ["one document only"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["slurm", str(SCRIPT), "-o", "{tmp}"], "is a directory: give a file name"),
        (["profile", "turbo"], "unknown profile 'turbo'"),
        (["slurm", str(SCRIPT), "--nodes", "0"], "nodes >= 1"),
        (["slurm", "no_such.py"], "no such script"),
    ],
)
def test_cli_errors_are_one_line_and_a_non_zero_exit(argv, message, tmp_path, capsys):
    assert cli.main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_closed_pipe_is_not_an_error():
    """`labkit profile gpu | head -1`, made certain: stdout is a pipe whose reader has already gone."""
    code = (
        "import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1); "
        "from labkit import cli; sys.exit(cli.main(['profile', 'gpu']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")
