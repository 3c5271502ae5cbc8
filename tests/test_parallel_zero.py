"""Sharded data parallelism on 2 gloo ranks under torchrun: labkit's ZeRO-1, torch's ZeroRedundancyOptimizer and
FSDP2 each train exactly as one process does (float64), holding the share of the state the memory model says."""

from pathlib import Path

import pytest

from labkit.parallel import launch
from labkit.parallel.memory import DtypePolicy, state_bytes

SCRIPT = Path(__file__).parents[1] / "labs" / "scripts" / "zero_parity.py"
FP64_ADAMW = DtypePolicy(param=8, grad=8, master=0, optimizer=16)


@pytest.fixture(scope="module")
def results():
    return launch.launch(SCRIPT, nproc=2, echo=None, timeout=300)


@pytest.mark.parametrize("method", ["zero1", "zero_redundancy", "fsdp"])
def test_sharded_training_equals_one_process(results, method):
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r[f"{method}_vs_single"] < 1e-10 * max(1.0, r["scale"])  # five AdamW steps, float64


def test_zero1_holds_half_the_moments_as_the_memory_model_says(results):
    n = results[0]["parameters"]
    single = results[0]["optimizer_bytes"]["single"]
    assert single == n * 16  # two float64 moments per parameter, counted by hand
    predicted = state_bytes(n, "zero1", 2, FP64_ADAMW).optimizer
    for r in results:
        assert r["optimizer_bytes"]["zero1"] == predicted  # equal slices: exactly ceil(n / 2) each
    for method in ("zero_redundancy", "fsdp"):  # whole tensors or row blocks per rank: about half, together all
        held = [r["optimizer_bytes"][method] for r in results]
        assert sum(held) == single and max(held) <= 0.6 * single


def test_fsdp_keeps_a_shard_of_every_parameter(results):
    local = [r["fsdp_local_parameters"] for r in results]
    assert sum(local) == results[0]["parameters"] and max(local) <= 0.55 * results[0]["parameters"]
