"""Bad input at the public boundary: the right exception, a message that names the argument and what is
allowed, and nothing changed before it. One row per case; the modules' own tests hold the good paths."""

import functools
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from labkit import bench, cli, data, evaluate, flops, lora, models, precision, profiles, shards, tasks, train
from labkit import tokenizer as T
from labkit.parallel import launch, pipeline, ring, slurm, tensor
from labkit.prune import masks, structured
from labkit.quant import checkpoint as qcheckpoint
from labkit.quant import formats, gptq
from labkit.quant import model as qmodel

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
    ("calibration_blocks", lambda: qmodel.calibration_blocks(_bpe(), ["hello"], 0, 8), ValueError, "n_blocks >= 1"),
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
]  # fmt: skip


@pytest.mark.parametrize("call, error, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_error(call, error, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. GPTQ's few-calibration-tokens warning: the error is what counts
        with pytest.raises(error, match=message):
            call()


def test_the_table_covers_at_least_sixty_cases_across_the_api():
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


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


def test_an_empty_split_of_a_small_corpus_warns_with_the_reason(tmp_path):
    name = next(f"c{i}.txt" for i in range(100) if data.split_of(f"c{i}.txt#0") != "train")
    path = tmp_path / name
    path.write_text("one document only")
    with pytest.warns(UserWarning, match="'train' split of .* is empty: its 1 document.*split='all'"):
        assert data.load_corpus(str(path), "train") == []
    assert data.load_corpus(str(path), "all") == ["one document only"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["slurm", str(SCRIPT), "-o", "{tmp}"], "is a directory: give a file name"),
        (["student", "--labs", "{tmp}/missing"], "no notebooks in"),
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
