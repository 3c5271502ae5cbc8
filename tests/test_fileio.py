"""Where labkit writes a directory: it replaces only what it wrote itself (or nothing), never the current directory
or the source it reads, deletes the old content only once the new is in place, and clears what killed builds left
beside it without touching the temporary of a build that is still running."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from labcourse import cli, student
from labkit import assets, fileio
from tests.permissions import snapshot

SOLVED = "def f():\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION\n"


def _contents(path: Path) -> dict[str, bytes | None]:
    """Every entry under `path` with its bytes (None for a directory): what a refusal must leave as it was."""
    return {str(p.relative_to(path)): None if p.is_dir() else p.read_bytes() for p in path.rglob("*")}


def _labs(root: Path) -> Path:
    """A labs folder of one notebook with a solution and a scripts/ folder, as the course's labs/ has."""
    labs = root / "labs"
    (labs / "scripts").mkdir(parents=True)
    (labs / "scripts" / "run.py").write_text("print('run')\n")
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SOLVED)]), str(labs / "a.ipynb"))
    return labs


def _old_build(dest: Path, labs: Path, ran: bool) -> None:
    """A student build as labkit wrote it before it marked its directories; `ran`: the suite then ran it there."""
    dest.mkdir(parents=True)
    nbformat.write(student.student_notebook(labs / "a.ipynb")[0], str(dest / "a.ipynb"))
    (dest / "scripts").mkdir()
    (dest / "scripts" / "run.py").write_text("print('run')\n")
    if ran:
        (dest / "results" / "lab06").mkdir(parents=True)
        (dest / "results" / "lab06" / "m.bin").write_bytes(b"x")
        (dest / "runs").mkdir()


# (where -o points, what is there first) -> refused with this phrase, the folder and the labs left as they were
REFUSED = [
    pytest.param("work", "cwd", "the current directory", id="the-current-directory"),
    pytest.param(".", "cwd-parent", "the current directory", id="a-parent-of-the-current-directory"),
    pytest.param("out", "foreign", "holds files labkit did not write (a.ipynb, notes.txt)", id="a-foreign-file"),
    pytest.param("labs", None, "which this build reads", id="the-labs-folder"),
    pytest.param(".", None, "which this build reads", id="a-parent-of-the-labs-folder"),
    pytest.param("out", "labs-copy", "holds files labkit did not write", id="a-copy-of-the-labs-with-solutions"),
    pytest.param("out", "old-build-and-notes", "holds files labkit did not write", id="an-old-build-with-notes"),
]


@pytest.mark.parametrize("target, setup, message", REFUSED)
def test_the_student_build_refuses_what_it_did_not_write(tmp_path, monkeypatch, capsys, target, setup, message):
    labs = _labs(tmp_path)
    out = tmp_path / target
    if setup in ("cwd", "foreign"):
        out.mkdir()
        (out / "notes.txt").write_text("my notes")
        (out / "a.ipynb").write_text("{}")
    if setup == "cwd":
        monkeypatch.chdir(out)
    if setup == "cwd-parent":
        (tmp_path / "work").mkdir()
        monkeypatch.chdir(tmp_path / "work")
    if setup == "labs-copy":
        shutil.copytree(labs, out)
    if setup == "old-build-and-notes":
        _old_build(out, labs, ran=True)
        (out / "notes.txt").write_text("my notes")
    before = (snapshot(tmp_path), _contents(tmp_path))
    assert cli.main(["student", "--labs", str(labs), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("labcourse student: ") and message in err and str(out.absolute()) in err
    assert (snapshot(tmp_path), _contents(tmp_path)) == before


@pytest.mark.parametrize(
    "setup",
    ["missing", "empty", "own-build", "old-student-build", "old-test-labs-after-a-run"],
)
def test_the_student_build_replaces_nothing_or_its_own_builds(tmp_path, setup):
    labs = _labs(tmp_path)
    out = tmp_path / "build" / "student"
    if setup == "empty":
        out.mkdir(parents=True)
    if setup == "own-build":
        student.build_student(labs, out)
        (out / "results").mkdir()  # the suite ran it there
    if setup.startswith("old-"):
        _old_build(out, labs, ran=setup == "old-test-labs-after-a-run")
    assert student.build_student(labs, out) == {"a.ipynb": 1}
    assert sorted(p.name for p in out.iterdir()) == ["a.ipynb", fileio.OUTPUT_MARKER, "scripts"]
    assert student.STUB in nbformat.read(str(out / "a.ipynb"), as_version=4).cells[0].source
    assert sorted(p.name for p in out.parent.iterdir()) == ["student"]  # no temporary, no old copy left aside


def _manifest_entry(d: Path) -> None:
    """A cache entry or checkpoint an older labkit wrote: a manifest, no marker."""
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"x")
    fileio.write_manifest(d, source="test")


# what is at the destination first -> None if atomic_directory may replace it, else a phrase of the refusal
DESTINATIONS = [
    pytest.param(lambda d: None, None, id="missing"),
    pytest.param(lambda d: d.mkdir(), None, id="empty"),
    pytest.param(lambda d: (d.mkdir(), (d / fileio.OUTPUT_MARKER).write_text("")), None, id="marked"),
    pytest.param(_manifest_entry, None, id="holds-a-labkit-manifest"),
    pytest.param(lambda d: (d.mkdir(), (d / "notes.txt").write_text("x")), "did not write (notes.txt)", id="foreign"),
]


@pytest.mark.parametrize("setup, refused", DESTINATIONS)
def test_atomic_directory_replaces_only_its_own_directories(tmp_path, setup, refused):
    dest = tmp_path / "d"
    setup(dest)
    before = (snapshot(tmp_path), _contents(tmp_path))
    if refused:
        with pytest.raises(FileExistsError, match=re.escape(refused)):
            with fileio.atomic_directory(dest) as tmp:
                (tmp / "new").write_text("new")
        assert (snapshot(tmp_path), _contents(tmp_path)) == before
    else:
        with fileio.atomic_directory(dest) as tmp:
            (tmp / "new").write_text("new")
        assert (dest / "new").read_text() == "new" and (dest / fileio.OUTPUT_MARKER).is_file()
        assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_a_failed_swap_puts_the_old_directory_back(tmp_path, monkeypatch):
    dest = tmp_path / "d"
    with fileio.atomic_directory(dest) as tmp:
        (tmp / "v").write_text("1")
    real, failed = os.replace, []

    def replace(src, dst):
        if Path(dst) == dest and not failed:  # the new directory into place: the disk went away, say
            failed.append(src)
            raise OSError(5, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="Input/output"):
        with fileio.atomic_directory(dest) as tmp:
            (tmp / "v").write_text("2")
    assert (dest / "v").read_text() == "1"
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_a_build_whose_destination_gained_foreign_files_meanwhile_replaces_nothing(tmp_path):
    dest = tmp_path / "d"
    with pytest.raises(FileExistsError, match="did not write"):
        with fileio.atomic_directory(dest) as tmp:
            (tmp / "v").write_text("new")
            dest.mkdir()
            (dest / "notes.txt").write_text("written while the build ran")
    assert (dest / "notes.txt").read_text() == "written while the build ran"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


# ----------------------------------------------------------------------------- leftovers of killed builds

BUILD = """
import sys, time
from pathlib import Path
from labkit import assets, fileio

def build(tmp):
    (Path(tmp) / "part").write_text("half")
    print(tmp, flush=True)
    time.sleep(600)

if sys.argv[2] == "cached":
    assets.cached_build(Path(sys.argv[1]), build, source="test")
else:
    with fileio.atomic_directory(sys.argv[1]) as tmp:
        build(tmp)
"""


def _start_build(dest: Path, how: str) -> tuple[subprocess.Popen, Path]:
    """A process building `dest` (atomic_directory or cached_build), and its temporary once it is writing there."""
    proc = subprocess.Popen([sys.executable, "-c", BUILD, str(dest), how], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line, f"the build process ended early (exit {proc.wait()})"
    return proc, Path(line)


def _sigkill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)  # no handler, no clean-up: a crash, the OOM killer, a closed laptop
    proc.wait()


@pytest.mark.parametrize("how", ["directory", "cached"])
def test_the_next_build_removes_what_a_killed_build_left(tmp_path, how):
    dest = tmp_path / "entry"
    killed, leftover = _start_build(dest, how)
    _sigkill(killed)
    assert leftover.is_dir() and leftover.parent == tmp_path
    if how == "cached":
        assets.cached_build(dest, lambda out: (out / "w").write_text("whole"), source="test")
    else:
        with fileio.atomic_directory(dest) as tmp:
            (tmp / "w").write_text("whole")
    assert not leftover.exists() and (dest / "w").read_text() == "whole"


def test_the_temporary_of_a_live_concurrent_build_survives_the_next_build(tmp_path):
    dest = tmp_path / "entry"
    killed, leftover = _start_build(dest, "directory")
    _sigkill(killed)
    live, writing = _start_build(dest, "directory")
    try:
        with fileio.atomic_directory(dest) as tmp:
            (tmp / "w").write_text("whole")
        assert not leftover.exists()
        assert (writing / "part").read_text() == "half"  # the live build's work is untouched
    finally:
        _sigkill(live)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


HOST = socket.gethostname()
# a temporary beside dest (its name after ".entry."), untouched for over STALE_SECONDS -> removed by the next build?
LEFTOVERS = {
    "owner-dead-on-this-host": (lambda: f"abcd1234.{_dead_pid()}@{HOST}.tmp", False, True),
    "owner-alive-on-this-host": (lambda: f"abcd1235.{os.getpid()}@{HOST}.tmp", True, False),
    "other-host-fresh": (lambda: "abcd1236.1@another.host.tmp", False, False),
    "other-host-untouched": (lambda: "abcd1237.1@another.host.tmp", True, True),
    "older-labkit-fresh": (lambda: "abcd1238.tmp", False, False),
    "older-labkit-untouched": (lambda: "abcd1239.tmp", True, True),
    "of-another-destination-entry.x": (lambda: "x.abcd1230.tmp", True, False),
}


def test_the_next_build_removes_only_abandoned_temporaries(tmp_path):
    made = {}
    for case, (name, untouched, _) in LEFTOVERS.items():
        made[case] = tmp_path / f".entry.{name()}"
        made[case].mkdir()
        (made[case] / "part").write_text("half")
        when = time.time() - (2 * fileio.STALE_SECONDS if untouched else 0)
        os.utime(made[case], (when, when))
    with fileio.atomic_directory(tmp_path / "entry") as tmp:
        (tmp / "w").write_text("whole")
    assert {case: not path.exists() for case, path in made.items()} == {c: r for c, (*_, r) in LEFTOVERS.items()}
