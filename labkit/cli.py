"""Command line: `labkit doctor | prepare | shards | profile | slurm`, the practitioner's commands. The course's own
commands (lab, execute, student, figures, gpu-check, tensorboard) are `labcourse`'s, built on `run` below."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

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


def _slurm(args: argparse.Namespace) -> int:
    from labkit import fileio
    from labkit.parallel.slurm import slurm_script

    if None in (args.sbatch_option or []):  # `--sbatch-option --qos=debug`: argparse took --qos=debug for an option
        hint = next((a for a in args.unknown if a.startswith("--")), "--qos=debug")
        raise ValueError(f"--sbatch-option takes its value after '=', as in --sbatch-option={hint}")
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
        cpus_per_task=args.cpus_per_task,
        mem=args.mem,
        partition=args.partition,
        account=args.account,
        sbatch_options=args.sbatch_option,
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


def silence_stdout() -> None:
    """Point stdout at /dev/null: the reader of its pipe has gone, and later prints (Python's own flush at exit
    among them) must not fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, `<prog> <command>: <reason>`, like every other error of the command."""

    def error(self, message: str) -> NoReturn:
        """Exit with status 2 and the reason on one line, pointing to --help instead of printing the usage."""
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def run(
    parser: Parser,
    commands: argparse._SubParsersAction,
    argv: list[str] | None,
    passes_on: dict[str, str] | None = None,
) -> int:
    """Parse `argv` with `parser` (its subcommands: `commands`) and run the chosen command's `func`: bad input, a
    closed pipe or ^C end it with one line and an exit status instead of a traceback. `passes_on` names the commands
    that hand arguments on to another program: "after --" (only what follows `--`, so that a typo in the command's
    own options is refused) or "unknown" (unknown options too, with or without `--`); the function gets them as
    `args.passthrough`."""
    passes_on = passes_on or {}
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_known_args(argv[:cut])
    after = argv[cut + 1 :]
    how = passes_on.get(args.command)
    if (extra or after) and how is None:
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(extra + after)}")
    args.unknown = extra if how == "after --" else []
    args.passthrough = extra + after if how == "unknown" else after
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe can still be handled
        return code
    except BrokenPipeError:  # `labkit profile gpu | head -1`: the reader had enough, which is no error
        silence_stdout()
        return 0
    except KeyboardInterrupt:
        print(f"{parser.prog} {args.command}: interrupted", file=sys.stderr)
        return 130
    except input_errors() as err:  # bad input, files, assets: one line, no traceback
        print(f"{parser.prog} {args.command}: {one_line(err)}", file=sys.stderr)
        return 2


def input_errors() -> tuple[type[BaseException], ...]:
    """What bad input or files raise: Python's own kinds, and the libraries' that are none of them (safetensors'
    SafetensorError, nbformat's ValidationError), looked up only where the command imported the library."""
    errors: list[type[BaseException]] = [ValueError, TypeError, OSError, RuntimeError]
    if "safetensors" in sys.modules:
        errors.append(sys.modules["safetensors"].SafetensorError)
    if "nbformat" in sys.modules:
        errors.append(sys.modules["nbformat"].ValidationError)
    return tuple(errors)


def one_line(err: BaseException) -> str:
    """An error as one line: OSError's own text when it has one ([Errno 21] ... becomes the reason and the path)."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    return " ".join(str(err).split()) or type(err).__name__


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `labkit` command."""
    parser = Parser(prog="labkit", description=__doc__)
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
        "slurm",
        help="write an sbatch script running a labkit script under torchrun on N nodes",
        usage="labkit slurm SCRIPT [options] -- [the script's arguments]",
    )
    p.add_argument("script", help="the training script; its own arguments go after `--`")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--time", default="00:30:00", help="wall-clock limit, HH:MM:SS")
    p.add_argument("--job-name", default="labkit")
    p.add_argument("--cpus-per-task", type=int, help="CPUs of each node's task (one per node), shared by its ranks")
    p.add_argument("--mem", help="memory per node, as Slurm writes it: 64G, 500M (0: all of it)")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument(
        "--sbatch-option",
        action="append",
        nargs="?",  # so that a value given apart (--sbatch-option --qos=debug) gets a clear error, not argparse's
        metavar="--NAME[=VALUE]",
        help="another #SBATCH line the cluster needs, joined by '=': --sbatch-option=--qos=debug (repeatable)",
    )
    p.add_argument("--output", "-o", help="write the script here instead of printing it")
    p.set_defaults(func=_slurm)
    return run(parser, sub, argv, passes_on={"slurm": "after --"})


if __name__ == "__main__":
    raise SystemExit(main())
