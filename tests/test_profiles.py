"""Profiles: one table, env override, auto-detection, clear error on a typo."""

import dataclasses

import pytest

from labkit import profiles


def test_env_var_overrides_detection(monkeypatch):
    monkeypatch.setenv("LABKIT_PROFILE", "GPU")
    assert profiles.get_profile().name == "gpu"


def test_argument_beats_env(monkeypatch):
    monkeypatch.setenv("LABKIT_PROFILE", "gpu")
    assert profiles.get_profile("smoke").name == "smoke"


def test_auto_detects_cpu_without_cuda(monkeypatch):
    import torch

    monkeypatch.delenv("LABKIT_PROFILE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert profiles.get_profile().name == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert profiles.get_profile().name == "gpu"


def test_unknown_profile_lists_choices(monkeypatch):
    monkeypatch.setenv("LABKIT_PROFILE", "fast")
    with pytest.raises(ValueError, match=r"unknown profile 'fast' \(from \$LABKIT_PROFILE\).*smoke, cpu, gpu"):
        profiles.get_profile()


def test_sizes_grow_from_smoke_to_gpu():
    smoke, cpu, gpu = (profiles.PROFILES[n] for n in ("smoke", "cpu", "gpu"))
    for f in dataclasses.fields(profiles.Profile):
        if f.type == "int":
            assert getattr(smoke, f.name) <= getattr(cpu, f.name) <= getattr(gpu, f.name), f.name
    assert max(smoke.matmul_sizes) < max(cpu.matmul_sizes) < max(gpu.matmul_sizes)


def test_describe_lists_every_size():
    text = profiles.describe(profiles.PROFILES["cpu"])
    for f in dataclasses.fields(profiles.Profile)[2:]:
        assert f.name in text


@pytest.mark.parametrize("name", list(profiles.PROFILES))
def test_gptq_calibration_gives_the_default_model_a_well_conditioned_hessian(name):
    """Lab 07 and 08 quantize SmolLM2, whose widest decoder layer (down_proj) has 1536 inputs."""
    from labkit import quant

    p = profiles.PROFILES[name]
    assert p.calibration_blocks * p.calibration_block_size >= quant.TOKENS_PER_INPUT * 1536
