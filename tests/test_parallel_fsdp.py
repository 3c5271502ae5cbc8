"""What each rank holds after a training step on 2 gloo ranks, counted tensor by tensor, against the memory model:
DDP everything, ZeRO-1 half the AdamW state, FSDP2 half of everything."""

from pathlib import Path

import pytest
from torch import nn

from labkit.parallel import launch
from labkit.parallel.fsdp import shard_model

SCRIPT = Path(__file__).parents[1] / "labs" / "scripts" / "memory_per_rank.py"


@pytest.fixture(scope="module")
def results():
    return launch.launch(SCRIPT, nproc=2, echo=None, timeout=300)


@pytest.mark.parametrize("method", ["ddp", "zero1", "fsdp"])
def test_each_rank_holds_what_the_memory_model_predicts(results, method):
    for r in results:  # dimensions divisible by 2: equal shards, so the prediction is exact
        assert r["held"][method] == r["predicted"][method]
    n = results[0]["parameters"]
    held = results[0]["held"][method]
    assert held["optimizer"] == {"ddp": 8 * n, "zero1": 4 * n, "fsdp": 4 * n}[method]  # by hand: AdamW, 2 ranks


def test_torchs_zero1_splits_whole_tensors_nearly_evenly(results):
    held = [r["held"]["zero1_torch"]["optimizer"] for r in results]
    assert sum(held) == results[0]["held"]["ddp"]["optimizer"]  # every moment somewhere, once
    for h, r in zip(held, results):
        assert abs(h / r["predicted"]["zero1_torch"]["optimizer"] - 1) < 0.01


def test_shard_model_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        shard_model(nn.Linear(2, 2))
