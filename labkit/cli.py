"""Command line: `labkit doctor | prepare | shards | profile | lab | tensorboard | slurm | gpu-check | execute |
figures | student`."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import NoReturn

LABS_DIR = Path(__file__).resolve().parent.parent / "labs"

# Each command imports the labkit modules it needs inside its function: `labkit slurm` on a login node
# or `labkit --help` should not pay for importing torch and transformers.


def _doctor(args: argparse.Namespace) -> int:
    from labkit import env

    info = env.collect()
    print(json.dumps(info, indent=1, default=str) if args.json else env.format_report(info))
    return 0


def _stage_assets() -> list[dict]:
    """Stage every offline asset (convert the model, check the corpus); report what is where."""
    from labkit import assets
    from labkit.data import load_documents

    report = []
    for name in assets.OFFLINE_MODELS:
        path = assets.offline_model_dir(name)
        report.append({"asset": f"model {name}", "path": str(path), "bytes": assets.dir_bytes(path)})
    n = len(load_documents("wiki", split="all"))
    corpus = assets.WIKI_SUMMARIES.path()
    report.append({"asset": f"corpus wiki ({n} articles)", "path": str(corpus), "bytes": corpus.stat().st_size})
    return report


def _prepare(args: argparse.Namespace) -> int:
    from labkit import assets
    from labkit.bench import fmt_bytes

    try:
        report = _stage_assets()
    except assets.AssetError as err:
        print(f"labkit prepare: {err}", file=sys.stderr)
        return 1
    for row in report:
        print(f"{row['asset']:<32} {fmt_bytes(row['bytes']):>10}  {row['path']}")
    print(f"cache: {assets.cache_dir()} (set ${assets.CACHE_ENV_VAR} to move it)")
    return 0


def _shards(args: argparse.Namespace) -> int:
    from labkit import assets, fileio, shards
    from labkit.bench import fmt_bytes
    from labkit.data import load_corpus
    from labkit.models import DEFAULT_MODEL, load_tokenizer

    if args.documents is not None and args.documents < 1:
        raise ValueError(f"--documents must be >= 1, got {args.documents}")
    if args.shard_tokens < 2:  # refused here, before the corpus is tokenized, rather than by write_shards after
        raise ValueError(f"--shard-tokens must be >= 2, got {args.shard_tokens}")
    out = args.output or shards.default_dir()
    if problem := assets.write_access_problem(out):
        raise ValueError(f"{problem}; or write the shards elsewhere (labkit shards DIR) and pass --shards DIR")
    if problem := fileio.destination_problem(out, legacy=shards.is_shard_directory):  # before the corpus loads
        raise ValueError(problem)
    texts = load_corpus("wiki", "train")[: args.documents]
    tokenizer = load_tokenizer(args.model or DEFAULT_MODEL)
    with fileio.atomic_directory(out, legacy=shards.is_shard_directory) as tmp:  # a job never sees half the shards
        paths = shards.tokenize_to_shards(texts, tokenizer, tmp, shard_tokens=args.shard_tokens)
    tokens = sum(shards.read_shard_info(out / p.name).tokens for p in paths)
    print(
        f"wrote {len(paths)} shards, {tokens:,} tokens of {len(texts):,} documents "
        f"({fmt_bytes(assets.dir_bytes(out))}) to {out}"
    )
    return 0


def _profile(args: argparse.Namespace) -> int:
    from labkit import profiles

    print(profiles.describe(profiles.get_profile(args.name)))
    return 0


def _lab(args: argparse.Namespace) -> int:
    jupyter = shutil.which("jupyter", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    if jupyter is None:
        print("labkit lab: JupyterLab is not installed; run `pip install -e .[dev]` (or `make lab`)", file=sys.stderr)
        return 1
    root = args.root
    if root is None:  # working copies, so that running a lab never modifies a tracked notebook
        from labkit.student import workspace

        root = args.workspace or LABS_DIR.parent / "build" / ("lab-solutions" if args.solutions else "lab")
        for name, what in workspace(LABS_DIR, root, solutions=args.solutions).items():
            print(f"{root.name}/{name}: {what}")
    # Offline by default: the extension manager would otherwise query PyPI.
    cmd = [jupyter, "lab", f"--ServerApp.root_dir={root}", "--LabApp.extension_manager=readonly"]
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
            "labkit tensorboard: TensorBoard is not installed; run `pip install -e .[monitor]` (or `make lab`)",
            file=sys.stderr,
        )
        return 1
    # Offline: TensorBoard serves its own pages from the package; it fetches nothing at run time.
    cmd = [sys.executable, "-m", "tensorboard.main", f"--logdir={logdir}", f"--host={args.host}", f"--port={args.port}"]
    print("starting:", " ".join(cmd), flush=True)
    os.execv(sys.executable, cmd)


def _slurm(args: argparse.Namespace) -> int:
    from labkit import fileio
    from labkit.parallel.slurm import slurm_script

    if args.unknown:
        raise ValueError(
            f"unknown option(s) {' '.join(args.unknown)}; the training script's own arguments go "
            f"after `--`: labkit slurm {args.script} [options] -- {' '.join(args.unknown)}"
        )
    text = slurm_script(
        args.script,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        args=args.passthrough,
        job_name=args.job_name,
        time_limit=args.time,
        partition=args.partition,
        account=args.account,
    )
    if args.output:
        if Path(args.output).is_dir():
            raise ValueError(
                f"-o {args.output} is a directory: give a file name, e.g. {Path(args.output) / 'job.sbatch'}"
            )
        fileio.atomic_write_text(args.output, text)
        print(f"wrote {args.output}; submit it with: sbatch {args.output}")
    else:
        print(text, end="")
    return 0


def _gpu_check(args: argparse.Namespace) -> int:
    from labkit import gpucheck
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
        _silence_stdout()


def _silence_stdout() -> None:
    """Point stdout at /dev/null: the reader of its pipe has gone, and later prints (Python's own flush at exit
    among them) must not fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _execute(args: argparse.Namespace) -> int:
    from labkit import profiles
    from labkit.execute import check_options, execute

    notebooks = args.notebooks or sorted(LABS_DIR.glob("[0-9][0-9]_*.ipynb"))
    if not notebooks:
        raise FileNotFoundError(f"no labs in {LABS_DIR}: name the notebooks to run")
    profile = args.profile or profiles.get_profile().name  # $LABKIT_PROFILE, else auto-detected
    check_options(profile, args.timeout)
    written, failed = [], []
    for path in notebooks:  # every notebook runs, whatever happened to the one before or to stdout
        start = time.perf_counter()
        _say(f"{Path(path).name}: running under profile {profile!r} ...")
        try:
            dropped = execute(path, profile, timeout=args.timeout)
        except (ValueError, OSError, RuntimeError) as err:  # missing, malformed, or its run stopped short
            failed.append(Path(path).name)
            print(f"labkit execute: {_one_line(err)}", file=sys.stderr, flush=True)
            continue
        written.append(Path(path).name)
        _say(f"{Path(path).name}: written back after {time.perf_counter() - start:.0f} s")
        for line in dropped:
            _say(f"  dropped {line}")
    _say(f"written back: {', '.join(written) or 'none'}")
    if failed:
        _say(f"failed (left as they were): {', '.join(failed)}")
    return 1 if failed else 0


def _figures(args: argparse.Namespace) -> int:
    from labkit import figures

    stale = figures.stale() if args.check else figures.update()
    for target, template in figures.TARGETS.items():
        typed = figures.typed_rows((figures.ROOT / template).read_text(encoding="utf-8"))
        state = ("DIFFERS FROM" if args.check else "rendered anew from") if target in stale else "matches"
        note = f" ({len(typed)} rows still typed by hand)" if typed else ""
        print(f"{target} {state} {template}{note}")
    return 1 if args.check and stale else 0


def _student(args: argparse.Namespace) -> int:
    from labkit.student import build_student

    counts = build_student(args.labs, args.output, keep_outputs=args.keep_outputs)
    for name, count in counts.items():
        print(f"{name}: {count} exercise region{'s' * (count != 1)} stubbed")
    print(f"wrote the student notebooks to {args.output}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, `labkit <command>: <reason>`, like every other error of the command."""

    def error(self, message: str) -> NoReturn:
        """Exit with status 2 and the reason on one line, pointing to --help instead of printing the usage."""
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `labkit` command."""
    parser = _Parser(prog="labkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="report the machine, GPUs, precisions and offline assets")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_doctor)
    p = sub.add_parser("prepare", help="stage every offline asset once (e.g. on a cluster login node)")
    p.set_defaults(func=_prepare)
    p = sub.add_parser("shards", help="tokenize the offline corpus's training split into shards (multi-node jobs)")
    p.add_argument(
        "output",
        nargs="?",
        type=Path,
        default=None,
        help="where to write them (default: the cache, where ddp_train.py looks)",
    )
    p.add_argument("--documents", type=int, help="the first N training documents (default: all)")
    p.add_argument("--model", help="whose tokenizer: a model name or path (default: the course's model)")
    p.add_argument("--shard-tokens", type=int, default=2**20, help="tokens per shard (default: %(default)s)")
    p.set_defaults(func=_shards)
    p = sub.add_parser("profile", help="show the sizes of a run profile")
    p.add_argument("name", nargs="?", help="smoke, cpu or gpu (default: auto-detected)")
    p.set_defaults(func=_profile)
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
        "slurm",
        help="write an sbatch script running a labkit script under torchrun on N nodes",
        usage="labkit slurm SCRIPT [options] -- [the script's arguments]",
    )
    p.add_argument("script", help="the training script; its own arguments go after `--`")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--time", default="00:30:00", help="wall-clock limit, HH:MM:SS")
    p.add_argument("--job-name", default="labkit")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--output", "-o", help="write the script here instead of printing it")
    p.set_defaults(func=_slurm)
    p = sub.add_parser(
        "gpu-check",
        help="on a GPU machine: every lab under the gpu profile and the GPU benchmarks, "
        "into one JSON; without CUDA, the CPU-side checks only",
    )
    p.add_argument("--output", "-o", type=Path, default=Path("results/gpu-check.json"))
    p.add_argument("--no-labs", action="store_true", help="benchmarks only (minutes instead of an hour)")
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
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_known_args(argv[:cut])
    after = argv[cut + 1 :]
    if (extra or after) and args.command not in ("lab", "slurm"):
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra + after)}")
    # JupyterLab takes its options with or without `--`; a job script's go after `--`, so that a typo in
    # labkit's own options (--gpu-per-node) is refused instead of passed on to the script.
    args.unknown = extra if args.command == "slurm" else []
    args.passthrough = after if args.command == "slurm" else extra + after
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe can still be handled
        return code
    except BrokenPipeError:  # `labkit profile gpu | head -1`: the reader had enough, which is no error
        _silence_stdout()
        return 0
    except KeyboardInterrupt:
        print(f"labkit {args.command}: interrupted", file=sys.stderr)
        return 130
    except _input_errors() as err:  # bad input, files, assets: one line, no traceback
        print(f"labkit {args.command}: {_one_line(err)}", file=sys.stderr)
        return 2


def _input_errors() -> tuple[type[BaseException], ...]:
    """What bad input or files raise: Python's own kinds, and the libraries' that are none of them (safetensors'
    SafetensorError, nbformat's ValidationError), looked up only where the command imported the library."""
    errors: list[type[BaseException]] = [ValueError, TypeError, OSError, RuntimeError]
    if "safetensors" in sys.modules:
        errors.append(sys.modules["safetensors"].SafetensorError)
    if "nbformat" in sys.modules:
        errors.append(sys.modules["nbformat"].ValidationError)
    return tuple(errors)


def _one_line(err: BaseException) -> str:
    """An error as one line: OSError's own text when it has one ([Errno 21] ... becomes the reason and the path)."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    return " ".join(str(err).split()) or type(err).__name__


if __name__ == "__main__":
    raise SystemExit(main())
