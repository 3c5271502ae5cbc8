"""File modes under a chosen umask, and commands run as another user: what the shared-cache tests need."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# (umask, mode of a file, mode of a directory) as a plain open()/mkdir gives them, worked out by hand
UMASK_CASES = [pytest.param(0o022, 0o644, 0o755, id="umask022"), pytest.param(0o077, 0o600, 0o700, id="umask077")]


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    """Run the body under `mask`, then restore the previous umask."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(path: str | Path) -> dict[str, int]:
    """Permission bits of `path` (key '.') and of everything under it, keyed by relative path."""
    path = Path(path)
    return {str(p.relative_to(path)): p.lstat().st_mode & 0o777 for p in [path, *path.rglob("*")]}


def snapshot(path: str | Path) -> dict[str, tuple[int, int, int]]:
    """(mode, size, mtime in ns) of `path` and of everything under it: any write shows as a difference."""
    path = Path(path)
    return {
        str(p.relative_to(path)): (p.lstat().st_mode, p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in [path, *path.rglob("*")]
    }


def deny_access(monkeypatch: pytest.MonkeyPatch, path: str | Path, denied_mode: int) -> None:
    """Make os.access refuse `denied_mode` on `path` (as for another user), answer truly otherwise."""
    real = os.access

    def access(p, mode, *args, **kwargs):
        if os.path.abspath(p) == os.path.abspath(path) and mode & denied_mode:
            return False
        return real(p, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)


def _nobody_prefix() -> list[str]:
    user = pwd.getpwnam("nobody")
    if shutil.which("setpriv") is None:
        return []
    return ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]


def _drop_to_nobody() -> None:
    user = pwd.getpwnam("nobody")
    os.setgroups([])
    os.setgid(user.pw_gid)
    os.setuid(user.pw_uid)


def run_as_nobody(code: str, env: dict[str, str], cwd: str | Path) -> subprocess.CompletedProcess:
    """Run Python `code` as user nobody (setpriv, else setuid in the child) with this checkout's labkit."""
    prefix = _nobody_prefix()
    env = {**env, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run(
        [*prefix, sys.executable, "-c", code],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=None if prefix else _drop_to_nobody,
    )


def require_nobody() -> None:
    """Skip the test unless this process is root and user nobody exists and can import labkit here."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the test runs a process as user nobody, which only root can switch to")
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this system has no user 'nobody' to act as another user")
    probe = run_as_nobody("import labkit.assets", dict(os.environ), cwd="/")
    if probe.returncode != 0:
        pytest.skip(f"user nobody cannot run {sys.executable} with labkit: {probe.stderr.strip()[-300:]}")
