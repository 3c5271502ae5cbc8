"""What each rank holds after a training step on 2 gloo ranks (labs/scripts/sharding.py), counted tensor by tensor,
against the memory model: DDP everything, ZeRO-1 half the AdamW state, FSDP2 half of everything, with or without
activation checkpointing."""

import pytest
from torch import nn

from labkit.models import tiny_llama
from labkit.parallel.fsdp import shard_model


@pytest.mark.parametrize("method", ["ddp", "zero1", "fsdp", "fsdp_ckpt"])
def test_each_rank_holds_what_the_memory_model_predicts(sharding_results, method):
    for r in sharding_results:  # dimensions divisible by 2: equal shards, so the prediction is exact
        row = r["memory"]["methods"][method]
        assert row["held"] == row["predicted"]
        assert row["seconds"] > 0 and row["peak_bytes"] >= 0
    n = sharding_results[0]["parameters"]
    held = sharding_results[0]["memory"]["methods"][method]["held"]
    # bytes per parameter of (weights, gradients, AdamW moments) in fp32 on each of 2 ranks, by hand
    by_hand = {"ddp": (4, 4, 8), "zero1": (4, 4, 4), "fsdp": (2, 2, 4), "fsdp_ckpt": (2, 2, 4)}[method]
    assert (held["parameters"], held["gradients"], held["optimizer"]) == tuple(b * n for b in by_hand)


def test_torchs_zero1_splits_whole_tensors_nearly_evenly(sharding_results):
    rows = [r["memory"]["methods"] for r in sharding_results]
    held = [m["zero1_torch"]["held"]["optimizer"] for m in rows]
    assert sum(held) == rows[0]["ddp"]["held"]["optimizer"]  # every moment somewhere, once
    for h, m in zip(held, rows, strict=True):
        assert abs(h / m["zero1_torch"]["predicted"]["optimizer"] - 1) < 0.1  # the embedding is one whole tensor


def test_offload_only_where_there_is_an_accelerator_to_offload_from(sharding_results):
    for r in sharding_results:
        rows = r["memory"]["methods"]
        assert ("fsdp_offload" in rows) == (not r["device"].startswith("CPU"))
        if "fsdp_offload" in rows:  # a GPU rank keeps no state on the device, all of it in host memory
            row = rows["fsdp_offload"]
            assert row["held"] == row["predicted"] and row["held"]["offloaded"] == 8 * r["parameters"]


def test_shard_model_needs_a_process_group_and_decoder_blocks():
    with pytest.raises(RuntimeError, match="process group"):
        shard_model(tiny_llama())
    with pytest.raises(ValueError, match="cannot find the decoder blocks of Linear"):  # refused first
        shard_model(nn.Linear(2, 2))
