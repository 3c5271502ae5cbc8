"""Many nodes: an sbatch script that starts torchrun on every node of a Slurm job (c10d rendezvous)."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

# What Slurm takes in a job script's #SBATCH lines, written so that no value can end its line or split into two
# options: names of ASCII letters, digits, '.', '_' and '-'; a wall-clock limit [D-]HH:MM:SS; counts in a range.
NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
NAMES = re.compile(r"[A-Za-z0-9._-]{1,128}(,[A-Za-z0-9._-]{1,128})*")  # a partition list: the first free one runs it
TIME_LIMIT = re.compile(r"([0-9]{1,3}-)?[0-9]{1,2}:[0-5][0-9]:[0-5][0-9]")
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # C0, DEL and C1: newline, CR, NUL, escapes ...
COUNTS = {"nodes": (1, 100_000), "gpus_per_node": (1, 64), "cpus_per_task": (1, 4096), "port": (1024, 65535)}
# Slurm's --mem: megabytes, or a number with the unit K, M, G or T (any case, as Slurm reads it); 0 is all of a
# node's memory. No sign, no space, no "GB": what Slurm would refuse at submission is refused here.
MEM = re.compile(r"[0-9]{1,12}[KMGTkmgt]?")
# Any other #SBATCH option, as one word: --name or --name=value, the value of characters no shell or Slurm reads
# as anything but text (no space, quote, $, `, ;, |, &, <, >, \, *, ? or newline).
SBATCH_OPTION = re.compile(r"--([a-z][a-z0-9-]{0,63})(=[A-Za-z0-9._:,/=+@%-]{1,1024})?")
# The options slurm_script writes itself, and those that would contradict them (Slurm keeps the last of two, or
# refuses --mem with --mem-per-cpu): each names the option of labkit's to use instead. A name Slurm would take as an
# abbreviation of one of these (--part, --nod) is refused as well.
ONE_TASK = "labkit runs one task per node, whose torchrun starts the node's ranks: set them with --gpus-per-node"
WRITTEN = {
    "job-name": "use --job-name instead (job_name= in slurm_script)",
    "nodes": "use --nodes instead (nodes=)",
    "time": "use --time instead (time_limit=)",
    "partition": "use --partition instead (partition=)",
    "account": "use --account instead (account=)",
    "gpus-per-node": "use --gpus-per-node instead (gpus_per_node=)",
    "gpus": "use --gpus-per-node instead (gpus_per_node=)",
    "gpus-per-task": "use --gpus-per-node instead (gpus_per_node=)",
    "cpus-per-task": "use --cpus-per-task instead (cpus_per_task=)",
    "cpus-per-gpu": "use --cpus-per-task instead (cpus_per_task=), the CPUs of each node's task",
    "mem": "use --mem instead (mem=)",
    "mem-per-cpu": "use --mem instead (mem=), the memory of each node",
    "mem-per-gpu": "use --mem instead (mem=), the memory of each node",
    "ntasks-per-node": ONE_TASK,
    "tasks-per-node": ONE_TASK,
    "ntasks": ONE_TASK,
    "output": "the log is <job name>-<job id>.out (--output=%x-%j.out): name it with --job-name",
}


def check_count(name: str, value: object) -> None:
    """Refuse a count that is not an int (bools included) in the range COUNTS gives for `name`."""
    low, high = COUNTS[name]
    if not isinstance(value, int) or isinstance(value, bool):  # torchutil.is_int; torch is not imported here
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"need {name} >= {low} and <= {high}, got {value}")


def check_name(name: str, value: object) -> None:
    """Refuse a job name, partition (a comma-separated list) or account that Slurm would not take as one word of an
    #SBATCH line."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {value!r}")
    if not (NAMES if name == "partition" else NAME).fullmatch(value):
        listed = ", or several joined by commas" if name == "partition" else ""
        raise ValueError(
            f"{name} may hold ASCII letters, digits, '.', '_' and '-' only (1 to 128 of them{listed}), got {value!r}"
        )


def check_mem(value: object) -> None:
    """Refuse a memory size that Slurm's --mem would not take (or that is more than one word)."""
    if not isinstance(value, str):
        raise TypeError(f"mem must be a str such as '64G', got {value!r}")
    if not MEM.fullmatch(value):
        raise ValueError(
            "mem must be a whole number with an optional unit K, M, G or T (64G, 500M, 128000 megabytes; "
            f"0 is all of each node's memory), got {value!r}"
        )


def check_sbatch_options(options: object) -> None:
    """Refuse extra #SBATCH options that are not a list of --name or --name=value words of safe characters, that
    repeat or contradict an option slurm_script writes itself (naming the one to use instead), or that repeat
    each other (Slurm would keep only the last)."""
    if not isinstance(options, (list, tuple)):
        raise TypeError(f"sbatch_options must be a list of str such as ['--qos=debug'], got {options!r}")
    seen: dict[str, str] = {}
    for option in options:
        if not isinstance(option, str):
            raise TypeError(f"sbatch_options must be a list of str such as ['--qos=debug'], got {option!r}")
        match = SBATCH_OPTION.fullmatch(option)
        if not match:
            raise ValueError(
                "sbatch_options: each must be --name or --name=value, a name of lowercase letters, digits and '-', "
                "a value of letters, digits and . _ - : , / = + @ % (no space, quote or shell character), "
                f"got {option!r}"
            )
        name, value = match.group(1), (match.group(2) or "=")[1:]
        if name == "gres" and any(g.split(":")[0] == "gpu" for g in value.split(",")):
            name = "gpus"  # --gres=gpu:4 is --gpus-per-node=4 said the old way
        written = [w for w in WRITTEN if w.startswith(name)]  # Slurm takes --part for --partition
        if written:
            said = "" if name in WRITTEN else f" (an abbreviation of --{written[0]})"
            advice = WRITTEN.get(name, WRITTEN[written[0]])
            raise ValueError(f"sbatch_options: {option!r}{said} sets what labkit writes itself; {advice}")
        if name in seen:
            raise ValueError(f"sbatch_options: {seen[name]!r} and {option!r} set --{name} twice (Slurm keeps the last)")
        seen[name] = option


def check_text(name: str, value: object) -> None:
    """Refuse a path or argument that is not a str or holds a control character (a newline, CR, NUL ...); it is
    shell-quoted when written, but a control character in a job script is a mistake or an attack."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {value!r}")
    if CONTROL.search(value):
        raise ValueError(f"{name} must not hold control characters (newline, carriage return, NUL ...), got {value!r}")


def slurm_script(
    script: str | Path,
    *,
    nodes: int = 1,
    gpus_per_node: int = 1,
    args: list[str] | None = None,
    job_name: str = "labkit",
    time_limit: str = "00:30:00",
    cpus_per_task: int | None = None,
    mem: str | None = None,
    partition: str | None = None,
    account: str | None = None,
    sbatch_options: list[str] | None = None,
    venv: str | None = None,
    port: int = 29500,
) -> str:
    """An sbatch script that runs `script` under torchrun on `nodes` × `gpus_per_node` GPUs (c10d rendezvous).

    The job runs one task per node, so `cpus_per_task` is the CPUs of a node's task, shared by its `gpus_per_node`
    ranks (each gets OMP_NUM_THREADS = their share, at least 1), and `mem` (Slurm's --mem: 64G, 500M, 0 for all)
    is memory per node. `sbatch_options` adds #SBATCH lines of the cluster's own (--qos=debug, --constraint=a100,
    --exclusive), after labkit's, in the order given. The script is named by its absolute path, so the job runs
    wherever it is submitted from. Every value is checked before anything is built: a bad one raises TypeError or
    ValueError naming the option."""
    given, script = script, Path(script).resolve()
    check_text("script", str(script))
    if not script.is_file():
        raise FileNotFoundError(f"no such script: {given}")
    if not isinstance(args, (list, tuple, type(None))):
        raise TypeError(f"args must be a list of str, got {args!r}")
    for arg in args or []:
        check_text("args", arg)
    for name, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node), ("port", port)):
        check_count(name, value)
    if cpus_per_task is not None:
        check_count("cpus_per_task", cpus_per_task)
        if cpus_per_task < gpus_per_node:
            raise ValueError(
                f"cpus_per_task is the CPUs of each node's one task, shared by its {gpus_per_node} ranks: "
                f"need cpus_per_task >= gpus_per_node ({gpus_per_node}), got {cpus_per_task}"
            )
    if mem is not None:
        check_mem(mem)
    check_sbatch_options([] if sbatch_options is None else sbatch_options)
    check_name("job_name", job_name)
    for name, value in (("partition", partition), ("account", account)):
        if value is not None:
            check_name(name, value)
    if not isinstance(time_limit, str) or not TIME_LIMIT.fullmatch(time_limit):
        raise ValueError(f"time_limit must look like HH:MM:SS or D-HH:MM:SS, got {time_limit!r}")
    venv = venv or (sys.prefix if sys.prefix != sys.base_prefix else None)
    if venv is not None:
        check_text("venv", venv)
    sbatch = [
        f"--job-name={job_name}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        f"--gpus-per-node={gpus_per_node}",
        f"--time={time_limit}",
        "--output=%x-%j.out",
    ]
    sbatch += [f"--cpus-per-task={cpus_per_task}"] * (cpus_per_task is not None) + [f"--mem={mem}"] * (mem is not None)
    sbatch += [f"--partition={partition}"] * (partition is not None) + [f"--account={account}"] * (account is not None)
    sbatch += list(sbatch_options or [])
    command = " ".join(shlex.quote(a) for a in [str(script), *(args or [])])
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {s}" for s in sbatch),
        "# One task per node: torchrun on each node starts one process per GPU.",
        "set -euo pipefail",
        f"source {shlex.quote(venv + '/bin/activate')}" if venv else "# activate the course's environment here",
        'export LABKIT_CACHE="${LABKIT_CACHE:-$HOME/.cache/labkit}"  # staged once on the login node: labkit prepare',
        "export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1             # compute nodes usually have no internet",
        "# each rank's threads: its share of the node's task's CPUs (8 assumed where the job asked for none), >= 1",
        f"threads=$(( ${{SLURM_CPUS_PER_TASK:-8}} / {gpus_per_node} ))",
        "export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))",
        "# NCCL, when a multi-node run misbehaves:",
        "#   export NCCL_DEBUG=INFO           # print the transport and topology NCCL picked",
        "#   export NCCL_SOCKET_IFNAME=ib0    # the network interface to bootstrap on, if the default is wrong",
        "#   export NCCL_IB_DISABLE=1         # only where InfiniBand is absent or broken (slow TCP fallback)",
        "# the rendezvous is on the first node (read whole: `| head -1` can SIGPIPE scontrol, and pipefail aborts)",
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        "head_node=${nodes[0]}",
        "# --cpus-per-task said again: srun of Slurm 22.05 to 23.02 does not pass the job's on to its tasks",
        'srun ${SLURM_CPUS_PER_TASK:+"--cpus-per-task=$SLURM_CPUS_PER_TASK"} --kill-on-bad-exit=1 \\',
        "    python -m torch.distributed.run \\",
        f'    --nnodes="$SLURM_NNODES" --nproc_per_node={gpus_per_node} \\',
        f'    --rdzv_backend=c10d --rdzv_endpoint="$head_node:{port}" --rdzv_id="$SLURM_JOB_ID" \\',
        f"    {command}",
        "",
    ]
    return "\n".join(lines)
