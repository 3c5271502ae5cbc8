"""The `labcourse` command: the student build, `labcourse lab` (what `make lab` runs) serving JupyterLab on its
port, (its bad input: tests/test_cli.py's table of both command lines)."""

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from labcourse import cli


def test_student_command_writes_the_student_build(capsys, tmp_path):
    assert cli.main(["student", "--output", str(tmp_path / "student")]) == 0
    out = capsys.readouterr().out
    labs = sorted((Path(__file__).parents[1] / "labs").glob("0*.ipynb"))
    assert len(labs) >= 10
    for lab in labs:  # every lab has two exercises
        assert f"{lab.name}: 2 exercise regions stubbed" in out
        assert (tmp_path / "student" / lab.name).is_file()


@pytest.mark.slow
def test_lab_server_answers_on_its_port(tmp_path):
    port, token = 18000 + os.getpid() % 1000, "labkit-test-token"
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "labcourse",
            "lab",
            "--workspace",
            str(tmp_path / "lab"),
            "--no-browser",
            f"--port={port}",
            "--ip=127.0.0.1",
            f"--IdentityProvider.token={token}",
            "--ServerApp.port_retries=0",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline, status = time.time() + 60, None
        while time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2) as r:
                    status = json.load(r)
                    break
            except OSError:
                time.sleep(0.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents?token={token}", timeout=5) as r:
            names = {item["name"] for item in json.load(r)["content"]}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert status is not None and "started" in status
    assert "00_gpu_setup.ipynb" in names  # it serves working copies of the course's labs
    served = nbformat.read(str(tmp_path / "lab" / "00_gpu_setup.ipynb"), as_version=4)
    assert not any(c.get("outputs") for c in served.cells)  # the student build, not the solved notebook
