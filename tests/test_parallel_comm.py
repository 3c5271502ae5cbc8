"""What the ranks send, counted on 2 gloo ranks under torchrun, against the arithmetic of each method: DDP all-reduces
every gradient once, compression halves it, ZeRO-1 adds the parameters' all-gather (broadcasts in torch's), FSDP2
all-gathers each block twice (forward and backward) and the root once, and reduce-scatters every gradient."""

from pathlib import Path

import pytest
import torch

from labkit.parallel import launch
from labkit.parallel.comm import compress_hook, count_collectives

SCRIPT = Path(__file__).parents[1] / "labs" / "scripts" / "comm_volume.py"


@pytest.fixture(scope="module")
def results():
    return launch.launch(SCRIPT, nproc=2, echo=None, timeout=300)


def test_each_method_sends_what_its_arithmetic_says(results):
    for r in results:
        n, blocks, steps = r["parameters"], r["block_parameters"], r["steps"]
        fp32 = 4  # bytes per gradient or parameter
        assert steps["ddp"] == {"all_reduce": fp32 * n, "calls:all_reduce": 1}  # one bucket at this size
        for kind in ("ddp_bfloat16", "ddp_float16", "ddp_float16_torch"):
            assert steps[kind]["all_reduce"] == 2 * n  # half the bytes
        assert steps["zero1"]["all_reduce"] == fp32 * n and steps["zero1"]["all_gather"] == fp32 * n // 2
        assert steps["zero1_torch"]["all_reduce"] == fp32 * n and steps["zero1_torch"]["broadcast"] == fp32 * n
        fsdp = steps["fsdp"]
        root = n - blocks  # embedding (tied to the head) and final norm: gathered once, kept for the backward
        assert fsdp["all_gather_single"] == fp32 * (2 * blocks + root) // 2  # each rank puts in its half
        assert fsdp["calls:all_gather_single"] == 1 + 2 * 2  # the root, and 2 blocks in forward and backward
        assert fsdp["reduce_scatter_single"] == fp32 * n and fsdp["calls:reduce_scatter_single"] == 3


def test_labkit_compression_hook_equals_torchs(results):
    assert all(r["fp16_hook_vs_torch"] == 0.0 for r in results)


def test_counting_restores_the_collectives_and_refuses_other_dtypes():
    import torch.distributed as dist

    before = dist.all_reduce
    with count_collectives() as counts:
        assert dist.all_reduce is not before
    assert dist.all_reduce is before and counts == {}
    with pytest.raises(ValueError, match="dtype"):
        compress_hook(torch.float32)
