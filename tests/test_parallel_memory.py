"""labkit.parallel.memory: ZeRO's per-rank arithmetic, against the paper's own figures and hand counts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from labkit.parallel.memory import (
    FP32,
    MIXED,
    STRATEGIES,
    DtypePolicy,
    activation_bytes,
    gathered_bytes,
    largest_model,
    state_bytes,
)


def test_the_zero_papers_figure_1():
    """Rajbhandari et al. (2020), Figure 1: Ψ = 7.5 B, K = 12, N_d = 64 -> 120 / 31.4 / 16.6 / 1.9 GB per device."""
    psi = 7_500_000_000
    gb = {s: state_bytes(psi, s, 64, MIXED).state / 1e9 for s in STRATEGIES}
    assert gb["ddp"] == 120.0
    assert gb["zero1"] == pytest.approx(31.4, abs=0.05)
    assert gb["zero2"] == pytest.approx(16.6, abs=0.05)
    assert gb["zero3"] == pytest.approx(1.9, abs=0.05)


def test_fp32_adamw_by_hand():
    """1000 parameters on 3 ranks in fp32: 4 + 4 + 8 bytes each, shards of ceil(1000 / 3) = 334."""
    assert state_bytes(1000, "ddp", 3) == state_bytes(1000, "ddp", 1)
    assert (state_bytes(1000, "ddp", 3).parameters, state_bytes(1000, "ddp", 3).optimizer) == (4000, 8000)
    z1, z2, z3 = (state_bytes(1000, s, 3) for s in ("zero1", "zero2", "zero3"))
    assert (z1.parameters, z1.gradients, z1.optimizer) == (4000, 4000, 334 * 8)
    assert (z2.parameters, z2.gradients, z2.optimizer) == (4000, 334 * 4, 334 * 8)
    assert (z3.parameters, z3.gradients, z3.optimizer) == (334 * 4, 334 * 4, 334 * 8)


def test_offload_moves_the_zero3_state_to_the_host():
    on_device, offloaded = state_bytes(1000, "zero3", 2), state_bytes(1000, "zero3", 2, offload=True)
    assert offloaded.state == 0 and offloaded.offloaded == on_device.state == 500 * 16
    with pytest.raises(ValueError, match="offload"):
        state_bytes(1000, "zero1", 2, offload=True)


@given(
    n=st.integers(0, 10**12),
    world=st.integers(1, 4096),
    policy=st.sampled_from([FP32, MIXED, DtypePolicy(param=2, grad=4, master=0, optimizer=4)]),
)
def test_each_stage_holds_no_more_than_the_one_before_and_the_shards_cover_the_model(n, world, policy):
    held = [state_bytes(n, s, world, policy).state for s in STRATEGIES]
    assert held == sorted(held, reverse=True)
    per_param = policy.param + policy.grad + policy.master + policy.optimizer
    assert held[0] == n * per_param
    assert world * held[-1] >= n * per_param > world * (held[-1] - per_param)  # shards of ceil(n / world)


def test_activation_checkpointing_keeps_block_inputs_and_one_block():
    """12 blocks, 100 tokens, 1000 bytes per token per block, inputs of 64 bytes, 50 outside the blocks."""
    kept = activation_bytes(1000, 100, 12, outside_blocks_per_token=50)
    assert kept == 100 * (12 * 1000 + 50)
    checkpointed = activation_bytes(
        1000, 100, 12, checkpointing=True, block_input_per_token=64, outside_blocks_per_token=50
    )
    assert checkpointed == 100 * (12 * 64 + 1000 + 50)


def test_gathered_units_count_parameters_for_compute_and_prefetch_and_one_gradient():
    assert gathered_bytes(1000, FP32, prefetch=1) == 1000 * (4 * 2 + 4)
    assert gathered_bytes(1000, MIXED, prefetch=0) == 1000 * (2 + 2)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", [1, 2, 8])
def test_largest_model_is_the_inverse_of_state_bytes(strategy, world):
    budget, reserved = 80 * 2**30, 10 * 2**30
    n = largest_model(budget, strategy, world, MIXED, reserved_bytes=reserved)
    assert state_bytes(n, strategy, world, MIXED).state <= budget - reserved
    assert state_bytes(n + world, strategy, world, MIXED).state > budget - reserved


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="strategy"):
        state_bytes(10, "zero4", 2)
    with pytest.raises(ValueError, match="world"):
        state_bytes(10, "ddp", 0)
    with pytest.raises(ValueError, match="n_params"):
        state_bytes(-1, "ddp", 2)
    with pytest.raises(ValueError, match="master"):
        DtypePolicy(master=-4)
    with pytest.raises(ValueError, match="tokens"):
        activation_bytes(10, 2.5, 3)


def test_held_bytes_counts_a_tied_weight_once_and_the_optimizer_moments():
    import torch

    from labkit.models import tiny_llama
    from labkit.parallel.memory import held_bytes

    model = tiny_llama()  # embedding and LM head tied: one tensor
    unique = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    optimizer = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    held = held_bytes(model, optimizer)
    assert (held.parameters, held.gradients, held.optimizer) == (4 * unique, 4 * unique, 8 * unique)
    # the same tensors, for a rank that computes on a GPU: all in host memory, so all offloaded (CPUOffloadPolicy)
    away = held_bytes(model, optimizer, device="cuda")
    assert (away.parameters, away.gradients, away.optimizer, away.offloaded) == (0, 0, 0, 16 * unique)
    assert held_bytes(model, optimizer, device="cpu") == held
