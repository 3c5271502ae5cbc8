"""The environment report: complete, JSON-able, honest about what a CPU machine lacks."""

import json

from labkit import env


def test_collect_reports_everything_the_issue_lists():
    info = env.collect()
    for key in ("os", "python", "packages", "torch_cuda", "cudnn", "nccl", "nvidia_driver", "gpus",
                "cpu", "ram_bytes", "cache", "assets", "profile"):
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
    info.update(cuda_available=True, torch_cuda="12.8", cudnn=91000, nccl="2.27.3", nvidia_driver="570.1",
                gpus=[{"index": 0, "name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0",
                       "memory_bytes": 80 * 2**30, "multiprocessors": 132, "bf16": True, "tf32": True,
                       "fp16_tensor_cores": True}])
    text = env.format_report(info)
    assert "NVIDIA H100 80GB HBM3, compute capability 9.0, 80.0 GiB, 132 SMs" in text
    assert "bf16 True" in text and "570.1" in text


def test_unwritable_cache_is_reported_not_raised(monkeypatch, tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("")
    monkeypatch.setenv("LABKIT_CACHE", str(blocker / "c"))
    info = env.collect()
    assert "not writable" in info["cache"]["error"]
    assert "not writable" in env.format_report(info)
