"""Tensor parallelism on 2 gloo ranks: the Megatron-split MLP equals the unsplit one with half the weights each; a
SmolLM2-shaped Llama decoder block split by labkit's Megatron shard and by torch's DTensor equals the unsplit block
forward and backward (float64), with the all-reduces and the parameters per rank counted by hand."""

from pathlib import Path

import pytest
import torch

from labkit.models import tiny_llama
from labkit.parallel import launch, tensor

SCRIPT = Path(__file__).parents[1] / "labs" / "scripts" / "tensor_parallel.py"
SPLITS = ["megatron", "dtensor", "dtensor_unshared"]


@pytest.fixture(scope="module")
def results():
    return launch.launch(SCRIPT, nproc=2, echo=None, timeout=300)


def test_tensor_parallel_mlp_equals_the_unsplit_one(results):
    for r in results:
        assert r["max_diff"] < 1e-5
        assert r["shard_params"] < 0.51 * r["full_params"]  # each rank holds about half the weights
    with pytest.raises(ValueError, match="does not split evenly"):
        tensor.megatron_mlp_shard(torch.nn.Linear(4, 6), torch.nn.Linear(6, 4), 0, 4)


@pytest.mark.parametrize("split", SPLITS)
def test_split_block_equals_the_unsplit_one_forward_and_backward(results, split):
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        s = r[split]
        assert s["out"] < 1e-10 and s["input_grad"] < 1e-10
        assert len(s["weight_grads"]) == 9  # q k v o, gate up down, two norms
        assert max(s["weight_grads"].values()) < 1e-10


def test_block_all_reduces_as_counted_by_hand(results):
    b = results[0]["block"]
    activation = b["batch"] * b["seq"] * b["hidden"] * 8  # one float64 batch x seq x hidden tensor
    megatron = {"all_reduce": 2 * activation, "calls:all_reduce": 2}  # g twice forward, f twice backward
    dtensor = {"c10d_functional.all_reduce": 2}
    for r in results:
        assert r["megatron_collectives"] == {"forward": megatron, "backward": megatron}
        assert r["dtensor_collectives"] == {"forward": dtensor, "backward": dtensor}
        # without one shared replicated input, q, k, v, gate and up each all-reduce their own input gradient
        assert r["dtensor_unshared_collectives"] == {"forward": dtensor, "backward": {"c10d_functional.all_reduce": 5}}


def test_each_rank_holds_half_the_linear_weights_and_whole_norms(results):
    b = results[0]["block"]
    hidden, q, kv = b["hidden"], b["heads"] * b["head_dim"], b["kv_heads"] * b["head_dim"]
    linear = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * b["intermediate"]
    norms = 2 * hidden
    assert results[0]["block_full_params"] == linear + norms
    for r in results:
        for split in SPLITS:
            assert r[split]["params"] == linear // 2 + norms


def _block(heads: int = 4, kv_heads: int = 2, intermediate: int = 24) -> torch.nn.Module:
    """The first decoder layer of a tiny Llama with hidden size 16 (head_dim 4 at 4 heads)."""
    model = tiny_llama(hidden_size=16, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=intermediate)
    return model.model.layers[0]


@pytest.mark.parametrize(
    "block, world, message",
    [
        (dict(heads=2, kv_heads=1), 2, r"num_key_value_heads \(1\) does not divide by world \(2\)"),
        (dict(heads=4, kv_heads=2), 3, r"num_attention_heads \(4\) does not divide by world \(3\)"),
        (dict(intermediate=25), 2, r"intermediate_size \(25\) does not divide by world \(2\)"),
        (dict(), 0, r"world must be an int >= 1"),
    ],
)
def test_a_block_that_does_not_split_is_refused(block, world, message):
    with pytest.raises(ValueError, match=message):
        tensor.megatron_block_shard(_block(**block), 0, world)


def test_bad_rank_biases_and_modules_are_refused():
    with pytest.raises(ValueError, match="0 <= rank < world"):
        tensor.megatron_block_shard(_block(), 2, 2)
    biased = _block()
    biased.self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(16))
    with pytest.raises(ValueError, match="have a bias: self_attn.o_proj"):
        tensor.megatron_block_shard(biased, 0, 2)
    with pytest.raises(TypeError, match="LlamaDecoderLayer"):
        tensor.megatron_block_shard(torch.nn.Linear(4, 4), 0, 2)


def test_the_shard_slices_whole_heads_and_leaves_the_block_alone():
    block = _block()
    before = {name: p.clone() for name, p in block.state_dict().items()}
    shard = tensor.megatron_block_shard(block, 1, 2)
    head_dim = 4  # hidden 16 over 4 heads
    assert torch.equal(shard.self_attn.q_proj.weight, block.self_attn.q_proj.weight[2 * head_dim :])  # heads 2, 3
    assert torch.equal(shard.self_attn.k_proj.weight, block.self_attn.k_proj.weight[head_dim:])  # KV head 1
    assert torch.equal(shard.self_attn.o_proj.weight, block.self_attn.o_proj.weight[:, 2 * head_dim :])
    assert torch.equal(shard.mlp.down_proj.weight, block.mlp.down_proj.weight[:, 12:])
    assert all(torch.equal(p, before[name]) for name, p in block.state_dict().items())
