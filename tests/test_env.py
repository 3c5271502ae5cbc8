"""The environment report: complete, JSON-able, honest about what a CPU machine lacks."""

import json
import os
import pwd
import tempfile
from pathlib import Path

from labkit import env
from tests.permissions import deny_access, require_nobody, run_as_nobody


def test_collect_reports_everything_the_issue_lists():
    info = env.collect()
    for key in (
        "os",
        "python",
        "packages",
        "torch_cuda",
        "cudnn",
        "nccl",
        "nvidia_driver",
        "gpus",
        "cpu",
        "ram_bytes",
        "cache",
        "assets",
        "profile",
    ):
        assert key in info, key
    assert info["cpu"]["logical_cores"] >= 1 and info["ram_bytes"] > 0
    assert info["cache"]["free_bytes"] > 0
    assert set(info["assets"]) == {"model smollm2-135m", "corpus wiki"}
    json.dumps(info)


def test_cpu_report_says_gpu_checks_are_skipped(monkeypatch):
    info = env.collect()
    info.update(cuda_available=False, gpus=[], torch_cuda=None)
    text = env.format_report(info)
    assert "GPU" in text and "skipped" in text and "CPU build" in text


def test_gpu_report_shows_each_gpu():
    info = env.collect()
    info.update(
        cuda_available=True,
        torch_cuda="12.8",
        cudnn=91000,
        nccl="2.27.3",
        nvidia_driver="570.1",
        gpus=[
            {
                "index": 0,
                "name": "NVIDIA H100 80GB HBM3",
                "compute_capability": "9.0",
                "memory_bytes": 80 * 2**30,
                "multiprocessors": 132,
                "bf16": True,
                "tf32": True,
                "fp16_tensor_cores": True,
            }
        ],
    )
    text = env.format_report(info)
    assert "NVIDIA H100 80GB HBM3, compute capability 9.0, 80.0 GiB, 132 SMs" in text
    assert "bf16 True" in text and "570.1" in text


def test_fingerprint_and_banner_name_the_machine(monkeypatch):
    import platform

    import torch

    from labkit import bench

    fp = env.fingerprint("smoke")
    assert fp["profile"] == "smoke" and fp["cpu"] == bench.cpu_model() and fp["logical_cores"] == os.cpu_count()
    assert fp["packages"]["torch"] == torch.__version__ and fp["os"] == platform.platform()
    assert fp["gpus"] == [] or torch.cuda.is_available()
    monkeypatch.setattr(env, "cpu_features", lambda: {"avx2": True, "avx512f": False, "amx_bf16": True})
    line = env.banner("cpu", "cpu")
    assert line.startswith("labkit 0.1.0 | profile 'cpu' | ran on CPU: ") and "[amx_bf16/avx2]" in line
    assert f"torch {torch.__version__}" in line and line.endswith(" UTC")
    monkeypatch.setattr(env, "cpu_features", lambda: {})
    assert "[no AVX2]" in env.banner("cpu", "cpu")


def test_unwritable_cache_is_reported_not_raised(monkeypatch, tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("")
    monkeypatch.setenv("LABKIT_CACHE", str(blocker / "c"))
    info = env.collect()
    assert "not writable" in info["cache"]["error"]
    assert "not writable" in env.format_report(info)


def test_an_unreadable_file_in_the_cache_is_named_with_the_fix(tmp_cache, monkeypatch):
    weights = tmp_cache / "models" / "m" / "model.safetensors"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"x")
    deny_access(monkeypatch, weights, os.R_OK)
    user = pwd.getpwuid(os.getuid()).pw_name
    info = env.collect()
    expected = f"cache {weights} is not readable by user {user}: ask the instructor to run chmod -R a+rX {weights}"
    assert info["cache"]["error"] == expected
    report = env.format_report(info).splitlines()
    assert any(line.startswith("Cache ") and line.endswith(expected) for line in report)


def test_a_model_to_convert_in_a_read_only_cache_is_named_with_the_fix(tmp_cache, monkeypatch):
    tmp_cache.mkdir()
    deny_access(monkeypatch, tmp_cache, os.W_OK)
    user = pwd.getpwuid(os.getuid()).pw_name
    info = env.collect()
    expected = (
        f"not converted yet, and cache {tmp_cache} is not writable by user {user}: ask the "
        "instructor to run `labkit prepare` for this cache, or use a cache of your own: "
        "export LABKIT_CACHE=$HOME/labkit-cache"
    )
    assert info["cache"]["error"] is None
    assert info["assets"]["model smollm2-135m"] == expected
    assert expected in env.format_report(info)


NOBODY_DOCTOR = "from labkit import env; print(env.format_report(env.collect()))"


def test_doctor_run_by_another_user_names_what_it_cannot_read_or_write():
    require_nobody()
    with tempfile.TemporaryDirectory() as top:  # under /tmp: pytest's tmp_path is private to root
        os.chmod(top, 0o755)
        cache = Path(top, "cache")
        (cache / "models").mkdir(parents=True, mode=0o755)
        secret = cache / "models" / "notes.txt"
        secret.write_text("staged by hand")
        secret.chmod(0o600)
        result = run_as_nobody(NOBODY_DOCTOR, {**os.environ, "LABKIT_CACHE": str(cache)}, cwd=top)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"cache {secret} is not readable by user nobody: ask the instructor to run chmod -R a+rX {secret}"
    ) in result.stdout
    assert (
        f"not converted yet, and cache {cache}/models is not writable by user nobody: "
        "ask the instructor to run `labkit prepare` for this cache"
    ) in result.stdout
