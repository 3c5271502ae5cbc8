"""The ring all-reduce: built from point-to-point sends on 2 gloo ranks it equals the library's all-reduce;
simulated in one process it leaves the sum on every rank, one chunk per step."""

import pytest
import torch

from labkit.parallel import ring
from tests.numerics import assert_within, reorder_bound


def test_ring_all_reduce_from_sends_equals_the_library_all_reduce(dp_parity_results):
    res, _ = dp_parity_results
    for r in res:
        assert r["ring_elements"] == 1001 and r["ring_vs_all_reduce"] < 1e-12


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_simulated_ring_leaves_the_sum_on_every_rank(world):
    tensors = [torch.randn(7, 3, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    total = torch.stack(tensors).sum(0)
    bound = reorder_bound(world, torch.stack(tensors).abs().sum(0))  # the ring adds in another order
    for out in ring.simulate_ring_all_reduce(tensors):
        assert out.shape == (7, 3)
        assert_within(out, total, bound)


def test_ring_steps_send_each_chunk_once_per_phase():
    world = 4
    for phase in (range(0, world - 1), range(world - 1, 2 * (world - 1))):
        for rank in range(world):
            sent = [ring.ring_send_chunk(rank, world, s) for s in phase]
            assert len(set(sent)) == world - 1  # p − 1 different chunks: 2(p − 1)/p of the data in all
    with pytest.raises(ValueError, match="steps 0..5"):
        ring.ring_send_chunk(0, world, 6)


def test_after_reduce_scatter_rank_r_holds_the_sum_of_chunk_r_plus_1():
    world = 3
    chunks = [[torch.tensor([float(10 * r + c)]) for c in range(world)] for r in range(world)]
    for step in range(world - 1):
        chunks = ring.ring_step(chunks, step)
    for r in range(world):
        c = (r + 1) % world
        assert chunks[r][c].item() == sum(10 * q + c for q in range(world))


def test_simulated_ring_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="same shape"):
        ring.simulate_ring_all_reduce([torch.zeros(3), torch.zeros(4)])
