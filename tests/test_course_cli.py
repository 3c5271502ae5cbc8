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
    assert cli.START_PAGE in names  # and the start page it opens on
    served = nbformat.read(str(tmp_path / "lab" / "00_gpu_setup.ipynb"), as_version=4)
    assert not any(c.get("outputs") for c in served.cells)  # the student build, not the solved notebook


def test_class_settings_add_the_course_defaults_to_the_installations_own(tmp_path, monkeypatch, capsys):
    installed = tmp_path / "app" / "settings"
    (installed / "overrides.d").mkdir(parents=True)
    (installed / "page_config.json").write_text('{"disabledExtensions": {"x": true}}')
    (installed / "overrides.d" / "site.json").write_text('{"@x/y:z": {"a": 1}}')
    (installed / "overrides.json").write_text(
        json.dumps(
            {
                "@jupyterlab/apputils-extension:themes": {"theme": "JupyterLab Dark"},
                "@jupyterlab/docmanager-extension:plugin": {"autosave": False, "defaultViewers": {"csv": "CSVTable"}},
            }
        )
    )
    monkeypatch.setattr("jupyterlab.commands.get_app_dir", lambda: str(tmp_path / "app"))
    dest = cli._class_settings(tmp_path / "settings")
    overrides = json.loads((dest / "overrides.json").read_text())
    assert overrides == {
        "@jupyterlab/apputils-extension:themes": {"theme": "JupyterLab Dark"},
        "@jupyterlab/docmanager-extension:plugin": {
            "autosave": False,
            "defaultViewers": {"csv": "CSVTable", "markdown": "Markdown Preview"},  # merged key by key
        },
        "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
    }
    assert (dest / "page_config.json").read_text() == (installed / "page_config.json").read_text()
    assert (dest / "overrides.d" / "site.json").is_file()  # a site's or a package's overrides stay
    for broken in ("{not json", "[1, 2]"):  # JupyterLab starts without such a file; so does the course
        (installed / "overrides.json").write_text(broken)
        overrides = json.loads((cli._class_settings(tmp_path / "again") / "overrides.json").read_text())
        assert overrides == cli.CLASS_DEFAULTS
        assert "overrides.json is left out" in capsys.readouterr().err


def test_lab_opens_the_start_page_with_the_class_settings(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(os, "execv", lambda path, argv: calls.append(argv))
    monkeypatch.setattr(cli, "LABS_DIR", tmp_path / "repo" / "labs")
    for root, has_page in ((tmp_path / "with", True), (tmp_path / "without", False)):
        root.mkdir()
        if has_page:
            (root / cli.START_PAGE).write_text("# start\n")
        cli.main(["lab", "--root", str(root), "--no-browser"])
        argv = calls[-1]
        assert f"--ServerApp.root_dir={root}" in argv and argv[-1] == "--no-browser"
        assert ("--LabApp.default_url=/lab/tree/START_HERE.md" in argv) == has_page
        settings = tmp_path / "repo" / "build" / "jupyterlab-settings"
        assert f"--LabApp.app_settings_dir={settings}" in argv and (settings / "overrides.json").is_file()
        assert "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate" in argv  # offline
