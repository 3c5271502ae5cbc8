"""labkit.precision: the loss-scale update equals torch's own, TF32 covers the whole step, and CUDA and
native bf16 are detected as the hardware is, with clear errors."""

from __future__ import annotations

import re

import pytest
import torch

from labkit import bench, flops, precision


def test_precision_policy_and_formats():
    fp16 = precision.policy("fp16", "cpu")  # autocast and GradScaler run on a CPU too (slowly without fp16 units)
    assert fp16.autocast_dtype == torch.float16 and fp16.use_scaler and fp16.scaler(7).get_growth_interval() == 7
    with pytest.raises(ValueError, match="TF32 needs"):
        precision.policy("tf32", "cpu")
    bf16 = precision.policy("bf16", "cpu")
    assert bf16.autocast_dtype == torch.bfloat16 and not bf16.use_scaler
    facts = {f["format"]: f for f in map(precision.format_facts, (torch.float32, torch.float16, torch.bfloat16))}
    assert facts["float16"]["max"] == 65504 and facts["float16"]["smallest subnormal"] == 2**-24
    assert facts["bfloat16"]["epsilon"] == 2**-7 and facts["bfloat16"]["exponent bits"] == 8
    assert facts["float32"]["mantissa bits"] == 23


def test_loss_scale_update_follows_torch_amp_step_by_step():
    flags = [False, False, True, False, False, False, False, True, True, False, False, False, False]
    scale, tracker = torch.tensor([65536.0]), torch.tensor([0], dtype=torch.int32)
    ours = (65536.0, 0)
    for found_inf in flags:
        torch._amp_update_scale_(scale, tracker, torch.tensor([float(found_inf)]), 2.0, 0.5, 3)
        ours = precision.update_loss_scale(*ours, found_inf, 2.0, 0.5, 3)
        assert ours == (scale.item(), tracker.item())
    assert ours[0] == 65536.0 * 0.5**3 * 2**2  # three overflows, two completed intervals of 3 good steps


def test_tf32_is_on_in_the_backward_too_and_restored_after():
    """Read the flag where the matmuls run: forward and backward hooks of a linear layer, inside a train step."""
    from labkit.models import tiny_llama
    from labkit.train import as_batch, train_step

    model = tiny_llama(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    seen = []
    layer = model.model.layers[0].mlp.down_proj
    layer.register_forward_hook(lambda *_: seen.append(("forward", torch.backends.cuda.matmul.allow_tf32)))
    layer.register_full_backward_hook(lambda *_: seen.append(("backward", torch.backends.cuda.matmul.allow_tf32)))
    # The policy as policy("tf32", "cuda") returns it; built by hand because this test runs on a CPU.
    tf32 = precision.Policy(mode="tf32", device_type="cpu", autocast_dtype=None, use_scaler=False, tf32=True)
    before = torch.backends.cuda.matmul.allow_tf32
    batch = as_batch((torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 8, dtype=torch.long)), torch.device("cpu"))
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), [batch], tf32, tf32.scaler(), None)
    assert seen == [("forward", True), ("backward", True)]
    assert torch.backends.cuda.matmul.allow_tf32 == before


def test_asking_for_cuda_without_it_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for cuda_build, message in ((None, "CPU-only build"), ("12.8", "built for CUDA 12.8) sees no GPU")):
        monkeypatch.setattr(torch.version, "cuda", cuda_build)
        with pytest.raises(ValueError, match=re.escape(message)) as err:
            precision.policy("bf16", "cuda")
        assert "this GPU" not in str(err.value)
        with pytest.raises(ValueError, match=re.escape(message)):
            bench.as_device("cuda")


@pytest.mark.parametrize("capability, native", [((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_bf16_counts_only_when_native(monkeypatch, capability, native):
    """A V100 (7.0) or T4 (7.5) runs bf16 by emulation, which torch.cuda.is_bf16_supported() counts."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert precision.native_bf16("cuda") is native
    assert (flops.dtype_support("cuda")["bf16"] is None) is native
    if native:
        assert precision.policy("bf16", "cuda").autocast_dtype == torch.bfloat16
    else:
        with pytest.raises(ValueError, match="no native bf16"):
            precision.policy("bf16", "cuda")
