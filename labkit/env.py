"""The environment report behind lab 00 and `labkit doctor`: what this machine can and cannot do."""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from typing import Any

import psutil
import torch

import labkit
from labkit import assets, profiles
from labkit.bench import cpu_model, device_name, fmt_bytes


def cpu_features() -> dict[str, bool]:
    """Instruction-set features that decide CPU matmul speed per dtype (Linux x86; empty elsewhere)."""
    try:
        flags = next(
            set(line.split(":", 1)[1].split())
            for line in open("/proc/cpuinfo", encoding="utf-8", errors="replace")
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return {}
    names = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")
    return {n: n in flags for n in names}


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _nvidia_driver() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def gpus() -> list[dict[str, Any]]:
    """Every visible CUDA GPU with its capability, memory and precision support."""
    found = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        found.append(
            {
                "index": i,
                "name": p.name,
                "compute_capability": f"{p.major}.{p.minor}",
                "memory_bytes": p.total_memory,
                "multiprocessors": p.multi_processor_count,
                "bf16": p.major >= 8,
                "tf32": p.major >= 8,
                "fp16_tensor_cores": p.major >= 7,
            }
        )
    return found


def collect() -> dict[str, Any]:
    """Everything the course needs to know about this machine, as one JSON-able dict."""
    cuda = torch.cuda.is_available()
    nccl = None
    if cuda and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError):
            nccl = None
    try:
        cache = assets.cache_dir()
        denied = assets.read_access_problem(cache)  # a shared cache staged without a+rX, say
        free = None if denied else shutil.disk_usage(cache).free
        cache_info = {"path": str(cache), "free_bytes": free, "error": denied}
    except assets.AssetError as err:
        cache_info = {"path": None, "free_bytes": None, "error": str(err)}
    vm = psutil.virtual_memory()
    return {
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "packages": {n: _package_version(n) for n in ("torch", "transformers", "labkit", "numpy")},
        "torch_cuda": torch.version.cuda,
        "torch_hip": getattr(torch.version, "hip", None),
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": nccl,
        "nvidia_driver": _nvidia_driver() if cuda else None,
        "cuda_available": cuda,
        "gpus": gpus() if cuda else [],
        "mps_available": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()),
        "cpu": {
            "model": cpu_model(),
            "logical_cores": os.cpu_count(),
            "physical_cores": psutil.cpu_count(logical=False),
            "torch_threads": torch.get_num_threads(),
            "features": cpu_features(),
        },
        "ram_bytes": vm.total,
        "ram_available_bytes": vm.available,
        "cache": cache_info,
        "assets": {
            **{f"model {n}": assets.offline_model_status(n) for n in assets.OFFLINE_MODELS},
            "corpus wiki": _corpus_status(),
        },
        "profile": profiles.get_profile().name,
    }


def fingerprint(profile: str) -> dict[str, Any]:
    """The machine and software a run is on: CPU and its vector features, GPUs and driver, versions, date, profile.
    `labcourse execute` stores it in each notebook it writes; `banner` prints it as every lab's first line."""
    cuda = torch.cuda.is_available()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "profile": profile,
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "cpu_features": sorted(k for k, v in cpu_features().items() if v),
        "gpus": [g["name"] for g in gpus()] if cuda else [],
        "nvidia_driver": _nvidia_driver() if cuda else None,
        "packages": {"labkit": labkit.__version__, **{n: _package_version(n) for n in ("torch", "transformers")}},
        "os": platform.platform(),
    }


def banner(profile: str, device: str | torch.device | None = None) -> str:
    """Every lab's first line: labkit, the profile, the device with the CPU's vector features, torch, the date."""
    fp = fingerprint(profile)
    features = "/".join(fp["cpu_features"]) or "no AVX2"
    return (
        f"labkit {fp['packages']['labkit']} | profile {profile!r} | ran on {device_name(device)} [{features}] | "
        f"torch {fp['packages']['torch']} | {fp['date']}"
    )


def _corpus_status() -> str:
    try:
        assets.WIKI_SUMMARIES.path()
    except assets.AssetError as err:
        return str(err).replace("\n", " ")
    return "ready"


def format_report(info: dict[str, Any]) -> str:
    """The report as aligned text, GPU-only facts marked as such on a CPU machine."""
    cpu = info["cpu"]
    feats = ", ".join(k for k, v in cpu["features"].items() if v) or "unknown"
    rows = [
        ("OS", info["os"]),
        ("Python", info["python"]),
        ("Packages", ", ".join(f"{k} {v}" for k, v in info["packages"].items() if v)),
        (
            "CPU",
            f"{cpu['model']}: {cpu['logical_cores']} logical / {cpu['physical_cores']} physical cores, "
            f"torch uses {cpu['torch_threads']} threads",
        ),
        ("CPU features", feats),
        ("RAM", f"{fmt_bytes(info['ram_bytes'])} total, {fmt_bytes(info['ram_available_bytes'])} available"),
    ]
    if info["cuda_available"]:
        rows += [
            ("CUDA (torch build)", info["torch_cuda"]),
            ("cuDNN", info["cudnn"]),
            ("NCCL", info["nccl"]),
            ("NVIDIA driver", info["nvidia_driver"]),
        ]
        for g in info["gpus"]:
            rows.append(
                (
                    f"GPU {g['index']}",
                    f"{g['name']}, compute capability {g['compute_capability']}, "
                    f"{fmt_bytes(g['memory_bytes'])}, {g['multiprocessors']} SMs",
                )
            )
            rows.append(
                (
                    f"GPU {g['index']} precisions",
                    f"fp16 tensor cores {g['fp16_tensor_cores']}, bf16 {g['bf16']}, tf32 {g['tf32']}",
                )
            )
    else:
        why = f"torch {torch.__version__} is a CPU build" if info["torch_cuda"] is None else "no GPU visible"
        rows.append(("GPU", f"none: {why}; CUDA, cuDNN, NCCL, driver and GPU precisions are skipped"))
        if info["mps_available"]:
            rows.append(("Apple GPU", "MPS available"))
    cache = info["cache"]
    rows.append(("Cache", cache["error"] or f"{cache['path']} ({fmt_bytes(cache['free_bytes'])} free)"))
    rows += [(f"Asset: {k}", v) for k, v in info["assets"].items()]
    rows.append(("Profile", f"{info['profile']} (set LABKIT_PROFILE to smoke, cpu or gpu to override)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
