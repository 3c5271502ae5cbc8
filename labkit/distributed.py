"""Data parallelism on torch.distributed: a torchrun launcher a notebook can call, and data parallelism
written from scratch (naive all-reduce, then bucketed and overlapped with backward) next to torch DDP.

The same code runs on a laptop (gloo, CPU processes), a GPU node (NCCL) or many nodes under Slurm.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

RESULT_ENV = "LABKIT_RESULT_DIR"
DEVICE_ENV = "LABKIT_DIST_DEVICE"  # 'cpu' or 'cuda': where the ranks run, instead of the automatic choice
LAUNCHER_ENV = "LABKIT_LAUNCHER"  # 'pid:start_time' of the process that called launch(); ranks die with it


class RankError(RuntimeError):
    """A rank of a launched job failed; the message carries that rank's own traceback."""


# ----------------------------------------------------------------------------- where the ranks run


@dataclass(frozen=True)
class Placement:
    """Where the ranks of one node run, and the one line that says why."""

    device_type: str  # 'cuda': rank i on GPU i of the node; 'cpu': CPU processes
    backend: str  # 'nccl' | 'gloo'
    reason: str


def placement(ranks_per_node: int, gpus: int, prefer: str | None = None) -> Placement:
    """One rank per GPU on NCCL when the node has a GPU for every rank, else CPU ranks on gloo.

    Two ranks on a one-GPU node would share it (NCCL refuses two ranks on one device), so they run on
    the CPU instead. `prefer` ('cpu' or 'cuda', e.g. from $LABKIT_DIST_DEVICE) overrides the choice.
    """
    if ranks_per_node < 1 or gpus < 0:
        raise ValueError(f"need ranks_per_node >= 1 and gpus >= 0, got {ranks_per_node}, {gpus}")
    if prefer not in (None, "", "cpu", "cuda"):
        raise ValueError(f"${DEVICE_ENV} must be 'cpu' or 'cuda', got {prefer!r}")
    ranks = f"{ranks_per_node} rank{'s' * (ranks_per_node != 1)}"
    if prefer == "cpu":
        return Placement("cpu", "gloo", f"{ranks} on the CPU with gloo (${DEVICE_ENV}=cpu)")
    if gpus >= ranks_per_node:
        return Placement("cuda", "nccl", f"{ranks} on {ranks_per_node} of this node's {gpus} GPUs, one each, NCCL")
    if prefer == "cuda":
        raise ValueError(f"${DEVICE_ENV}=cuda needs a GPU per rank: {ranks} per node, {gpus} GPU(s) visible")
    why = "no CUDA GPU is visible" if gpus == 0 else f"{gpus} GPU(s) for {ranks}, and NCCL needs a GPU per rank"
    return Placement("cpu", "gloo", f"{ranks} on the CPU with gloo: {why}")


def visible_gpus() -> int:
    """CUDA devices this process may use (after CUDA_VISIBLE_DEVICES)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# ----------------------------------------------------------------------------- inside a rank


@contextlib.contextmanager
def rank_context() -> Iterator[tuple[int, int, torch.device]]:
    """Inside a torchrun worker: init the process group, yield (rank, world_size, device), clean up.

    The device follows `placement` (rank 0 prints why, unless the launcher already did). An exception
    is written to the launcher's result directory before it propagates, so that `launch` can report
    the rank's own error instead of torchrun's summary. The rank exits if its torchrun agent or the
    launching process dies, so that no rank is left running on its own.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    where = placement(int(os.environ.get("LOCAL_WORLD_SIZE", world)), visible_gpus(), os.environ.get(DEVICE_ENV))
    if rank == 0 and not os.environ.get(DEVICE_ENV):
        print(f"labkit: {where.reason}", flush=True)
    watching = _exit_with_parents()
    device = torch.device("cuda", local) if where.device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(where.backend)
    try:
        yield rank, world, device
    except BaseException:
        out = os.environ.get(RESULT_ENV)
        if out:
            Path(out, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        watching.set()
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_with_parents(interval: float = 0.5) -> threading.Event:
    """Watch, from a daemon thread, the torchrun agent (our parent) and the launching process; exit when
    either is gone. torchrun puts each worker in a session of its own, so a killed agent (or a killed
    notebook kernel) would otherwise leave the ranks running, blocked in a collective forever.
    Setting the returned event stops the watch."""
    import psutil

    parent = os.getppid()
    launcher = os.environ.get(LAUNCHER_ENV, "")

    def alive(pid: int, started: float) -> bool:
        try:
            proc = psutil.Process(pid)
            return proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    pid, _, started = launcher.partition(":")
    watched = [(int(pid), float(started))] if launcher else []

    stop = threading.Event()

    def watch() -> None:
        while os.getppid() == parent and all(alive(p, t) for p, t in watched):
            if stop.wait(interval):
                return
        with contextlib.suppress(OSError):  # the log's reader may be what died
            print(f"labkit: rank {os.environ.get('RANK')} exits: its launcher or torchrun agent is gone", flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="labkit-orphan-watch", daemon=True).start()
    return stop


def save_result(result: dict[str, Any]) -> None:
    """Write this rank's result (JSON) for the launcher to collect."""
    out = os.environ.get(RESULT_ENV)
    if out:
        rank = int(os.environ.get("RANK", 0))
        tmp = Path(out, f".result_rank{rank}.json")
        tmp.write_text(json.dumps(result))
        tmp.rename(Path(out, f"result_rank{rank}.json"))


# ----------------------------------------------------------------------------- the launcher


def launch(
    script: str | Path,
    nproc: int = 2,
    args: list[str] | None = None,
    *,
    timeout: float = 300,
    echo: Callable[[str], None] | None = print,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run `script` under torchrun with `nproc` local processes; return each rank's saved result.

    The ranks run where `placement` puts them (one line says where and why). The log is streamed line
    by line to `echo`. If any rank fails, the whole job is stopped and a RankError carries the first
    failing rank's traceback; past `timeout` seconds, or on an interrupt, the job is killed, so a hung
    rank never hangs the caller and no rank outlives the call.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    script = Path(script)
    if not script.is_file():
        raise FileNotFoundError(f"no such script: {script}")
    env = {**os.environ, **(env or {})}
    where = placement(nproc, visible_gpus(), env.get(DEVICE_ENV))
    (echo or print)(f"labkit: {where.reason}")
    me = _process_id()
    with tempfile.TemporaryDirectory(prefix="labkit-launch-") as out:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(script),
            *(args or []),
        ]
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={
                **env,
                RESULT_ENV: out,
                DEVICE_ENV: where.device_type,
                LAUNCHER_ENV: me,
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            },
        )
        lines: list[str] = []

        def pump() -> None:
            for line in proc.stdout:
                lines.append(line)
                if echo:
                    echo(line.rstrip("\n"))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            raise TimeoutError(
                f"{script.name} did not finish within {timeout:.0f} s and was killed; "
                "last output:\n" + "".join(lines[-20:])
            ) from None
        except BaseException:  # an interrupted notebook cell, Ctrl-C: stop the job before giving up
            _kill_tree(proc)
            raise
        finally:
            reader.join(timeout=5)
        errors = sorted(Path(out).glob("error_rank*.txt"))
        if errors:
            raise RankError(f"{errors[0].stem.replace('error_', '')} of {script.name} failed:\n{errors[0].read_text()}")
        if code != 0:
            raise RankError(f"{script.name} exited with {code}; last output:\n" + "".join(lines[-30:]))
        return [
            json.loads(p.read_text())
            for p in sorted(Path(out).glob("result_rank*.json"), key=lambda p: int(p.stem.removeprefix("result_rank")))
        ]


def _process_id(pid: int | None = None) -> str:
    """'pid:start_time' of a process (default: this one): unlike a bare pid, never names a later process."""
    import psutil

    proc = psutil.Process(pid)
    return f"{proc.pid}:{proc.create_time()!r}"


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill torchrun and every worker: workers run in sessions of their own, so a process group is not enough."""
    import psutil

    try:
        family = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(family, timeout=10)
    proc.wait()


# ----------------------------------------------------------------------------- data parallelism from scratch


def all_reduce_gradients(model: nn.Module) -> None:
    """The naive version: after backward, average every gradient across ranks, one all-reduce each."""
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world


class BucketedDataParallel:
    """Gradient all-reduce in buckets, started during backward as soon as a bucket's gradients are ready.

    Parameters are bucketed in reverse order (the order backward produces their gradients); a hook on
    each parameter marks it ready, and a full bucket is flattened and all-reduced asynchronously while
    backward goes on computing earlier layers' gradients. `finish()` waits for the last transfers and
    copies the averaged gradients back. This is the idea inside torch DDP, without its refinements.
    """

    def __init__(self, model: nn.Module, bucket_mb: float = 25.0):
        if not dist.is_initialized():
            raise RuntimeError("init the process group first (labkit.distributed.rank_context)")
        self.model, self.world = model, dist.get_world_size()
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:  # start identical, as DDP does
            dist.broadcast(p.data, src=0)
        limit = bucket_mb * 2**20
        self.buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in reversed(params):
            if self.buckets[-1] and size + p.numel() * p.element_size() > limit:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._pending: list[int] = [0] * len(self.buckets)
        self._works: list[tuple[Any, torch.Tensor, int]] = []
        for p in params:
            p.register_post_accumulate_grad_hook(self._ready)
        self.reset()

    def reset(self) -> None:
        """Before each backward: no bucket has its gradients yet."""
        self._pending = [len(b) for b in self.buckets]
        self._works = []

    def _ready(self, p: nn.Parameter) -> None:
        i = self._bucket_of[id(p)]
        self._pending[i] -= 1
        if self._pending[i] == 0:  # the whole bucket is ready: send it while backward continues
            flat = torch.cat([q.grad.flatten() for q in self.buckets[i]])
            self._works.append((dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True), flat, i))

    def finish(self) -> None:
        """After backward: wait for every bucket and write the averaged gradients back."""
        if any(self._pending):
            raise RuntimeError(
                "some parameters received no gradient in this backward; every parameter must take part (or be frozen)"
            )
        for work, flat, i in self._works:
            work.wait()
            flat /= self.world
            offset = 0
            for q in self.buckets[i]:
                q.grad.copy_(flat[offset : offset + q.numel()].view_as(q.grad))
                offset += q.numel()
        self.reset()


def time_all_reduce(
    numel: int, device: torch.device, repeats: int = 5, all_reduce: Callable[[torch.Tensor], Any] = dist.all_reduce
) -> float:
    """Median seconds for one all-reduce of `numel` fp32 values across the group (call on every rank)."""
    from labkit.bench import time_fn

    x = torch.ones(numel, device=device)
    return time_fn(lambda: all_reduce(x), warmup=1, repeats=repeats, device=device, before=dist.barrier).median


# ----------------------------------------------------------------------------- ring all-reduce from scratch


def ring_send_chunk(rank: int, world: int, step: int) -> int:
    """The chunk `rank` sends to rank + 1 at `step` of a ring all-reduce (steps 0 … 2(p − 1) − 1).

    Reduce-scatter (steps < p − 1) passes partial sums along, so after it rank r holds the whole sum of
    chunk r + 1; all-gather then passes the finished sums along. Each rank receives chunk (sent − 1).
    """
    if not 0 <= step < 2 * (world - 1):
        raise ValueError(f"a ring all-reduce over {world} ranks has steps 0..{2 * (world - 1) - 1}, got {step}")
    if step < world - 1:
        return (rank - step) % world
    return (rank + 1 - (step - world + 1)) % world


def ring_step(chunks: list[list[torch.Tensor]], step: int) -> list[list[torch.Tensor]]:
    """One step of a ring all-reduce simulated in one process: chunks[r][c] is rank r's copy of chunk c.
    All ranks send at once, so every message carries the value from before the step."""
    world = len(chunks)
    out = [list(row) for row in chunks]
    for rank in range(world):
        c, right = ring_send_chunk(rank, world, step), (rank + 1) % world
        out[right][c] = chunks[right][c] + chunks[rank][c] if step < world - 1 else chunks[rank][c]
    return out


def simulate_ring_all_reduce(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sum p tensors (one per simulated rank) with 2(p − 1) ring steps; every rank ends with the sum."""
    world = len(tensors)
    if world == 0 or any(t.shape != tensors[0].shape for t in tensors):
        raise ValueError("need one tensor per rank, all of the same shape")
    chunks = [list(t.flatten().tensor_split(world)) for t in tensors]
    for step in range(2 * (world - 1)):
        chunks = ring_step(chunks, step)
    return [torch.cat(row).view_as(tensors[0]) for row in chunks]


def ring_all_reduce_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` across the process group in place with the ring algorithm, built from point-to-point
    sends: each rank sends 2(p − 1)/p of the tensor whatever p is, which is why rings scale."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce_ works in place on a contiguous tensor")
    chunks = tensor.view(-1).tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(2 * (world - 1)):
        send = ring_send_chunk(rank, world, step)
        recv = (send - 1) % world
        incoming = torch.empty_like(chunks[recv])
        ops = [dist.P2POp(dist.isend, chunks[send], right), dist.P2POp(dist.irecv, incoming, left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if step < world - 1:
            chunks[recv].add_(incoming)
        else:
            chunks[recv].copy_(incoming)
    return tensor


# ----------------------------------------------------------------------------- many nodes: Slurm


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
    import re
    import shlex

    if not Path(script).is_file():
        raise FileNotFoundError(f"no such script: {script}")
    script = Path(script).resolve()
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


# ----------------------------------------------------------------------------- tensor parallelism (Megatron MLP)


def megatron_mlp_shard(fc1: nn.Linear, fc2: nn.Linear, rank: int, world: int) -> tuple[nn.Linear, nn.Linear]:
    """This rank's slices of an MLP fc2(act(fc1(x))): fc1 split by output features (columns of Wᵀ), fc2 by
    input features (rows of Wᵀ). Each rank computes its partial output with no communication; one
    all-reduce sums them. fc2's bias is kept on rank 0 only, so that it is added once."""
    hidden = fc1.out_features
    if hidden % world:
        raise ValueError(f"hidden size {hidden} does not split evenly over {world} ranks")
    part = slice(rank * hidden // world, (rank + 1) * hidden // world)
    a = nn.Linear(fc1.in_features, hidden // world, bias=fc1.bias is not None)
    b = nn.Linear(hidden // world, fc2.out_features, bias=fc2.bias is not None and rank == 0)
    with torch.no_grad():
        a.weight.copy_(fc1.weight[part])
        if fc1.bias is not None:
            a.bias.copy_(fc1.bias[part])
        b.weight.copy_(fc2.weight[:, part])
        if b.bias is not None:
            b.bias.copy_(fc2.bias)
    return a, b


def tensor_parallel_mlp(
    x: torch.Tensor,
    a: nn.Linear,
    b: nn.Linear,
    activation: Callable[[torch.Tensor], torch.Tensor] = torch.nn.functional.gelu,
) -> torch.Tensor:
    """The MLP's output from this rank's shard: partial result, then a sum over ranks."""
    y = b(activation(a(x)))
    dist.all_reduce(y, op=dist.ReduceOp.SUM)
    return y
