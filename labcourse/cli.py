"""Command line of the course: `labcourse lab | tensorboard | execute | figures | student | slides | grade | gpu-check`:
the machinery that opens, runs, builds and measures the labs of this repository (`labkit` holds the techniques)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from labkit import fileio
from labkit.cli import Parser, one_line, run, silence_stdout

LABS_DIR = Path(__file__).resolve().parent.parent / "labs"

# Each command imports what it needs inside its function: `labcourse --help` should not pay for torch.


START_PAGE = "START_HERE.md"
# JupyterLab's defaults for class, under any the student sets: Markdown pages open rendered (the start page, the
# glossary), and no pop-up asks about news (which would be fetched from the internet).
CLASS_DEFAULTS = {
    "@jupyterlab/docmanager-extension:plugin": {"defaultViewers": {"markdown": "Markdown Preview"}},
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
}


def _merged(base: dict, extra: dict) -> dict:
    """`base` with `extra` laid over it, objects merged key by key as JupyterLab merges overrides."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _class_settings(dest: Path) -> Path:
    """JupyterLab's application settings folder for class: a copy of the installation's own (if any, overrides.d/
    included) with CLASS_DEFAULTS merged into its overrides.json, written to `dest`. An installation overrides.json
    that is not a JSON object is named in a warning and left out, as JupyterLab itself would go on without it."""
    import json

    from jupyterlab.commands import get_app_dir

    installed = Path(get_app_dir()) / "settings"
    overrides: dict = {}
    if installed.is_dir():
        shutil.copytree(installed, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("overrides.json"))
        path = installed / "overrides.json"
        if path.is_file():
            try:
                loaded = json.loads(path.read_text(encoding="utf-8"))
                problem = None if isinstance(loaded, dict) else f"a JSON {type(loaded).__name__}, not an object"
            except (OSError, ValueError) as err:
                loaded, problem = None, str(err)
            if problem:
                print(f"labcourse lab: {path} is left out: {problem}", file=sys.stderr)
            else:
                overrides = loaded
    dest.mkdir(parents=True, exist_ok=True)
    fileio.atomic_write_text(dest / "overrides.json", json.dumps(_merged(overrides, CLASS_DEFAULTS), indent=1))
    return dest


def _lab(args: argparse.Namespace) -> int:
    jupyter = shutil.which("jupyter", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    if jupyter is None:
        print(
            "labcourse lab: JupyterLab is not installed; run `pip install -e .[dev]` (or `make lab`)", file=sys.stderr
        )
        return 1
    root = args.root
    if root is None:  # working copies, so that running a lab never modifies a tracked notebook
        from labcourse.student import workspace

        root = args.workspace or LABS_DIR.parent / "build" / ("lab-solutions" if args.solutions else "lab")
        for name, what in workspace(LABS_DIR, root, solutions=args.solutions).items():
            print(f"{root.name}/{name}: {what}")
    # Offline by default: the extension manager and the update check would otherwise query PyPI.
    cmd = [jupyter, "lab", f"--ServerApp.root_dir={root}", "--LabApp.extension_manager=readonly"]
    cmd += ["--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    cmd.append(f"--LabApp.app_settings_dir={_class_settings(LABS_DIR.parent / 'build' / 'jupyterlab-settings')}")
    if (Path(root) / START_PAGE).is_file():
        cmd.append(f"--LabApp.default_url=/lab/tree/{START_PAGE}")
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers and CI often run as root
        cmd.append("--allow-root")
    cmd += args.passthrough
    print("starting:", " ".join(cmd), flush=True)
    os.execv(jupyter, cmd)


def _tensorboard(args: argparse.Namespace) -> int:
    logdir = args.logdir or (LABS_DIR.parent / "build" if LABS_DIR.is_dir() else Path.cwd())
    if not Path(logdir).is_dir():
        raise ValueError(
            f"no such folder {logdir}: run lab 10 first (it writes runs/ beside the notebook), or give --logdir"
        )
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        print(
            "labcourse tensorboard: TensorBoard is not installed; run `pip install -e .[monitor]` (or `make lab`)",
            file=sys.stderr,
        )
        return 1
    # Offline: TensorBoard serves its own pages from the package; it fetches nothing at run time.
    cmd = [sys.executable, "-m", "tensorboard.main", f"--logdir={logdir}", f"--host={args.host}", f"--port={args.port}"]
    print("starting:", " ".join(cmd), flush=True)
    os.execv(sys.executable, cmd)


def _gpu_check(args: argparse.Namespace) -> int:
    from labcourse import gpucheck
    from labkit.parallel import launch

    if args.plan:
        for step in gpucheck.plan(max(launch.visible_gpus(), 1), args.output.parent):
            print(f"{step.name} ({step.timeout_s} s max, {step.gpus} GPU(s)): {' '.join(step.command)}")
        return 0
    report = gpucheck.gpu_check(args.output, run_labs=not args.no_labs)
    return 1 if any(s["status"] not in ("passed", "skipped") for s in report["steps"]) else 0


def _say(text: str) -> None:
    """Print a line now; once the reader has gone (`| head -1`), print nothing more but let the command go on."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        silence_stdout()


def _given_or_every_lab(notebooks: list[Path], what: str) -> list[Path]:
    """The notebooks named on the command line, else every lab in labs/; an error naming `what` if there are none."""
    found = notebooks or sorted(LABS_DIR.glob("[0-9][0-9]_*.ipynb"))
    if not found:
        raise FileNotFoundError(f"no labs in {LABS_DIR}: name the notebooks to {what}")
    return found


def _execute(args: argparse.Namespace) -> int:
    from labcourse.execute import Interrupted, check_options, execute
    from labkit import profiles

    notebooks = _given_or_every_lab(args.notebooks, "run")
    profile = args.profile or profiles.get_profile().name  # $LABKIT_PROFILE, else auto-detected
    check_options(profile, args.timeout)
    written, failed, stopped = [], [], 0
    for path in notebooks:  # every notebook runs, whatever happened to the one before or to stdout, unless ^C
        start = time.perf_counter()
        _say(f"{Path(path).name}: running under profile {profile!r} ...")
        try:
            dropped = execute(path, profile, timeout=args.timeout, core_only=args.core)
        except (ValueError, OSError, RuntimeError) as err:  # missing, malformed, or its run stopped short
            failed.append(Path(path).name)
            print(f"labcourse execute: {one_line(err)}", file=sys.stderr, flush=True)
            if isinstance(err, Interrupted):  # ^C or SIGTERM: no more notebooks, and the shell's exit status
                stopped = 128 + err.signum
                break
            continue
        written.append(Path(path).name)
        where = f"written to build/core/{Path(path).name}" if args.core else "written back"
        _say(f"{Path(path).name}: {where} after {time.perf_counter() - start:.0f} s")
        for line in dropped:
            _say(f"  dropped {line}")
    _say(f"{'core path run' if args.core else 'written back'}: {', '.join(written) or 'none'}")
    if failed:
        _say(f"failed (left as they were): {', '.join(failed)}")
    return stopped or (1 if failed else 0)


def _figures(args: argparse.Namespace) -> int:
    from labcourse import figures

    stale = figures.stale() if args.check else figures.update()
    for target, template in figures.TARGETS.items():
        typed = figures.typed_rows((figures.ROOT / template).read_text(encoding="utf-8"))
        state = ("DIFFERS FROM" if args.check else "rendered anew from") if target in stale else "matches"
        note = f" ({len(typed)} rows still typed by hand)" if typed else ""
        print(f"{target} {state} {template}{note}")
    return 1 if args.check and stale else 0


def _student(args: argparse.Namespace) -> int:
    from labcourse.student import build_student

    counts = build_student(args.labs, args.output, keep_outputs=args.keep_outputs)
    for name, count in counts.items():
        print(f"{name}: {count} exercise region{'s' * (count != 1)} stubbed")
    print(f"wrote the student notebooks to {args.output}")
    return 0


def _slides(args: argparse.Namespace) -> int:
    from labcourse.slides import write_decks

    for path, count in write_decks(_given_or_every_lab(args.notebooks, "make decks of"), args.output).items():
        print(f"{path}: {count} slides")
    return 0


def _grade(args: argparse.Namespace) -> int:
    from labcourse.grade import NO_NAMESPACE, grade
    from labcourse.sandbox import network_isolation

    if not network_isolation():
        print(NO_NAMESPACE, file=sys.stderr)
    grades = grade(args.submissions, args.labs, args.output, timeout=args.timeout)
    students = sorted({g.student for g in grades})
    for student in students:
        mine = [g for g in grades if g.student == student]
        print(f"{student}: {sum(g.status == 'passed' for g in mine)} of {len(mine)} exercises passed")
    print(f"wrote {args.output / 'grades.csv'} and {args.output / 'grades.html'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `labcourse` command."""
    parser = Parser(prog="labcourse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "lab",
        help="open JupyterLab on working copies of the labs (the student build: exercises to write, no outputs; "
        "build/lab/); extra arguments go to jupyter lab",
    )
    p.add_argument(
        "--solutions",
        action="store_true",
        help="the solved labs with their committed outputs instead (build/lab-solutions/)",
    )
    p.add_argument(
        "--workspace", type=Path, help="where the working copies go (default: build/lab or build/lab-solutions)"
    )
    p.add_argument(
        "--root",
        default=None if LABS_DIR.is_dir() else str(Path.cwd()),
        help="serve this folder as it is instead of working copies (default outside a clone: the current folder)",
    )
    p.set_defaults(func=_lab)
    p = sub.add_parser(
        "tensorboard", help="open TensorBoard on the course's runs (lab 10's curves and traces), offline"
    )
    p.add_argument("--logdir", type=Path, help="the runs to show (default: build/, where `make lab` runs the labs)")
    p.add_argument("--host", default="127.0.0.1", help="127.0.0.1, or 0.0.0.0 on a cluster node (tunnel the port)")
    p.add_argument("--port", type=int, default=6006)
    p.set_defaults(func=_tensorboard)
    p = sub.add_parser(
        "gpu-check",
        help="on a GPU machine: the GPU benchmarks and every lab's core path under the gpu profile (timed), "
        "into one JSON; without CUDA, the CPU-side checks only",
    )
    p.add_argument("--output", "-o", type=Path, default=Path("results/gpu-check.json"))
    p.add_argument("--no-labs", action="store_true", help="the benchmarks only, no lab")
    p.add_argument("--plan", action="store_true", help="print the steps it would run, and run nothing")
    p.set_defaults(func=_gpu_check)
    p = sub.add_parser(
        "execute",
        help="run labs top to bottom in a fresh kernel and write them back with their outputs and the machine "
        "they ran on (a lab that fails is left as it was)",
    )
    p.add_argument("notebooks", nargs="*", type=Path, help="the notebooks (default: every lab in labs/)")
    p.add_argument("--profile", choices=("smoke", "cpu", "gpu"), help="default: $LABKIT_PROFILE, else auto-detected")
    p.add_argument("--timeout", type=int, default=7200, help="seconds per cell (default: %(default)s)")
    p.add_argument(
        "--core",
        action="store_true",
        help="the core path alone (deep-dive cells skipped), written to build/core/; the labs stay as they were",
    )
    p.set_defaults(func=_execute)
    p = sub.add_parser(
        "figures",
        help="render the README's measured table and the instructor guide's times from results/, the executed labs "
        "and tests/durations.txt (templates: docs/measured.md, docs/times.md)",
    )
    p.add_argument("--check", action="store_true", help="only compare; exit 1 when the README differs")
    p.set_defaults(func=_figures)
    p = sub.add_parser("student", help="write the student notebooks: solutions replaced by stubs, outputs cleared")
    p.add_argument("--labs", default=str(LABS_DIR), help="the solution notebooks (default: the course's labs/)")
    p.add_argument("--output", "-o", default="build/student", help="where to write them (default: build/student)")
    p.add_argument(
        "--keep-outputs", action="store_true", help="keep the committed outputs (what `make test` runs under nbval)"
    )
    p.set_defaults(func=_student)
    p = sub.add_parser(
        "slides",
        help="write a reveal.js deck per lab from its executed notebook (headings, predictions, figures), "
        "with reveal.js and MathJax beside it so that it opens offline",
    )
    p.add_argument("notebooks", nargs="*", type=Path, help="the notebooks (default: every lab in labs/)")
    p.add_argument("--output", "-o", default="build/slides", help="where to write them (default: build/slides)")
    p.set_defaults(func=_slides)
    p = sub.add_parser(
        "grade",
        help="grade students' notebooks (SUBMISSIONS/<student>/NN_lab.ipynb): each exercise's cell runs in a "
        "child process with a time limit and no network, the course's checks judge it here; writes a table",
    )
    p.add_argument("submissions", nargs="+", type=Path, help="notebooks, or folders of students' folders")
    p.add_argument("--labs", default=str(LABS_DIR), help="the reference labs (default: the course's labs/)")
    p.add_argument("--output", "-o", type=Path, default=Path("build/grades"), help="default: build/grades")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per exercise (default: %(default)s)")
    p.set_defaults(func=_grade)
    # JupyterLab takes its options with or without `--`.
    return run(parser, sub, argv, passes_on={"lab": "unknown"})


if __name__ == "__main__":
    raise SystemExit(main())
