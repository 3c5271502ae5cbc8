"""Files and directories that are whole or absent: written under a temporary name and renamed into place, never
over what labkit did not write, a full disk named with the path, and checked whole by a manifest of digests.

A directory is replaced only where labkit wrote it (its marker or manifest inside) or where nothing is; what a
killed build left is removed by the next build of the same directory; written files and directories get the
modes the umask gives (not the 0600 of mkstemp or safetensors), so a shared course cache stays usable.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from labkit import __version__

MANIFEST = "labkit-manifest.json"
OUTPUT_MARKER = "labkit-output.txt"  # left in every directory atomic_directory writes: labkit may replace it
STALE_SECONDS = 24 * 3600  # a temporary whose owner cannot be asked counts as abandoned after a day untouched


# ----------------------------------------------------------------------------- atomic writes


def current_umask() -> int:
    """This process's umask, read from /proc where possible: os.umask can only set it (process-wide, racy)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)  # set and restore; a file another thread creates meanwhile is private, not public
    os.umask(mask)
    return mask


def apply_umask(path: str | Path) -> None:
    """Give `path` and everything under it the modes a plain open()/mkdir would have (0o666/0o777 minus the
    umask; executables keep their x bits): mkstemp, mkdtemp and safetensors make private 0600/0700 entries,
    which a shared course cache cannot use. Symbolic links are left alone."""
    mask = current_umask()
    path = Path(path)
    files = [path] if not path.is_dir() else []
    for root, _, names in os.walk(path):  # does not follow symbolic links
        os.chmod(root, 0o777 & ~mask)
        files += [Path(root, n) for n in names]
    for f in files:
        if not f.is_symlink():
            os.chmod(f, (0o777 if f.stat().st_mode & 0o111 else 0o666) & ~mask)


class DiskFullError(OSError):
    """A write found its filesystem full: names the destination and the space left, so that the fix is plain."""

    def __init__(self, path: str | Path) -> None:
        existing = Path(path).absolute()
        while not existing.exists():
            existing = existing.parent
        self.free_mib = shutil.disk_usage(existing).free / 2**20
        super().__init__(
            errno.ENOSPC, f"No space left on device ({self.free_mib:.1f} MiB free on that filesystem)", str(path)
        )

    def __str__(self) -> str:
        return f"disk full while writing {self.filename}: {self.free_mib:.1f} MiB free on that filesystem"


def _is_disk_full(err: BaseException | None) -> bool:
    """Whether `err`, or an error it came from, is a full disk: ENOSPC, or safetensors' SafetensorError (no errno)."""
    while err is not None:
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
        if type(err).__name__ == "SafetensorError" and re.search(r"No space left|StorageFull|os error 28", str(err)):
            return True
        err = err.__cause__ or err.__context__
    return False


@contextlib.contextmanager
def _disk_full_names(path: Path, temporary: Path) -> Iterator[None]:
    """Turn a full disk inside the block into a DiskFullError naming `path`, once `temporary` is removed."""
    try:
        yield
    except Exception as err:
        if not _is_disk_full(err):
            raise
        if temporary.is_dir():
            shutil.rmtree(temporary, ignore_errors=True)
        else:
            temporary.unlink(missing_ok=True)
        raise DiskFullError(path) from err


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` through a temporary file and a rename: never a half-written file (a full disk is a
    DiskFullError naming `path`, the old file intact)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with _disk_full_names(path, Path(tmp)):
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            apply_umask(tmp)
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Text version of atomic_write_bytes (UTF-8)."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def destination_problem(
    dest: str | Path, source: str | Path | None = None, legacy: Callable[[Path], bool] | None = None
) -> str | None:
    """None if atomic_directory may replace `dest`, else why not and what to do: it replaces only a missing or empty
    directory or one labkit wrote (its OUTPUT_MARKER or MANIFEST inside, or, for a directory from before the marker,
    `legacy(dest)` true), never the current directory, nor `source` (what the build reads) or a directory holding it."""
    dest = Path(dest).absolute()
    real, cwd = dest.resolve(), Path.cwd().resolve()
    if dest.exists() and not dest.is_dir():
        return f"{dest} is a file: a directory is to be written there, and the file is left as it is"
    if real == cwd or real in cwd.parents:
        return f"{dest} is or holds the current directory, which writing it would replace: give a new or empty one"
    if source is not None and (real == Path(source).resolve() or real in Path(source).resolve().parents):
        return f"{dest} is or holds {source}, which this build reads: give a directory outside it"
    names = sorted(p.name for p in dest.iterdir()) if dest.is_dir() else []
    if not names or OUTPUT_MARKER in names or MANIFEST in names or (legacy is not None and legacy(dest)):
        return None
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return (
        f"{dest} holds files labkit did not write ({shown}), which writing there would delete: "
        "move them away, or give a new or empty directory"
    )


def _owner() -> str:
    """Who writes a temporary: pid@host, in its name, so that a later build can tell a killed one from a live one."""
    return f"{os.getpid()}@{socket.gethostname()}"


def _new_temporary(dest: Path) -> Path:
    """A fresh private directory beside `dest`: .NAME.RANDOM.PID@HOST.tmp."""
    return Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=f".{_owner()}.tmp"))


# a temporary's name after .NAME.: RANDOM.PID@HOST.tmp, or RANDOM.tmp from a labkit before owners were named
_TEMPORARY = re.compile(r"[a-z0-9_]+\.(?:(\d+)@([^@/]+)\.)?tmp")


def _abandoned(path: Path, pid: str | None, host: str | None) -> bool:
    """Whether the temporary `path` is left from a killed build: its owner process on this host is gone; one that
    another host (or an older labkit, which named no owner) writes, once untouched for STALE_SECONDS."""
    if pid is not None and host == socket.gethostname() and os.name == "posix":
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False
    return time.time() - path.stat().st_mtime > STALE_SECONDS


def remove_leftovers(dest: str | Path) -> list[Path]:
    """Delete the temporaries that killed builds of `dest` left beside it, never one a live build is writing;
    return what was removed."""
    dest = Path(dest)
    prefix = f".{dest.name}."
    removed = []
    for path in sorted(dest.parent.glob(glob.escape(prefix) + "*.tmp")):
        name = _TEMPORARY.fullmatch(path.name[len(prefix) :])
        if name is not None and path.is_dir() and _abandoned(path, *name.groups()):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _swap(new: Path, dest: Path) -> None:
    """Put `new` at `dest`: an old `dest` is renamed aside, and deleted only once `new` is in its place."""
    if not dest.exists():
        os.replace(new, dest)
        return
    aside = _new_temporary(dest)
    os.replace(dest, aside)
    try:
        os.replace(new, dest)
    except OSError:
        os.replace(aside, dest)
        raise
    shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(
    dest: str | Path, *, source: str | Path | None = None, legacy: Callable[[Path], bool] | None = None
) -> Iterator[Path]:
    """Yield a temporary directory beside `dest`; on success it replaces `dest` (modes as the umask says, see
    apply_umask), on error it vanishes. A `dest` that destination_problem refuses is a FileExistsError before
    anything is written; what killed builds of `dest` left is removed first; a full disk is a DiskFullError."""
    dest = Path(dest)
    if problem := destination_problem(dest, source, legacy):
        raise FileExistsError(problem)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(dest)
    tmp = _new_temporary(dest)
    try:
        with _disk_full_names(dest, tmp):
            yield tmp
            (tmp / OUTPUT_MARKER).write_text(
                f"Written by labkit {__version__}, which replaces this directory whole when it writes here again: "
                "keep your own files elsewhere.\n"
            )
            apply_umask(tmp)
        if problem := destination_problem(dest, source, legacy):  # the build took a while: look again
            raise FileExistsError(problem)
        _swap(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def file_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` so that concurrent processes build a cache entry once."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; atomic renames still keep files whole
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------- manifests


def sha256_file(path: str | Path, chunk: int = 1 << 24) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: Path, source: str) -> Path:
    """Record every file's size and SHA-256 in the directory's manifest (written last, atomically)."""
    entries = {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {"source": source, "labkit": __version__, "created": time.time(), "files": entries}
    return atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=1))


_verified: set[tuple[str, int]] = set()


def _manifest_problem(manifest: Any) -> str | None:
    """None if `manifest` has the shape write_manifest gives it, else what is off (valid JSON can still be wrong)."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return "no 'files' object"
    for name, want in files.items():
        if name in ("", ".", "..") or "/" in name or "\\" in name:
            return f"file name {name!r} is not a plain name"
        if not isinstance(want, dict):
            return f"the entry for {name} is not an object"
        if not isinstance(want.get("bytes"), int) or isinstance(want.get("bytes"), bool) or want["bytes"] < 0:
            return f"the entry for {name} has no byte count"
        sha = want.get("sha256")
        if not isinstance(sha, str) or len(sha) != 64:
            return f"the entry for {name} has no SHA-256 digest"
    return None


def check_manifest(directory: Path) -> str | None:
    """None if every file matches the manifest, else a sentence saying what is wrong."""
    mpath = directory / MANIFEST
    if not mpath.is_file():
        return f"{directory} has no {MANIFEST} (an interrupted or foreign build)"
    try:
        files = json.loads(mpath.read_text())
    except (ValueError, OSError) as err:
        return f"{mpath} is unreadable ({err})"
    if malformed := _manifest_problem(files):
        return f"{mpath} is inconsistent: {malformed}"
    files = files["files"]
    key = (str(directory.resolve()), mpath.stat().st_mtime_ns)
    for name, want in files.items():
        path = directory / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, expected {want['bytes']} (truncated?)"
    if key in _verified:  # digests already checked in this process and nothing was rewritten
        return None
    for name, want in files.items():
        if sha256_file(directory / name) != want["sha256"]:
            return f"{directory / name} does not match its SHA-256 digest (corrupted)"
    _verified.add(key)
    return None
