"""Slurm: the sbatch script runs torchrun with a rendezvous on every node, `labkit slurm` writes it, and the
script as written trains one model on two stand-in nodes."""

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from labkit import cli, shards
from labkit.parallel import launch, slurm

SCRIPT = Path(__file__).parents[1] / "labs" / "scripts" / "dp_parity.py"


def test_slurm_script_runs_torchrun_with_rendezvous_on_every_node(tmp_path):
    text = slurm.slurm_script(
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
        slurm.slurm_script(SCRIPT, **kwargs)


@pytest.mark.parametrize(
    "name, value", [("nodes", "2"), ("gpus_per_node", 2.0), ("port", "29500"), ("cpus_per_task", True)]
)
def test_slurm_script_wants_whole_numbers(name, value):
    with pytest.raises(TypeError, match=f"{name} must be an int, got {value!r}"):
        slurm.slurm_script(SCRIPT, **{name: value})
    with pytest.raises(FileNotFoundError, match="no such script: trian.py"):
        slurm.slurm_script("trian.py")


# Values that would add a line, a word or a shell command to a job script, or that Slurm would not take.
HOSTILE_TEXT = ["gpu\ntouch x", "gpu\rtouch x", "gpu\x00", "$(touch x)", "`touch x`", "gpu;touch x", "a b", ""]
HOSTILE = (
    [(name, value) for name in ("job_name", "partition", "account") for value in [*HOSTILE_TEXT, "x" * 129, 7]]
    + [("partition", v) for v in [",", "gpu,", ",gpu", "gpu,,debug", "gpu, debug"]]
    + [("time_limit", v) for v in [*HOSTILE_TEXT, "00:30:00\n", "1:60:00", "\u0661:00:00", "30", 1800]]
    + [(name, v) for name in ("nodes", "gpus_per_node", "cpus_per_task", "port") for v in [0, -4, True, 1.5, 10**12]]
    + [("nodes", None), ("port", "29500"), ("gpus_per_node", "2")]
    + [("venv", "/opt/venv\ntouch x"), ("venv", "/opt/\rvenv"), ("venv", "/opt/venv\x00")]
    + [("args", ["--lr", "3e-4\ntouch x"]), ("args", ["\x00"]), ("args", ["--steps", 100]), ("args", "--steps 100")]
    + [
        ("mem", v)
        for v in [*HOSTILE_TEXT, "64 GB", "64GB", "-1G", "64G; rm -rf ~", "64G\n", "1.5G", "\u0666\u0664G", 64]
    ]
    + [("sbatch_options", [v]) for v in [*HOSTILE_TEXT, "--qos=a b", "--qos='x'", '--qos="x"', "--qos=a\\b"]]
    + [("sbatch_options", [v]) for v in ["--qos=a|b", "--qos=a&b", "--qos=<x", "--qos=*", "--qos=", "--QOS=x", "qos=x"]]
    + [("sbatch_options", [v]) for v in ["-q debug", "-qdebug", "--qos=debug\n", "--9=x", "--qos=ä"]]
    + [("sbatch_options", "--qos=debug"), ("sbatch_options", [["--qos=debug"]]), ("sbatch_options", [7])]
)


@pytest.mark.parametrize("name, value", HOSTILE + [("job_name", "a,b"), ("account", "a,b")])
def test_every_value_written_into_the_script_is_checked(name, value):
    """Each option refuses what would end its #SBATCH line, split into two words, or that Slurm does not take,
    with an error naming the option: no value can add a command to the job script."""
    with pytest.raises((TypeError, ValueError), match=name):
        slurm.slurm_script(SCRIPT, **{name: value})


def test_a_script_path_with_a_newline_is_refused_and_shell_syntax_in_arguments_is_quoted(tmp_path):
    odd = tmp_path / "train\ntouch x.py"
    odd.write_text("")
    with pytest.raises(ValueError, match="script must not hold control characters"):
        slurm.slurm_script(odd)
    args = ["$(touch x)", "`touch x`", "a; touch x", "it's", "--name=a b"]
    text = slurm.slurm_script(SCRIPT, args=args, venv="/opt/$(touch x)/venv", cpus_per_task=16)
    assert shlex.split(text.splitlines()[-1]) == [str(SCRIPT.resolve()), *args]  # each one word, taken literally
    assert "source '/opt/$(touch x)/venv/bin/activate'" in text and "#SBATCH --cpus-per-task=16" in text


def test_slurm_cli_writes_the_file(tmp_path, capsys, monkeypatch):
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


def test_slurm_cli_takes_cpus_memory_and_repeated_sbatch_options(tmp_path, capsys, monkeypatch):
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    argv = ["slurm", "train.py", "--gpus-per-node", "4", "--cpus-per-task", "32", "--mem", "0", "--account", "abc"]
    argv += ["--sbatch-option=--qos=debug", "--sbatch-option=--constraint=a100", "--sbatch-option=--exclusive"]
    assert cli.main([*argv, "-o", "job.sbatch", "--", "--steps", "9"]) == 0
    options = sbatch_header((tmp_path / "job.sbatch").read_text())
    assert options[6:] == [
        "--cpus-per-task=32",
        "--mem=0",
        "--account=abc",
        "--qos=debug",
        "--constraint=a100",
        "--exclusive",
    ]
    assert "sbatch job.sbatch" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cpus-per-task", "0"], "need cpus_per_task >= 1 and <= 4096, got 0"),
        (["--cpus-per-task", "2", "--gpus-per-node", "4"], "need cpus_per_task >= gpus_per_node (4), got 2"),
        (["--cpus-per-task", "many"], "argument --cpus-per-task: invalid int value: 'many'"),
        (["--mem", "64 GB"], "mem must be a whole number with an optional unit K, M, G or T"),
        (["--mem=-1G"], "got '-1G'"),
        (["--mem", "64G; rm -rf ~"], "got '64G; rm -rf ~'"),
        (["--sbatch-option=--qos=debug;touch x"], "sbatch_options: each must be --name or --name=value"),
        (["--sbatch-option=--qos=debug\ntouch x"], "got '--qos=debug\\ntouch x'"),
        (["--sbatch-option", "--qos=a b"], "got '--qos=a b'"),
        (["--sbatch-option=--time=02:00:00"], "'--time=02:00:00' sets what labkit writes itself; use --time instead"),
        (["--sbatch-option=--nodes=4"], "use --nodes instead"),
        (["--sbatch-option=--gpus-per-node=8"], "use --gpus-per-node instead"),
        (["--sbatch-option=--cpus-per-task=8"], "use --cpus-per-task instead"),
        (["--sbatch-option=--mem=8G"], "use --mem instead"),
        (["--sbatch-option=--partition=gpu"], "use --partition instead"),
        (["--sbatch-option=--output=log"], "the log is <job name>-<job id>.out"),
        (
            ["--sbatch-option", "--qos=debug"],
            "--sbatch-option takes its value after '=', as in --sbatch-option=--qos=debug",
        ),
        (["--sbatch-option", "--exclusive"], "as in --sbatch-option=--exclusive"),
        (["--sbatch-option"], "--sbatch-option takes its value after '='"),
    ],
)
def test_slurm_cli_refuses_bad_cpus_memory_and_sbatch_options_and_writes_nothing(
    tmp_path, capsys, monkeypatch, argv, message
):
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert run_cli(["slurm", "train.py", *argv, "-o", "job.sbatch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("labkit slurm: ") and err.count("\n") == 1 and message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]


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
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["slurm", *argv, "-o", "job.sbatch"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "job.sbatch").exists()


def run_cli(argv):
    """cli.main's exit status, also where argparse exits (a value that is not a number)."""
    try:
        return cli.main(argv)
    except SystemExit as exit:
        return exit.code


@pytest.mark.parametrize(
    "option, value",
    [
        ("--partition", "gpu\ntouch x"),
        ("--account", "proj\ntouch x"),
        ("--account", "a b"),
        ("--job-name", "run\rtouch x"),
        ("--time", "00:30:00\ntouch x"),
        ("--nodes", "-4"),
        ("--nodes", "1000000"),
        ("--gpus-per-node", "0"),
        ("--nodes", "$(touch x)"),
    ],
)
def test_slurm_cli_refuses_hostile_options_in_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, option, value):
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert run_cli(["slurm", "train.py", option, value, "-o", "job.sbatch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("labkit slurm: ") and err.count("\n") == 1 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]


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
    shards.write_shards(
        (np.arange(20000) * 7 % 256).astype(np.int64), tmp_path / "data", 5000, vocab_size=256, tokenizer="t"
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    text = slurm.slurm_script(
        Path(__file__).parents[1] / "labs" / "scripts" / "ddp_train.py",
        nodes=2,
        gpus_per_node=1,
        venv=sys.prefix,
        port=port,
        args=["--shards", str(tmp_path / "data"), "--steps", "3", "--block", "32", "--micro-batch", "2"],
        cpus_per_task=2,
        mem="0",
        sbatch_options=["--qos=debug", "--exclusive"],
    )
    assert sbatch_header(text)[-4:] == ["--cpus-per-task=2", "--mem=0", "--qos=debug", "--exclusive"]
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
        "SLURM_CPUS_PER_TASK": "2",
        launch.RESULT_ENV: str(results),
    }
    run = subprocess.run(["bash", "job.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ranks = [json.loads(p.read_text()) for p in sorted(results.glob("result_rank*.json"))]
    assert [(r["rank"], r["world"]) for r in ranks] == [(0, 2), (1, 2)]
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]  # one model, trained across both nodes
    assert f"labkit: {launch.placement(1, launch.visible_gpus()).reason}" in run.stdout


def test_a_partition_may_be_a_list_slurm_picks_from():
    assert "#SBATCH --partition=gpu,debug\n" in slurm.slurm_script(SCRIPT, partition="gpu,debug")


def sbatch_header(text):
    """The options sbatch reads from a job script: its #SBATCH lines up to the first command (sbatch stops there)."""
    options = []
    for line in text.splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH "):
            options.append(line.removeprefix("#SBATCH "))
    return options


def test_cpus_memory_and_the_clusters_own_options_are_sbatch_lines_in_a_stable_order():
    text = slurm.slurm_script(
        SCRIPT,
        nodes=2,
        gpus_per_node=4,
        cpus_per_task=32,
        mem="64G",
        partition="gpu",
        account="abc",
        sbatch_options=["--qos=debug", "--constraint=a100", "--exclusive", "--mail-user=me@uni.edu"],
    )
    assert sbatch_header(text) == [
        "--job-name=labkit",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--gpus-per-node=4",
        "--time=00:30:00",
        "--output=%x-%j.out",
        "--cpus-per-task=32",
        "--mem=64G",
        "--partition=gpu",
        "--account=abc",
        "--qos=debug",
        "--constraint=a100",
        "--exclusive",
        "--mail-user=me@uni.edu",
    ]
    bare = sbatch_header(slurm.slurm_script(SCRIPT))  # none given: no line for them
    assert not [o for o in bare if o.startswith(("--cpus-per-task", "--mem", "--qos"))]


@pytest.mark.parametrize("mem", ["0", "64G", "500M", "128000", "2T", "1024K", "64g"])
def test_mem_takes_slurms_sizes(mem):
    assert f"#SBATCH --mem={mem}\n" in slurm.slurm_script(SCRIPT, mem=mem)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"cpus_per_task": 0}, ValueError, "need cpus_per_task >= 1 and <= 4096, got 0"),
        ({"cpus_per_task": "8"}, TypeError, "cpus_per_task must be an int, got '8'"),
        (
            {"cpus_per_task": 4, "gpus_per_node": 8},
            ValueError,
            "need cpus_per_task >= gpus_per_node (8), got 4",
        ),
        ({"mem": "64 GB"}, ValueError, "mem must be a whole number with an optional unit K, M, G or T"),
        ({"mem": "-1G"}, ValueError, "0 is all of each node's memory), got '-1G'"),
        ({"mem": "64G; rm -rf ~"}, ValueError, "got '64G; rm -rf ~'"),
        ({"mem": 64}, TypeError, "mem must be a str such as '64G', got 64"),
        ({"sbatch_options": ["--qos=a b"]}, ValueError, "each must be --name or --name=value"),
        ({"sbatch_options": ["--qos=$(touch x)"]}, ValueError, "(no space, quote or shell character), got '--qos="),
        ({"sbatch_options": "--qos=debug"}, TypeError, "sbatch_options must be a list of str"),
        ({"sbatch_options": ["--nodes=4"]}, ValueError, "'--nodes=4' sets what labkit writes itself; use --nodes"),
        ({"sbatch_options": ["--time=01:00:00"]}, ValueError, "use --time instead (time_limit=)"),
        ({"sbatch_options": ["--job-name=x"]}, ValueError, "use --job-name instead"),
        ({"sbatch_options": ["--gpus-per-node=2"]}, ValueError, "use --gpus-per-node instead"),
        ({"sbatch_options": ["--gpus=8"]}, ValueError, "use --gpus-per-node instead"),
        ({"sbatch_options": ["--gres=gpu:a100:4"]}, ValueError, "use --gpus-per-node instead"),
        ({"sbatch_options": ["--cpus-per-task=8"]}, ValueError, "use --cpus-per-task instead (cpus_per_task=)"),
        ({"sbatch_options": ["--cpus-per-gpu=8"]}, ValueError, "use --cpus-per-task instead"),
        ({"sbatch_options": ["--mem=64G"]}, ValueError, "use --mem instead (mem=)"),
        ({"sbatch_options": ["--mem-per-cpu=4G"]}, ValueError, "use --mem instead"),
        ({"sbatch_options": ["--partition=gpu"]}, ValueError, "use --partition instead"),
        ({"sbatch_options": ["--account=abc"]}, ValueError, "use --account instead"),
        ({"sbatch_options": ["--output=x.log"]}, ValueError, "the log is <job name>-<job id>.out"),
        ({"sbatch_options": ["--ntasks-per-node=8"]}, ValueError, "labkit runs one task per node"),
        ({"sbatch_options": ["--ntasks=8"]}, ValueError, "labkit runs one task per node"),
        ({"sbatch_options": ["--part=gpu"]}, ValueError, "'--part=gpu' (an abbreviation of --partition)"),
        ({"sbatch_options": ["--qos=a", "--qos=b"]}, ValueError, "'--qos=a' and '--qos=b' set --qos twice"),
    ],
)
def test_cpus_memory_and_sbatch_options_are_checked_with_the_option_the_value_and_what_is_wanted(
    kwargs, error, message
):
    with pytest.raises(error) as refused:
        slurm.slurm_script(SCRIPT, **kwargs)
    assert message in str(refused.value)


@pytest.mark.parametrize(
    "option", ["--exclusive", "--qos=debug", "--gres=nvme:1", "--gpu-bind=closest", "--time-min=00:10:00"]
)
def test_options_near_labkits_own_are_taken(option):
    assert f"#SBATCH {option}\n" in slurm.slurm_script(SCRIPT, sbatch_options=[option])


def test_each_rank_gets_its_share_of_the_nodes_cpus_and_srun_passes_them_on(tmp_path):
    """The job script's own arithmetic, run with an srun that records what it was given: OMP_NUM_THREADS is the
    task's CPUs over the node's ranks (at least 1), and srun is told the job's --cpus-per-task (Slurm 22.05 to
    23.02 would otherwise give the step one CPU)."""
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    srun = '#!/bin/bash\necho "$OMP_NUM_THREADS $*" > "$SRUN_LOG"\n'
    for name, body in (("srun", srun), ("scontrol", "#!/bin/bash\necho 127.0.0.1\n")):
        (stand_ins / name).write_text(body)
        (stand_ins / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMP_"))}
    env |= {"PATH": f"{stand_ins}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n1", "SLURM_NNODES": "1"}
    env |= {"SLURM_JOB_ID": "1", "SRUN_LOG": str(tmp_path / "srun.log")}
    for gpus, cpus, threads in [(4, 32, 8), (8, 12, 1), (16, None, 1), (2, None, 4)]:
        job = tmp_path / "job.sbatch"
        job.write_text(slurm.slurm_script(SCRIPT, gpus_per_node=gpus, cpus_per_task=cpus, venv=sys.prefix))
        cpus_env = {} if cpus is None else {"SLURM_CPUS_PER_TASK": str(cpus)}  # Slurm sets it when asked
        assert subprocess.run(["bash", str(job)], env=env | cpus_env).returncode == 0
        logged = (tmp_path / "srun.log").read_text().split()
        assert logged[0] == str(threads), (gpus, cpus, logged)
        given = [a for a in logged if a.startswith("--cpus-per-task")]
        assert given == ([] if cpus is None else [f"--cpus-per-task={cpus}"])
