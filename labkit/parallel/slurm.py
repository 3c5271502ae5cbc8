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
COUNTS = {"nodes": (1, 100_000), "gpus_per_node": (1, 64), "cpus_per_node": (1, 4096), "port": (1024, 65535)}


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
    cpus_per_node: int | None = None,
    partition: str | None = None,
    account: str | None = None,
    venv: str | None = None,
    port: int = 29500,
) -> str:
    """An sbatch script that runs `script` under torchrun on `nodes` × `gpus_per_node` GPUs (c10d rendezvous).

    The script is named by its absolute path, so the job runs wherever it is submitted from. Every value is
    checked before anything is built: a bad one raises TypeError or ValueError naming the option."""
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
    if cpus_per_node is not None:
        check_count("cpus_per_node", cpus_per_node)
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
    sbatch += [f"--cpus-per-task={cpus_per_node}"] * (cpus_per_node is not None)
    sbatch += [f"--partition={partition}"] * (partition is not None) + [f"--account={account}"] * (account is not None)
    command = " ".join(shlex.quote(a) for a in [str(script), *(args or [])])
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {s}" for s in sbatch),
        "# One task per node: torchrun on each node starts one process per GPU.",
        "set -euo pipefail",
        f"source {shlex.quote(venv + '/bin/activate')}" if venv else "# activate the course's environment here",
        'export LABKIT_CACHE="${LABKIT_CACHE:-$HOME/.cache/labkit}"  # staged once on the login node: labkit prepare',
        "export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1             # compute nodes usually have no internet",
        "export OMP_NUM_THREADS=$(( ${SLURM_CPUS_PER_TASK:-8} / " + str(gpus_per_node) + " ))",
        "# NCCL, when a multi-node run misbehaves:",
        "#   export NCCL_DEBUG=INFO           # print the transport and topology NCCL picked",
        "#   export NCCL_SOCKET_IFNAME=ib0    # the network interface to bootstrap on, if the default is wrong",
        "#   export NCCL_IB_DISABLE=1         # only where InfiniBand is absent or broken (slow TCP fallback)",
        "# the rendezvous is on the first node (read whole: `| head -1` can SIGPIPE scontrol, and pipefail aborts)",
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        "head_node=${nodes[0]}",
        "srun --kill-on-bad-exit=1 python -m torch.distributed.run \\",
        f'    --nnodes="$SLURM_NNODES" --nproc_per_node={gpus_per_node} \\',
        f'    --rdzv_backend=c10d --rdzv_endpoint="$head_node:{port}" --rdzv_id="$SLURM_JOB_ID" \\',
        f"    {command}",
        "",
    ]
    return "\n".join(lines)
