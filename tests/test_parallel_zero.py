"""Sharded data parallelism on 2 gloo ranks under torchrun (labs/scripts/sharding.py, run once per session):
labkit's ZeRO-1, torch's ZeroRedundancyOptimizer and FSDP2 each train exactly as one process does (float64),
holding the share of the optimizer state the memory model says."""

import pytest

from labkit.parallel.memory import DtypePolicy, state_bytes

FP64_ADAMW = DtypePolicy(param=8, grad=8, master=0, optimizer=16)


@pytest.mark.parametrize("method", ["zero1", "zero1_torch", "fsdp"])
def test_sharded_training_equals_one_process(sharding_results, method):
    assert [r["rank"] for r in sharding_results] == [0, 1]
    for r in sharding_results:
        parity = r["parity"]
        assert parity["vs_single"][method] < 1e-10 * max(1.0, parity["scale"])  # five AdamW steps, float64


def test_zero1_holds_half_the_moments_as_the_memory_model_says(sharding_results):
    parity = sharding_results[0]["parity"]
    n, single = parity["parameters"], parity["optimizer_bytes"]["single"]
    assert single == n * 16  # two float64 moments per parameter, counted by hand
    predicted = state_bytes(n, "zero1", 2, FP64_ADAMW).optimizer
    for r in sharding_results:
        assert r["parity"]["optimizer_bytes"]["zero1"] == predicted  # equal slices: exactly ceil(n / 2) each
    for method in ("zero1_torch", "fsdp"):  # whole tensors or row blocks per rank: about half, together all
        held = [r["parity"]["optimizer_bytes"][method] for r in sharding_results]
        assert sum(held) == single and max(held) <= 0.6 * single
