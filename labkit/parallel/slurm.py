"""Many nodes: an sbatch script that starts torchrun on every node of a Slurm job (c10d rendezvous)."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path


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

    The script is named by its absolute path, so the job runs wherever it is submitted from."""
    if not Path(script).is_file():
        raise FileNotFoundError(f"no such script: {script}")
    script = Path(script).resolve()
    counts = {"nodes": nodes, "gpus_per_node": gpus_per_node, "port": port}
    if cpus_per_node is not None:
        counts["cpus_per_node"] = cpus_per_node
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool):  # torchutil.is_int; torch is not imported here
            raise TypeError(f"{name} must be an int, got {value!r}")
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"need nodes >= 1 and gpus_per_node >= 1, got {nodes}, {gpus_per_node}")
    if not re.fullmatch(r"(\d+-)?\d{1,2}:\d{2}:\d{2}", time_limit):
        raise ValueError(f"time_limit must look like HH:MM:SS or D-HH:MM:SS, got {time_limit!r}")
    if not re.fullmatch(r"[\w.-]+", job_name):
        raise ValueError(f"job_name may hold letters, digits, '.', '_' and '-' only, got {job_name!r}")
    if not 1024 <= port <= 65535:
        raise ValueError(f"port must be in [1024, 65535], got {port}")
    venv = venv or (sys.prefix if sys.prefix != sys.base_prefix else None)
    sbatch = [
        f"--job-name={job_name}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        f"--gpus-per-node={gpus_per_node}",
        f"--time={time_limit}",
        "--output=%x-%j.out",
    ]
    sbatch += [f"--cpus-per-task={cpus_per_node}"] * bool(cpus_per_node)
    sbatch += [f"--partition={partition}"] * bool(partition) + [f"--account={account}"] * bool(account)
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
