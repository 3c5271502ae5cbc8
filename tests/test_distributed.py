"""Data parallelism on 2 gloo ranks under torchrun: DDP equals one process, from-scratch equals DDP,
and a failing or hung rank ends the job with a clear error instead of hanging."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from labkit import distributed
from tests.numerics import assert_within, reorder_bound

SCRIPT = Path(__file__).parents[1] / "labs" / "scripts" / "dp_parity.py"
HOLD = Path(__file__).parent / "scripts" / "hold_ranks.py"


@pytest.fixture(scope="module")
def results():
    lines = []
    res = distributed.launch(SCRIPT, nproc=2, echo=lines.append, timeout=180)
    return res, lines


def test_ddp_equals_one_process_on_the_whole_batch(results):
    res, lines = results
    where = distributed.placement(2, distributed.visible_gpus())
    assert f"labkit: {where.reason}" in lines  # the launcher says where the ranks run, and they do
    assert [r["device"] for r in res] == (["cuda:0", "cuda:1"] if where.device_type == "cuda" else ["cpu", "cpu"])
    assert [r["rank"] for r in res] == [0, 1] and all(r["world"] == 2 for r in res)
    for r in res:
        assert r["ddp_vs_single_batch"] < 1e-12  # fp64: gradients of the first step
        assert r["params_after_steps_vs_single"] < 1e-10  # after 5 AdamW steps
    assert res[0]["params_sha256"] == res[1]["params_sha256"]  # ranks bit-identical


def test_from_scratch_data_parallel_equals_torch_ddp(results):
    res, _ = results
    for r in res:
        assert r["naive_vs_ddp"] < 1e-12
        assert r["bucketed_vs_ddp"] < 1e-12 and r["buckets"] > 1  # several buckets were exercised


def test_ring_all_reduce_from_sends_equals_the_library_all_reduce(results):
    res, _ = results
    for r in res:
        assert r["ring_elements"] == 1001 and r["ring_vs_all_reduce"] < 1e-12


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_simulated_ring_leaves_the_sum_on_every_rank(world):
    tensors = [torch.randn(7, 3, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    total = torch.stack(tensors).sum(0)
    bound = reorder_bound(world, torch.stack(tensors).abs().sum(0))  # the ring adds in another order
    for out in distributed.simulate_ring_all_reduce(tensors):
        assert out.shape == (7, 3)
        assert_within(out, total, bound)


def test_ring_steps_send_each_chunk_once_per_phase():
    world = 4
    for phase in (range(0, world - 1), range(world - 1, 2 * (world - 1))):
        for rank in range(world):
            sent = [distributed.ring_send_chunk(rank, world, s) for s in phase]
            assert len(set(sent)) == world - 1  # p − 1 different chunks: 2(p − 1)/p of the data in all
    with pytest.raises(ValueError, match="steps 0..5"):
        distributed.ring_send_chunk(0, world, 6)


def test_after_reduce_scatter_rank_r_holds_the_sum_of_chunk_r_plus_1():
    world = 3
    chunks = [[torch.tensor([float(10 * r + c)]) for c in range(world)] for r in range(world)]
    for step in range(world - 1):
        chunks = distributed.ring_step(chunks, step)
    for r in range(world):
        c = (r + 1) % world
        assert chunks[r][c].item() == sum(10 * q + c for q in range(world))


def test_simulated_ring_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="same shape"):
        distributed.simulate_ring_all_reduce([torch.zeros(3), torch.zeros(4)])


def test_a_failing_rank_ends_the_job_with_its_own_error():
    import psutil

    start = time.time()
    with pytest.raises(distributed.RankError, match=r"rank1 of dp_parity.py failed(.|\n)*ValueError: boom from rank 1"):
        distributed.launch(SCRIPT, nproc=2, args=["--fail-rank", "1"], echo=None, timeout=120)
    assert time.time() - start < 120
    survivors = [p for p in psutil.process_iter(["cmdline"]) if "--fail-rank" in " ".join(p.info["cmdline"] or [])]
    assert survivors == []  # the other rank was stopped too


def test_a_hung_rank_is_killed_at_the_timeout():
    import psutil

    start = time.time()
    with pytest.raises(TimeoutError, match="did not finish within 20 s"):
        distributed.launch(SCRIPT, nproc=2, args=["--hang-rank", "1"], echo=None, timeout=20)
    assert time.time() - start < 60
    survivors = [p for p in psutil.process_iter(["cmdline"]) if "--hang-rank" in " ".join(p.info["cmdline"] or [])]
    assert survivors == []  # no worker outlives the job


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _still_running_after(pids: list[int], seconds: float) -> list[int]:
    deadline = time.time() + seconds
    while (left := [pid for pid in pids if _running(pid)]) and time.time() < deadline:
        time.sleep(0.2)
    return left


def _start_held_job(ready: Path) -> tuple[subprocess.Popen, int, list[int]]:
    """A launcher process (as a notebook kernel is) running a 2-rank job that never ends: (launcher, agent, ranks)."""
    import psutil

    # SIGINT raises KeyboardInterrupt, as in a notebook kernel, even when this test runs in a background job
    # (which starts with SIGINT ignored, and Python then installs no handler)
    code = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); from labkit import distributed; "
        f"distributed.launch({str(HOLD)!r}, 2, [{str(ready)!r}], echo=None, timeout=600)"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.time() + 120
    while len(pids := sorted(ready.glob("rank*.pid"))) < 2:
        assert launcher.poll() is None and time.time() < deadline, "the held job did not start"
        time.sleep(0.2)
    ranks = [int(p.read_text()) for p in pids]
    return launcher, psutil.Process(ranks[0]).ppid(), ranks


@pytest.mark.parametrize("end", ["agent killed", "launcher killed", "launcher interrupted"])
def test_no_rank_outlives_the_end_of_its_launch(tmp_path, end):
    launcher, agent, ranks = _start_held_job(tmp_path)
    assert agent != launcher.pid and all(_running(pid) for pid in (agent, *ranks))
    try:
        if end == "agent killed":  # torchrun's agent dies (OOM killer, scancel of one step)
            os.kill(agent, signal.SIGKILL)
        elif end == "launcher killed":  # the notebook kernel dies or is restarted
            launcher.kill()
        else:  # Kernel > Interrupt, or Ctrl-C
            launcher.send_signal(signal.SIGINT)
        assert _still_running_after([agent, *ranks], 15) == []
    finally:
        for pid in (agent, *ranks):
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.kill()
        launcher.wait()


def test_launcher_checks_its_arguments(tmp_path):
    with pytest.raises(FileNotFoundError):
        distributed.launch(tmp_path / "missing.py")
    with pytest.raises(ValueError, match="nproc"):
        distributed.launch(SCRIPT, nproc=0)


@pytest.mark.parametrize(
    "gpus, ranks, device",
    [
        (0, 1, "cpu"),
        (0, 2, "cpu"),
        (1, 1, "cuda"),
        (1, 2, "cpu"),
        (2, 2, "cuda"),
        (2, 4, "cpu"),
        (8, 2, "cuda"),
        (8, 8, "cuda"),
    ],
)
def test_ranks_get_a_gpu_each_or_run_on_the_cpu(gpus, ranks, device):
    where = distributed.placement(ranks, gpus)
    assert (where.device_type, where.backend) == (device, {"cuda": "nccl", "cpu": "gloo"}[device])
    assert where.reason.startswith(f"{ranks} rank")
    if device == "cpu":
        assert ("no CUDA GPU" if gpus == 0 else f"{gpus} GPU(s) for {ranks} ranks") in where.reason


def test_placement_can_be_forced_and_says_when_it_cannot():
    assert distributed.placement(2, 8, prefer="cpu").device_type == "cpu"
    assert distributed.placement(2, 2, prefer="cuda").device_type == "cuda"
    with pytest.raises(ValueError, match="needs a GPU per rank: 2 ranks per node, 1 GPU"):
        distributed.placement(2, 1, prefer="cuda")
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        distributed.placement(2, 1, prefer="gpu")
    with pytest.raises(ValueError, match="ranks_per_node >= 1"):
        distributed.placement(0, 1)


def test_two_ranks_on_a_one_gpu_node_use_the_cpu(monkeypatch, capsys):
    """rank_context itself (not just the rule): with one GPU visible, a 2-rank node's rank 0 runs on gloo."""
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(distributed, "visible_gpus", lambda: 1)
    monkeypatch.delenv(distributed.DEVICE_ENV, raising=False)
    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(key, value)
    with distributed.rank_context() as (rank, world, device):
        assert (rank, world, device.type, dist.get_backend()) == (0, 1, "cpu", "gloo")
    assert not dist.is_initialized()
    assert "2 ranks on the CPU with gloo: 1 GPU(s) for 2 ranks" in capsys.readouterr().out


def test_slurm_script_runs_torchrun_with_rendezvous_on_every_node(tmp_path):
    import subprocess

    text = distributed.slurm_script(
        "labs/scripts/ddp_train.py",
        nodes=2,
        gpus_per_node=4,
        args=["--steps", "100"],
        partition="gpu",
        account="proj42",
        venv="/opt/course/.venv",
    )
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj42",
        "source /opt/course/.venv/bin/activate",
        "export HF_HUB_OFFLINE=1",
        "--nproc_per_node=4",
        "--rdzv_backend=c10d",
        '--rdzv_endpoint="$head_node:29500"',
        "labs/scripts/ddp_train.py --steps 100",
        "NCCL_SOCKET_IFNAME",
    ):
        assert line in text, line
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0  # valid shell


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"nodes": 0}, "nodes >= 1"),
        ({"time_limit": "90 minutes"}, "HH:MM:SS"),
        ({"job_name": "a b"}, "job_name"),
        ({"port": 80}, "port"),
    ],
)
def test_slurm_script_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        distributed.slurm_script(SCRIPT, **kwargs)
    with pytest.raises(FileNotFoundError, match="no such script: trian.py"):
        distributed.slurm_script("trian.py")


def test_slurm_cli_writes_the_file(tmp_path, capsys, monkeypatch):
    from labkit import cli

    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "job.sbatch"
    assert (
        cli.main(
            [
                "slurm",
                "train.py",
                "--nodes",
                "2",
                "--gpus-per-node",
                "8",
                "-o",
                str(out),
                "--",
                "--lr",
                "3e-4",
                "--nodes",
                "9",
            ]
        )
        == 0
    )
    text = out.read_text()
    assert "--nproc_per_node=8" in text and "#SBATCH --nodes=2" in text
    assert f"{tmp_path / 'train.py'} --lr 3e-4 --nodes 9" in text  # absolute: the job runs from any directory
    assert "sbatch" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["train.py", "--gpu-per-node", "4"],
            "unknown option(s) --gpu-per-node 4; the training script's own arguments go after `--`",
        ),
        (["train.py", "--steps", "200"], "labkit slurm train.py [options] -- --steps 200"),
        (["missing.py", "--nodes", "2"], "no such script: missing.py"),
    ],
)
def test_slurm_cli_refuses_typos_and_missing_scripts(tmp_path, capsys, monkeypatch, argv, message):
    from labkit import cli

    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["slurm", *argv, "-o", "job.sbatch"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "job.sbatch").exists()


SRUN = """#!/bin/bash
# srun's stand-in: one task per node, every "node" on this machine
while [[ $1 == -* ]]; do shift; done
pids=()
for node in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$node "$@" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


def test_the_generated_slurm_job_trains_on_two_nodes(tmp_path):
    """The sbatch script as written, run as Slurm would run it on two nodes: two torchrun agents (here on one
    machine, with srun and scontrol stood in for) meet at the rendezvous and train one model with gloo."""
    import json
    import socket

    import numpy as np

    from labkit import shards

    shards.write_shards(
        (np.arange(20000) * 7 % 256).astype(np.int64), tmp_path / "data", 5000, vocab_size=256, tokenizer="t"
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    text = distributed.slurm_script(
        Path(__file__).parents[1] / "labs" / "scripts" / "ddp_train.py",
        nodes=2,
        gpus_per_node=1,
        venv=sys.prefix,
        port=port,
        args=["--shards", str(tmp_path / "data"), "--steps", "3", "--block", "32", "--micro-batch", "2"],
    )
    (tmp_path / "job.sbatch").write_text(text)
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    for name, body in (("srun", SRUN), ("scontrol", "#!/bin/bash\necho 127.0.0.1\necho 127.0.0.1\n")):
        (stand_ins / name).write_text(body)
        (stand_ins / name).chmod(0o755)
    results = tmp_path / "results"
    results.mkdir()
    env = {
        **os.environ,
        "PATH": f"{stand_ins}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_CPUS_PER_TASK": "1",
        distributed.RESULT_ENV: str(results),
    }
    run = subprocess.run(["bash", "job.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ranks = [json.loads(p.read_text()) for p in sorted(results.glob("result_rank*.json"))]
    assert [(r["rank"], r["world"]) for r in ranks] == [(0, 2), (1, 2)]
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]  # one model, trained across both nodes
    assert f"labkit: {distributed.placement(1, distributed.visible_gpus()).reason}" in run.stdout


def test_ddp_training_equals_one_process_with_the_same_global_batch(tmp_path):
    import numpy as np
    from safetensors.torch import load_file

    from labkit import shards

    stream = (np.arange(20000) * 7 % 256).astype(np.int64)
    shards.write_shards(stream, tmp_path / "data", 5000, vocab_size=256, tokenizer="t")
    script = Path(__file__).parents[1] / "labs" / "scripts" / "ddp_train.py"
    common = [
        "--shards",
        str(tmp_path / "data"),
        "--vocab",
        "256",
        "--steps",
        "3",
        "--accum",
        "2",
        "--block",
        "32",
        "--dtype",
        "float64",
    ]  # fp32 sums differ with the rank count, and AdamW magnifies that near its eps
    two = distributed.launch(
        script,
        nproc=2,
        args=[*common, "--micro-batch", "2", "--save", str(tmp_path / "two.st")],
        echo=None,
        timeout=180,
    )
    one = distributed.launch(
        script,
        nproc=1,
        args=[*common, "--micro-batch", "4", "--save", str(tmp_path / "one.st")],
        echo=None,
        timeout=180,
    )
    assert [r["world"] for r in two] == [2, 2] and one[0]["world"] == 1
    a, b = load_file(str(tmp_path / "two.st")), load_file(str(tmp_path / "one.st"))
    assert all(a[k].dtype == torch.float64 for k in a)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-10  # float64: summation order only
