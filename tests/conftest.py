"""Shared fixtures. Every test runs offline: Hugging Face offline mode plus a socket guard that
refuses any connection outside the loopback interface, so a test that reaches for the network fails."""

from __future__ import annotations

import ipaddress
import os
import socket

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("LABKIT_PROFILE", "smoke")


class NetworkAccessError(RuntimeError):
    """Raised by the socket guard: the course must never need the network."""


def _is_local(address) -> bool:
    if isinstance(address, (str, bytes)):  # AF_UNIX path
        return True
    host = address[0]
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname other than localhost would need DNS


_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex


def _guarded(real):
    def connect(self, address):
        if not _is_local(address):
            raise NetworkAccessError(f"test tried to reach {address!r}; labkit must work offline")
        return real(self, address)

    return connect


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Refuse non-loopback connections and DNS lookups for the duration of every test."""
    monkeypatch.setattr(socket.socket, "connect", _guarded(_real_connect))
    monkeypatch.setattr(socket.socket, "connect_ex", _guarded(_real_connect_ex))
    real_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if host not in (None, "localhost") and not _is_local((host,)):
            raise NetworkAccessError(f"test tried to resolve {host!r}; labkit must work offline")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.fixture(scope="session")
def default_model():
    """The offline default model and tokenizer, loaded once per test session."""
    from labkit.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """An empty, private labkit cache directory."""
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="session")
def dp_parity_results():
    """labs/scripts/dp_parity.py on 2 ranks, run once for the data-parallel and ring tests: (results, log lines)."""
    from pathlib import Path

    from labkit.parallel import launch

    lines = []
    res = launch.launch(
        Path(__file__).parents[1] / "labs" / "scripts" / "dp_parity.py", nproc=2, echo=lines.append, timeout=180
    )
    return res, lines


# the sizes tests/test_parallel_{zero,comm,fsdp}.py launch labs/scripts/sharding.py with: small enough for seconds,
# every dimension even (equal shards), a vocabulary the compression curves learn in 30 steps
SHARDING_ARGS = ["--vocab=128", "--hidden=128", "--layers=2", "--batch=4", "--seq=32", "--steps=30", "--lr=1e-2"]


@pytest.fixture(scope="session")
def sharding_results():
    """labs/scripts/sharding.py on 2 ranks, every part, run once for the ZeRO, communication and FSDP tests."""
    from pathlib import Path

    from labkit.parallel import launch

    script = Path(__file__).parents[1] / "labs" / "scripts" / "sharding.py"
    return launch.launch(script, nproc=2, args=[*SHARDING_ARGS, "--repeats", "1"], echo=None, timeout=300)


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama (labkit.models.tiny_llama), one per test module: the calibration and quantization tests'."""
    from labkit.models import tiny_llama

    return tiny_llama()


@pytest.fixture(scope="module")
def calibration():
    """Eight windows of 64 random token ids for `tiny`, the same in every module (seed 0)."""
    import torch

    return torch.randint(2, 512, (8, 64), generator=torch.Generator().manual_seed(0))
