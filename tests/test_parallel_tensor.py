"""Tensor parallelism: the Megatron-split MLP on 2 gloo ranks equals the unsplit one, with half the weights each."""

from pathlib import Path

import pytest
import torch

from labkit.parallel import launch, tensor

SCRIPT = Path(__file__).parents[1] / "labs" / "scripts" / "tensor_parallel.py"


def test_tensor_parallel_mlp_equals_the_unsplit_one():
    res = launch.launch(SCRIPT, nproc=2, echo=None, timeout=120)
    for r in res:
        assert r["max_diff"] < 1e-5
        assert r["shard_params"] < 0.51 * r["full_params"]  # each rank holds about half the weights
    with pytest.raises(ValueError, match="does not split evenly"):
        tensor.megatron_mlp_shard(torch.nn.Linear(4, 6), torch.nn.Linear(6, 4), 0, 4)
