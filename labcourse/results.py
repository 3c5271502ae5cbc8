"""Where measured figures live: one JSON file per benchmark run, and the figures a lab publishes in its outputs.

A benchmark ends with `save_run(name, figures)`: `results/<name>/<UTC time>-<host>.json`, written atomically, with
the machine's fingerprint beside the figures. A lab's `expected.check` publishes its figures in the notebook's
output under `MIME` (`publish`), and `notebook_figures` reads them back from the saved notebook. `labcourse figures`
renders the README's measured table from both, so no figure there is typed by hand.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import re
from pathlib import Path
from typing import Any

from labkit import env, fileio, profiles
from labkit.torchutil import as_path

MIME = "application/vnd.labkit.figures+json"
RESULTS = Path("results")
_NAME = re.compile(r"[a-z0-9][a-z0-9_]*")
_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _plain(value: Any) -> Any:
    """`value` as JSON can hold it: tensors and NumPy scalars as numbers, paths as text, inf/nan as "inf"/"nan"."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # torch / NumPy scalars and arrays
        return _plain(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf", "-inf", "nan": Jupyter's messages and strict JSON refuse the bare words
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise TypeError(f"cannot store {type(value).__name__} {value!r} as a figure: give a number, text or list")


def number(value: Any) -> Any:
    """A stored figure back as Python: "inf" / "-inf" / "nan" become floats again; anything else is unchanged."""
    return _NON_FINITE.get(value, value) if isinstance(value, str) else value


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "-", platform.node()).strip("-") or "host"


def save_run(name: str, figures: dict[str, Any], *, profile: str | None = None, root: str | Path = RESULTS) -> Path:
    """Write one benchmark run — its figures and the machine's fingerprint — to `root/name/<time>-<host>.json`,
    atomically; an earlier run is never overwritten. Returns the path."""
    _check_name(name)
    if not isinstance(figures, dict) or not figures:
        raise ValueError("figures must be a non-empty dict of name -> value")
    if profile is not None and not isinstance(profile, str):
        raise TypeError(f"profile must be None or a profile's name (smoke, cpu, gpu), got {profile!r}")
    root = as_path("root", root)
    record = {
        "benchmark": name,
        "machine": env.fingerprint(profiles.get_profile(profile).name),
        "figures": _plain(figures),  # a figure JSON cannot hold fails here, before anything is written
    }
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    folder = Path(root) / name
    path = folder / f"{stamp}-{_host()}.json"
    n = 1
    while path.exists():
        n += 1
        path = folder / f"{stamp}-{_host()}~{n}.json"  # '~' sorts after '.': the order of saving
    return fileio.atomic_write_text(path, json.dumps(record, indent=1, ensure_ascii=False) + "\n")


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"benchmark name must be lower-case letters, digits and '_', got {name!r}")


def _run_problem(record: Any) -> str | None:
    """What keeps a loaded JSON value from being a saved run ({"benchmark": str, "machine": {}, "figures": {}})."""
    if not isinstance(record, dict):
        return f"the file holds a JSON {type(record).__name__}, not an object"
    kinds = {"benchmark": str, "machine": dict, "figures": dict}
    missing = [key for key in kinds if key not in record]
    if missing:
        return f"no {', '.join(map(repr, missing))}"
    wrong = [
        f"{key!r} is a {type(record[key]).__name__}" for key, kind in kinds.items() if not isinstance(record[key], kind)
    ]
    return ", ".join(wrong) or None


def _saved_order(path: Path) -> tuple[str, int]:
    first, _, n = path.stem.partition("~")
    return first, int(n) if n.isdigit() else 1


def runs(name: str, root: str | Path = RESULTS) -> list[tuple[Path, dict[str, Any]]]:
    """Every saved run of benchmark `name`, oldest first, as (path, record)."""
    _check_name(name)
    folder = as_path("root", root) / name
    found = []
    for path in sorted(folder.glob("*.json"), key=_saved_order):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as err:
            raise ValueError(f"{path}: not a JSON record ({err})") from None
        problem = _run_problem(record)
        if problem:
            raise ValueError(
                f"{path}: not a benchmark run (needs 'benchmark' text, 'machine' and 'figures' objects): {problem}"
            )
        found.append((path, record))
    return found


def latest(name: str, root: str | Path = RESULTS) -> tuple[Path, dict[str, Any]]:
    """The newest saved run of benchmark `name`, as (path, record)."""
    found = runs(name, root)
    if not found:
        raise FileNotFoundError(f"no saved run of benchmark {name!r} in {Path(root) / name}: run benchmarks/{name}.py")
    return found[-1]


def publish(text: str, payload: dict[str, Any]) -> None:
    """Show `text`; inside a Jupyter kernel as one output that also carries `payload` as JSON (`MIME`), which the
    saved notebook keeps for `notebook_figures`. Elsewhere (a script, a test) it is printed."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str (what the reader sees), got {type(text).__name__}")
    if not isinstance(payload, dict):
        raise TypeError(f"payload must be a dict (e.g. {{'figures': {{...}}}}), got {type(payload).__name__}")
    payload = _plain(payload)  # a value JSON cannot hold is refused here, in a script as in a kernel
    try:
        from IPython import get_ipython
    except ImportError:
        shell = None
    else:
        shell = get_ipython()
    if getattr(shell, "kernel", None) is None:
        print(text)
        return
    from IPython.display import display

    display({"text/plain": text, MIME: payload}, raw=True)


def saved_notebook(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A saved notebook, read once: what `labcourse execute` recorded in it ({"executed": machine, profile, run time},
    or {}) and every payload it published (`publish`), in cell order."""
    path = as_path("path", path)
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ValueError(f"{path}: not a notebook's JSON ({err})") from None
    cells = nb.get("cells", []) if isinstance(nb, dict) else None
    if not isinstance(cells, list) or not all(isinstance(c, dict) for c in cells):
        raise ValueError(f"{path}: not a notebook (needs an object whose 'cells' is a list of objects)")
    outputs = [out for cell in cells if cell.get("cell_type") == "code" for out in cell.get("outputs", [])]
    if not all(isinstance(out, dict) and isinstance(out.get("data", {}), dict) for out in outputs):
        raise ValueError(f"{path}: a code cell's outputs must be objects whose 'data' is an object")
    payloads = [out["data"][MIME] for out in outputs if MIME in out.get("data", {})]
    metadata = nb.get("metadata", {})
    recorded = metadata.get("labkit", {}) if isinstance(metadata, dict) else None
    if not isinstance(recorded, dict) or not all(isinstance(p, dict) for p in payloads):
        raise ValueError(f"{path}: metadata.labkit and every published {MIME} payload must be JSON objects")
    return recorded, payloads


def notebook_figures(path: str | Path) -> list[dict[str, Any]]:
    """Every payload a saved notebook published (`publish`), in cell order."""
    return saved_notebook(path)[1]
