"""Lab 09's memory targets at the profile's size: what each sharding method adds to a rank's memory against
`memory.state_bytes`, FSDP2's state against DDP's, and what activation checkpointing saves for its time.

Targets (issue 21): measured per-rank memory within 10 % of the memory model for every method; FSDP2's
parameters + gradients + optimizer state ≤ 0.55× DDP's at 2 ranks; checkpointing cuts the decoder's activations
≥ 3× for ≤ 1.4× the step time. The memory is the resident set of each rank on a CPU (gloo) and the CUDA
allocator on a GPU (NCCL, one rank per GPU); each method runs on a fresh copy after the previous one is freed.

    python benchmarks/memory_at_scale.py [--hidden 256] [--layers 8] [--batch 4] [--seq 128] [--vocab 49152]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from labcourse import results
from labkit import activations, bench, precision
from labkit.models import llama_shape, tiny_llama
from labkit.parallel import launch, memory
from labkit.profiles import for_device, get_profile

# gpu-check's steps for this script and the goals its runs measure (labcourse.gpucheck reads these literals)
GPU_CHECK = [{"name": "sharded memory and checkpointing", "args": [], "timeout_s": 1800}]
GPU_GOALS = [
    {
        "goal": "activation checkpointing step time, with / without",
        "target": "<= 1.4",
        "figure": ["checkpointing_time_ratio"],
        "best": "min",
    }
]

SCRIPT = Path(__file__).resolve().parents[1] / "labs" / "scripts" / "sharding.py"
SMOLLM2_VOCAB = 49152


def sharded_memory(args: argparse.Namespace, ranks: int) -> dict[str, dict]:
    """Rank 0's rows of sharding.py's memory part: predicted, held and added bytes per method."""
    sizes = [f"--{k}={getattr(args, k)}" for k in ("vocab", "hidden", "layers", "batch", "seq", "repeats")]
    runs = launch.launch(SCRIPT, nproc=ranks, args=["--parts=memory", *sizes], echo=None, timeout=3000)
    return {"device": runs[0]["device"], "parameters": runs[0]["parameters"], **runs[0]["memory"]}


def checkpointing(args: argparse.Namespace, device: torch.device) -> dict[str, dict[str, float]]:
    """Activations held and step time without and with checkpointing, one rank's batch, in this process."""
    model = tiny_llama(**llama_shape(args.vocab, args.hidden, args.layers, args.seq), seed=0).to(device)
    model.config.use_cache = False
    x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": x[:, :-1].to(device), "targets": x[:, 1:].to(device)}
    return activations.checkpointing_cost(model, batch, precision.policy("fp32", device), repeats=args.repeats)


def main() -> None:
    gpus = launch.visible_gpus()
    ranks = gpus if gpus >= 2 else 2  # one rank per GPU on NCCL; else 2 CPU ranks on gloo
    # the sizes fit where the ranks run: the cpu profile's when a one-GPU node puts them on the CPU
    profile = for_device(get_profile(), launch.placement(ranks, gpus).device_type)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=SMOLLM2_VOCAB)
    parser.add_argument("--hidden", type=int, default=profile.scale.hidden)
    parser.add_argument("--layers", type=int, default=profile.scale.layers)
    parser.add_argument("--batch", type=int, default=profile.scale.batch)
    parser.add_argument("--seq", type=int, default=profile.scale.seq)
    parser.add_argument("--repeats", type=int, default=max(3, profile.timing.repeats))
    parser.add_argument("--results", default="results", help="folder for this run's JSON file")
    args = parser.parse_args()
    device = bench.as_device(None)

    rows = sharded_memory(args, ranks)
    MiB = 2**20
    print(
        f"{ranks} ranks, {rows['device']}, {rows['parameters'] / 1e6:.1f} M parameters, {args.batch} x {args.seq} "
        f"tokens per rank; memory: {rows['methods']['ddp']['memory_kind']}"
    )
    print(f"{'method':<14} {'predicted':>10} {'held':>8} {'added':>8} {'added/pred':>11} {'added/held':>11}")
    ratios = {}
    for method, row in rows["methods"].items():
        predicted = memory.RankBytes(**row["predicted"]).state
        held = memory.RankBytes(**row["held"]).state
        ratios[method] = row["added_bytes"] / predicted
        print(
            f"{method:<14} {predicted / MiB:>10.1f} {held / MiB:>8.1f} {row['added_bytes'] / MiB:>8.1f} "
            f"{ratios[method]:>11.3f} {row['added_bytes'] / held:>11.3f}"
        )
    state = {m: memory.RankBytes(**rows["methods"][m]["held"]).state for m in ("ddp", "fsdp")}
    cost = checkpointing(args, device)
    decoder_saving = cost["off"]["block_bytes"] / cost["on"]["block_bytes"]
    time_ratio = cost["on"]["seconds"] / cost["off"]["seconds"]

    targets = {
        "every method's added / predicted within 10 % (torch's ZeRO-1 shards whole tensors, not even slices)": all(
            0.9 <= r <= 1.1 for m, r in ratios.items() if m != "zero1_torch"
        ),
        f"FSDP2 state / DDP state {state['fsdp'] / state['ddp']:.3f} <= 0.55": state["fsdp"] / state["ddp"] <= 0.55,
        f"checkpointing: decoder activations / {decoder_saving:.2f} >= 3": decoder_saving >= 3,
        f"checkpointing: step time x {time_ratio:.2f} <= 1.4": time_ratio <= 1.4,
    }
    for claim, met in targets.items():
        print(f"{'met ' if met else 'MISS'}  {claim}")
    results.save_run(
        "memory_at_scale",
        {
            "profile": profile.name,
            "ranks": ranks,
            "shape": {k: getattr(args, k) for k in ("vocab", "hidden", "layers", "batch", "seq")},
            "added_over_predicted": ratios,
            "fsdp_over_ddp_state": state["fsdp"] / state["ddp"],
            "decoder_activation_saving": decoder_saving,
            "checkpointing_time_ratio": time_ratio,
            "targets_met": all(targets.values()),
        },
        root=args.results,
    )


if __name__ == "__main__":
    main()
