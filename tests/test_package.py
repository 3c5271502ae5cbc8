"""The packages' shape: imports flow one way, from labkit's foundation up to its techniques and its CLI, and from
the course's machinery (labcourse) down into labkit, never back.

Read from the source with `ast` (nothing is imported), so a cycle or an upward import fails here
before it can fail as a half-initialized module at run time.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("labkit", "labcourse")

# Layers, lowest first: a module may import its own layer's modules and any below, never above.
FOUNDATION = {"torchutil", "profiles", "assets", "precision", "plots", "data", "models", "bench", "flops", "env"}
FOUNDATION |= {"fileio"}  # files written whole or not at all: what assets, checkpoints and every writer stand on
FOUNDATION |= {"profiler", "monitor"}  # measurement, like bench: the trainer marks its phases and logs through them
SHARED = {"evaluate", "checkpoint", "train", "train_config"}
SHARED |= {"calibration"}  # the engine under quant and prune, one floor below both: they never import each other
TECHNIQUES = {"clean", "bpe", "shards", "activations", "parallel", "prune", "quant", "tasks", "lora"}
TOP = {"cli", "__main__"}
# Technique modules import each other only where one is built on the other.
BUILT_ON = {
    ("shards", "bpe"): "lab 01's shards are tagged with the tokenizer that made them",
    ("lora", "tasks"): "fine-tuning trains and scores on the instruction task",
    ("lora", "quant"): "QLoRA trains adapters on the packed 4-bit base",
}
MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The labkit or labcourse module a dotted import name refers to (a module, or the module holding the name)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _runtime_nodes(tree: ast.AST):
    """Every node, except those under `if TYPE_CHECKING:` (imports for annotations, never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports(module: str, annotations: bool = False) -> set[str]:
    """Every labkit or labcourse module that `module` imports when it runs, at the top or inside a function (and
    with `annotations`, also those imported under `if TYPE_CHECKING:`)."""
    found = set()
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    for node in ast.walk(tree) if annotations else _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found |= {_resolve(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            found |= {_resolve(f"{node.module}.{alias.name}") for alias in node.names}
    return {m for m in found if m and m not in PACKAGES and m != module}


GRAPH = {m: _imports(m) for m in MODULES if m not in PACKAGES}
WITH_ANNOTATIONS = {m: _imports(m, annotations=True) for m in GRAPH}  # a cycle there is one too, for a reader


def _unit(module: str) -> str:
    """The top-level unit a module belongs to: labkit.quant.gptq -> quant."""
    return module.split(".")[1]


def _package(module: str) -> str:
    """The package a module belongs to: labcourse.checks.lab01 -> labcourse."""
    return module.split(".")[0]


KIT = sorted(m for m in GRAPH if _package(m) == "labkit")


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}  # "open" while on the DFS stack, "done" after

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, nxt])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_the_cycle_finder_finds_a_planted_cycle_and_passes_a_tree():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imports_for_annotations_only_are_not_counted():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\nimport c\n"
    )
    names = {alias.name for node in _runtime_nodes(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert names == {"b", "c"}


def test_labkit_never_imports_the_course():
    wrong = {m: found for m in KIT if (found := sorted(n for n in WITH_ANNOTATIONS[m] if _package(n) == "labcourse"))}
    assert not wrong, f"labkit imports the course package: {wrong}"


def test_the_course_is_built_on_labkit():  # the other direction is the point, and the test above can see it
    assert any(_package(n) == "labkit" for m in GRAPH if _package(m) == "labcourse" for n in GRAPH[m])


def test_no_labkit_module_reads_the_repository_by_path():
    """labkit works installed from a wheel: no module finds files relative to its own source (the labs, the README,
    tests/: those are the course's, which labcourse reaches)."""
    found = [m for m in KIT if "__file__" in MODULES[m].read_text(encoding="utf-8")]
    assert not found, f"{found} locate files by their own path"


def test_importing_every_labkit_module_loads_no_notebook_or_course_machinery():
    """What `import labkit.<anything>` costs a practitioner: no notebook runner, no Jupyter, no README rendering."""
    code = (
        "import importlib, sys\n"
        f"for name in {[m for m in KIT if not m.endswith('__main__')]!r}:\n"
        "    importlib.import_module(name)\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert "labkit" in loaded and "torch" in loaded  # the import ran
    assert not loaded & {"labcourse", "nbformat", "nbclient", "jupyter_client", "ipykernel", "nbval"}, loaded


def test_labkit_has_no_import_cycle():
    assert _find_cycle(GRAPH) is None, f"import cycle: {' -> '.join(_find_cycle(GRAPH))}"


def test_no_cycle_hides_behind_annotation_only_imports():
    cycle = _find_cycle(WITH_ANNOTATIONS)
    assert cycle is None, f"import cycle through annotation-only imports: {' -> '.join(cycle)}"


def test_quant_and_prune_share_the_calibration_engine_and_never_import_each_other():
    def uses(a: str, b: str) -> list[tuple[str, str]]:
        return [(m, n) for m in WITH_ANNOTATIONS if _unit(m) == a for n in WITH_ANNOTATIONS[m] if _unit(n) == b]

    assert not uses("quant", "prune") and not uses("prune", "quant")
    assert uses("quant", "calibration") and uses("prune", "calibration")


def test_every_module_is_placed_in_a_layer():
    layers = FOUNDATION | SHARED | TECHNIQUES | TOP
    assert {_unit(m) for m in KIT} <= layers, sorted({_unit(m) for m in KIT} - layers)


@pytest.mark.parametrize("module", KIT)
def test_imports_flow_one_way(module):
    unit = _unit(module)
    allowed = set(FOUNDATION)
    if unit not in FOUNDATION:
        allowed |= SHARED
    if unit in TECHNIQUES:
        allowed |= {unit} | {b for a, b in BUILT_ON if a == unit}
    if unit in TOP:
        allowed |= SHARED | TECHNIQUES | TOP
    wrong = sorted(m for m in GRAPH[module] if _unit(m) not in allowed)
    assert not wrong, f"{module} imports {wrong}: above its layer, or a technique it is not built on"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_longer_than_the_limit(module):
    lines = MODULES[module].read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"{MODULES[module].name} has {lines} lines; split it where its sections divide it"


def expected_test_file(module: str) -> str:
    """A module's test file: tests/test_<path>.py, with `course_` before it where labkit has a module of that name
    (labcourse.cli -> test_course_cli.py)."""
    rest = module.split(".")[1:]
    clash = _package(module) == "labcourse" and ".".join(["labkit", *rest]) in MODULES
    return "test_" + "course_" * clash + "_".join(rest) + ".py"


def test_test_file_names_each_module_once():
    assert (
        expected_test_file("labkit.cli") == "test_cli.py"
        and expected_test_file("labcourse.cli") == "test_course_cli.py"
    )
    assert expected_test_file("labcourse.checks.lab01") == "test_checks_lab01.py"
    named = [expected_test_file(m) for m in MODULES if MODULES[m].name not in ("__init__.py", "__main__.py")]
    assert len(named) == len(set(named))


@pytest.mark.parametrize("module", sorted(m for m in MODULES if MODULES[m].name not in ("__init__.py", "__main__.py")))
def test_every_module_has_its_test_file(module):
    expected = expected_test_file(module)
    assert (Path(__file__).parent / expected).is_file(), f"{module} has no tests/{expected}"


def private_imports(source: str) -> list[str]:
    """The underscore names (dunders aside) that `source` imports from labkit or labcourse modules: another module's
    internals."""
    return [
        f"{node.module}.{alias.name}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]


def test_private_imports_finds_a_planted_one_and_passes_public_names_and_dunders():
    assert private_imports("from labkit.prune.masks import check_sparsity, _keep_top\nimport labkit._x") == [
        "labkit.prune.masks._keep_top"
    ]
    assert private_imports("from labkit import __version__\nfrom os import _exit") == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_another_modules_private_names(module):
    found = private_imports(MODULES[module].read_text(encoding="utf-8"))
    assert not found, f"{module} imports {found}: make the name public (with a docstring) or keep it in its module"
