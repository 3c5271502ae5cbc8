"""A full disk is one clear error naming the path and the free space, from every writer that goes through labkit's
atomic writes (safetensors' own error, which has no errno, included); what was there before stays intact and no
temporary is left behind."""

from __future__ import annotations

import errno
import os
import re
import subprocess
from pathlib import Path

import nbformat
import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from labcourse import cli
from labkit import fileio
from labkit.cli import one_line
from tests.permissions import snapshot

BIG = 2 * 2**20  # bytes: more than the whole 1 MiB filesystem
FREE = r"\d+\.\d MiB free on that filesystem"


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs holding a small file and a directory written earlier; unmounted however the test ends."""
    if os.geteuid() != 0:
        pytest.skip("mounting a 1 MiB tmpfs needs root (mount -t tmpfs); not root here")
    mount = tmp_path / "small"
    mount.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        fileio.atomic_write_bytes(mount / "earlier.bin", b"earlier")
        with fileio.atomic_directory(mount / "model") as tmp:
            save_file({"w": torch.ones(4)}, str(tmp / "model.safetensors"))
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def _safetensors_dir(dest: Path) -> None:
    with fileio.atomic_directory(dest) as tmp:
        save_file({"w": torch.zeros(BIG // 4)}, str(tmp / "model.safetensors"))


def _plain_dir(dest: Path) -> None:
    with fileio.atomic_directory(dest) as tmp:
        (tmp / "data.bin").write_bytes(b"x" * BIG)


def _entries(path: Path) -> dict[str, tuple[int, int, int]]:
    """Mode, size and mtime of everything under `path` (its own mtime changes with any temporary made and removed)."""
    return {name: state for name, state in snapshot(path).items() if name != "."}


# a writer, and where it writes (an earlier file or directory it would replace, or a new one)
WRITERS = [
    pytest.param(lambda p: fileio.atomic_write_bytes(p, b"x" * BIG), "earlier.bin", id="atomic-write-over-a-file"),
    pytest.param(lambda p: fileio.atomic_write_bytes(p, b"x" * BIG), "new.bin", id="atomic-write-new-file"),
    pytest.param(_safetensors_dir, "model", id="safetensors-over-a-directory"),
    pytest.param(_safetensors_dir, "new-model", id="safetensors-new-directory"),
    pytest.param(_plain_dir, "model", id="plain-file-over-a-directory"),
]


@pytest.mark.parametrize("write, name", WRITERS)
def test_a_full_disk_is_one_clear_error_and_changes_nothing(full_disk, write, name):
    before = _entries(full_disk)
    with pytest.raises(fileio.DiskFullError) as caught:
        write(full_disk / name)
    err = caught.value
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC and err.filename == str(full_disk / name)
    assert re.fullmatch(f"disk full while writing {re.escape(str(full_disk / name))}: {FREE}", str(err))
    assert re.fullmatch(f"No space left on device \\({FREE}\\): {re.escape(str(full_disk / name))}", one_line(err))
    assert _entries(full_disk) == before  # the earlier file and directory intact, no temporary left
    assert (full_disk / "earlier.bin").read_bytes() == b"earlier"


def test_labkit_student_on_a_full_disk_prints_one_line(full_disk, tmp_path, capsys):
    labs = tmp_path / "labs"
    labs.mkdir()
    cell = nbformat.v4.new_code_cell(f"x = {'1' * BIG}")  # a notebook bigger than the filesystem
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), str(labs / "a.ipynb"))
    before = _entries(full_disk)
    assert cli.main(["student", "--labs", str(labs), "--output", str(full_disk / "student")]) == 2
    line = capsys.readouterr().err
    assert re.fullmatch(f"labcourse student: No space left on device \\({FREE}\\): {full_disk / 'student'}\n", line)
    assert _entries(full_disk) == before


# an error raised inside an atomic build -> whether it is a full disk (then a DiskFullError naming the destination)
ERRORS = [
    pytest.param(OSError(errno.ENOSPC, "No space left on device"), True, id="ENOSPC"),
    pytest.param(
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
        True,
        id="safetensors-os-error-28",
    ),
    pytest.param(SafetensorError("Error while serializing: StorageFull"), True, id="safetensors-StorageFull"),
    pytest.param(RuntimeError("save failed"), True, id="raised-from-ENOSPC"),
    pytest.param(OSError(errno.EACCES, "Permission denied"), False, id="EACCES"),
    pytest.param(SafetensorError("Error while serializing: invalid tensor"), False, id="another-safetensors-error"),
]


@pytest.mark.parametrize("error, full", ERRORS)
def test_which_errors_are_a_full_disk(tmp_path, error, full):
    def build():
        with fileio.atomic_directory(tmp_path / "d") as tmp:
            (tmp / "part").write_text("half")
            if isinstance(error, RuntimeError):
                raise error from OSError(errno.ENOSPC, "No space left on device")
            raise error

    with pytest.raises(fileio.DiskFullError if full else type(error)) as caught:
        build()
    assert (caught.value.filename == str(tmp_path / "d")) if full else caught.value is error
    assert list(tmp_path.iterdir()) == []
