"""Data parallelism on 2 gloo ranks under torchrun: DDP equals one process (also with padded documents, the
trainer dividing by every rank's target tokens), and from-scratch (naive and bucketed) equals DDP."""

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from labkit import shards
from labkit.parallel import launch
from labkit.parallel.ddp import BucketedDataParallel


def test_ddp_equals_one_process_on_the_whole_batch(dp_parity_results):
    res, lines = dp_parity_results
    where = launch.placement(2, launch.visible_gpus())
    assert f"labkit: {where.reason}" in lines  # the launcher says where the ranks run, and they do
    assert [r["device"] for r in res] == (["cuda:0", "cuda:1"] if where.device_type == "cuda" else ["cpu", "cpu"])
    assert [r["rank"] for r in res] == [0, 1] and all(r["world"] == 2 for r in res)
    for r in res:
        assert r["ddp_vs_single_batch"] < 1e-12  # fp64: gradients of the first step
        assert r["params_after_steps_vs_single"] < 1e-10  # after 5 AdamW steps
    assert res[0]["params_sha256"] == res[1]["params_sha256"]  # ranks bit-identical


def test_token_normalization_is_global_across_ranks_with_padded_documents(dp_parity_results):
    res, _ = dp_parity_results
    assert [r["padded_rank_targets"] for r in res] == [14, 187]  # hand-counted: short documents on rank 0
    for r in res:
        assert r["padded_tokens_vs_single"] < 1e-12  # fp64: every rank divides by all 201 target tokens
        assert r["padded_rank_tokens_vs_single"] > 0.5 * r["padded_gradient_scale"]  # each by its own: wrong


def test_from_scratch_data_parallel_equals_torch_ddp(dp_parity_results):
    res, _ = dp_parity_results
    for r in res:
        assert r["naive_vs_ddp"] < 1e-12
        assert r["bucketed_vs_ddp"] < 1e-12 and r["buckets"] > 1  # several buckets were exercised


def test_ddp_training_equals_one_process_with_the_same_global_batch(tmp_path):
    stream = (np.arange(20000) * 7 % 256).astype(np.int64)
    shards.write_shards(stream, tmp_path / "data", 5000, vocab_size=256, tokenizer="t")
    script = Path(__file__).parents[1] / "labs" / "scripts" / "ddp_train.py"
    common = [
        "--shards",
        str(tmp_path / "data"),
        "--vocab",
        "256",
        "--steps",
        "3",
        "--accum",
        "2",
        "--block",
        "32",
        "--dtype",
        "float64",
    ]  # fp32 sums differ with the rank count, and AdamW magnifies that near its eps
    two = launch.launch(
        script,
        nproc=2,
        args=[*common, "--micro-batch", "2", "--save", str(tmp_path / "two.st")],
        echo=None,
        timeout=180,
    )
    one = launch.launch(
        script,
        nproc=1,
        args=[*common, "--micro-batch", "4", "--save", str(tmp_path / "one.st")],
        echo=None,
        timeout=180,
    )
    assert [r["world"] for r in two] == [2, 2] and one[0]["world"] == 1
    a, b = load_file(str(tmp_path / "two.st")), load_file(str(tmp_path / "one.st"))
    assert all(a[k].dtype == torch.float64 for k in a)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-10  # float64: summation order only


@pytest.mark.parametrize("bucket_mb", [0, -1.0, "25"])
def test_bucketed_data_parallel_refuses_a_bucket_size_that_is_not_positive(bucket_mb):
    with pytest.raises(ValueError, match=f"bucket_mb must be a positive number of MiB, got {bucket_mb!r}"):
        BucketedDataParallel(torch.nn.Linear(2, 2), bucket_mb=bucket_mb)
