"""Activation memory: what checkpointing keeps and recomputes, counted against one block measured on its own."""

import pytest
import torch

from labkit import bench, precision
from labkit.activations import checkpointing_cost
from labkit.models import tiny_llama
from labkit.train import as_batch


def test_checkpointing_cost_measures_both_settings_and_gives_the_model_back():
    from labkit.torchutil import activation_checkpointing

    model = tiny_llama(vocab_size=128, num_layers=2).eval()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = as_batch((ids, ids), torch.device("cpu"))
    fp32 = precision.policy("fp32", "cpu")
    cost = checkpointing_cost(model, batch, fp32, repeats=2)
    assert set(cost) == {"off", "on"} and all(c["seconds"] > 0 and c["peak_bytes"] >= 0 for c in cost.values())
    assert not model.training and not activation_checkpointing(model)
    with pytest.raises(ValueError, match="repeats"):
        checkpointing_cost(model, batch, fp32, repeats=0)


def test_checkpointing_cost_counts_what_checkpoints_keep_and_recompute():
    """Checked against one block measured on its own: with checkpointing, the blocks hold their inputs (hidden
    states, rotary cos / sin, positions) and, during the backward, one block's activations at a time."""
    layers, batch_size, seq, hidden = 3, 2, 16, 64
    model = tiny_llama(vocab_size=128, hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2)
    ids = torch.randint(0, 128, (batch_size, seq), generator=torch.Generator().manual_seed(0))
    cost = checkpointing_cost(model, as_batch((ids, ids), torch.device("cpu")), precision.policy("fp32", "cpu"), 1)

    x = torch.randn(batch_size, seq, hidden, requires_grad=True)
    positions = torch.arange(seq)[None]
    cos, sin = model.model.rotary_emb(x, positions)
    with bench.saved_for_backward(exclude=model) as one_block:
        model.model.layers[0](x, position_embeddings=(cos, sin), position_ids=positions)
    rope = cos.untyped_storage().nbytes() + sin.untyped_storage().nbytes()
    assert cost["off"]["block_bytes"] == layers * one_block.bytes - (layers - 1) * rope  # cos / sin saved once
    inputs = layers * batch_size * seq * hidden * 4 + rope + positions.numel() * 8
    assert cost["on"]["block_bytes"] == inputs + one_block.bytes
    outside = {k: c["activation_bytes"] - c["block_bytes"] for k, c in cost.items()}
    assert outside["on"] == outside["off"] > batch_size * seq * 128 * 4  # the logits are never checkpointed
    assert cost["on"]["saved_bytes"] < cost["on"]["activation_bytes"]  # autograd's hooks miss the recomputation
