"""Where measured figures live: one JSON file per benchmark run, and the figures a lab publishes in its outputs.

A benchmark ends with `save_run(name, figures)`: `results/<name>/<UTC time>-<host>.json`, written atomically, with
the machine's fingerprint beside the figures. A lab's `expected.check` publishes its figures in the notebook's
output under `MIME` (`publish`), and `notebook_figures` reads them back from the saved notebook. `labkit figures`
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

from labkit import assets, env, profiles

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
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"benchmark name must be lower-case letters, digits and '_', got {name!r}")
    if not isinstance(figures, dict) or not figures:
        raise ValueError("figures must be a non-empty dict of name -> value")
    record = {
        "benchmark": name,
        "machine": env.fingerprint(profile or profiles.get_profile().name),
        "figures": _plain(figures),  # a figure JSON cannot hold fails here, before anything is written
    }
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    folder = Path(root) / name
    path = folder / f"{stamp}-{_host()}.json"
    n = 1
    while path.exists():
        n += 1
        path = folder / f"{stamp}-{_host()}~{n}.json"  # '~' sorts after '.': the order of saving
    return assets.atomic_write_text(path, json.dumps(record, indent=1, ensure_ascii=False) + "\n")


def _saved_order(path: Path) -> tuple[str, int]:
    first, _, n = path.stem.partition("~")
    return first, int(n) if n.isdigit() else 1


def runs(name: str, root: str | Path = RESULTS) -> list[tuple[Path, dict[str, Any]]]:
    """Every saved run of benchmark `name`, oldest first, as (path, record)."""
    folder = Path(root) / name
    found = []
    for path in sorted(folder.glob("*.json"), key=_saved_order):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as err:
            raise ValueError(f"{path}: not a JSON record ({err})") from None
        if not isinstance(record, dict) or not isinstance(record.get("figures"), dict) or "machine" not in record:
            raise ValueError(f"{path}: not a benchmark run (needs 'machine' and 'figures')")
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

    display({"text/plain": text, MIME: _plain(payload)}, raw=True)


def saved_notebook(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A saved notebook, read once: what `labkit execute` recorded in it ({"executed": machine, profile, run time},
    or {}) and every payload it published (`publish`), in cell order."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    payloads = [
        out["data"][MIME]
        for cell in nb.get("cells", [])
        if cell.get("cell_type") == "code"
        for out in cell.get("outputs", [])
        if MIME in out.get("data", {})
    ]
    return nb.get("metadata", {}).get("labkit", {}), payloads


def notebook_figures(path: str | Path) -> list[dict[str, Any]]:
    """Every payload a saved notebook published (`publish`), in cell order."""
    return saved_notebook(path)[1]
