"""What the ranks send, counted on 2 gloo ranks under torchrun (labs/scripts/sharding.py), against the arithmetic of
each method: DDP all-reduces every gradient once, compression halves it, ZeRO-1 adds the parameters' all-gather
(broadcasts in torch's), FSDP2 all-gathers each block twice (forward and backward) and the root once, and
reduce-scatters every gradient; and what compression does to a loss curve."""

import statistics

import pytest
import torch

from labkit.parallel.comm import compress_hook, count_collectives


def test_each_method_sends_what_its_arithmetic_says(sharding_results):
    for r in sharding_results:
        n, blocks, steps = r["parameters"], r["block_parameters"], r["traffic"]["steps"]
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


def test_labkit_compression_hook_equals_torchs(sharding_results):
    assert all(r["traffic"]["fp16_hook_vs_torch"] == 0.0 for r in sharding_results)


def test_compressed_gradients_still_train(sharding_results):
    curves = sharding_results[0]["compression"]
    assert all(curves[name] == sharding_results[1]["compression"][name] for name in curves)  # one mean per step

    def first(name):
        return statistics.mean(curves[name]["losses"][:3])

    def last(name):
        return statistics.mean(curves[name]["losses"][-5:])

    full = curves["none"]["bytes_per_step"]
    assert first("none") > 4.0 and last("none") < 0.5 * first("none")  # ln 128 = 4.85; the streams are learnable
    assert curves["bf16"]["bytes_per_step"] == full / 2
    assert abs(last("bf16") / last("none") - 1) < 0.05  # bf16 rounding: the same curve within 5 %
    for rank in (1, 4):  # a rank-r factor pair per matrix: a small share of the bytes, and still learning
        curve = curves[f"powersgd_{rank}"]
        assert curve["bytes_per_step"] < full / 8
        assert last(f"powersgd_{rank}") < 0.85 * first("none")
    assert curves["powersgd_1"]["bytes_per_step"] < curves["powersgd_4"]["bytes_per_step"]
    assert last("powersgd_4") < last("powersgd_1")  # a higher rank keeps more of the gradient


def test_counting_restores_the_collectives_and_refuses_other_dtypes():
    import torch.distributed as dist

    before = dist.all_reduce
    with count_collectives() as counts:
        assert dist.all_reduce is not before
    assert dist.all_reduce is before and counts == {}
    with pytest.raises(ValueError, match="dtype"):
        compress_hook(torch.float32)
