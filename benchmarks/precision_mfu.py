"""Tokens/s and MFU per precision mode for a GPT-2-small-sized model (12 × 768, 124 M parameters with
GPT-2's vocabulary), side by side in one run. MFU uses 6N + 12·L·d·T FLOPs per token (N: every weight
a token is multiplied by, the tied LM head included; flops.model_flops_per_token) against the GPU's
data-sheet peak for the mode; on a CPU the peak is unknown and MFU is n/a.

    python benchmarks/precision_mfu.py --device cuda --compile            # the H100 target: bf16 MFU >= 55 %
    python benchmarks/precision_mfu.py --layers 2 --hidden 128 --steps 4  # a quick CPU check
"""

from __future__ import annotations

import argparse
import statistics

import torch

from labcourse import results
from labkit import bench, flops, precision
from labkit.models import tiny_gpt2
from labkit.train import TrainConfig, fit

# gpu-check's steps for this script and the goals its runs measure (labcourse.gpucheck reads these literals)
GPU_CHECK = [
    {"name": "precision and MFU, eager", "args": ["--device", "cuda"], "timeout_s": 1200},
    {"name": "precision and MFU, torch.compile", "args": ["--device", "cuda", "--compile"], "timeout_s": 1800},
]
GPU_GOALS = [
    {
        "goal": "bf16 MFU, GPT-2 small, torch.compile",
        "target": ">= 0.55",
        "figure": ["modes", "bf16", "mfu"],
        "best": "max",
        "where": {"compile": True},
    }
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--results", default="results", help="folder for this run's JSON file")
    args = parser.parse_args()
    device = bench.as_device(args.device)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen) for _ in range(args.steps)]
    batches = [(x, torch.roll(x, -1, dims=1)) for x in inputs]
    print(
        f"GPT-2 {args.layers} × {args.hidden}, batch {args.batch} × {args.seq}, {args.steps} steps, "
        f"compile={args.compile}, on {bench.device_name(device)}"
    )
    modes = {}
    for mode in precision.MODES:
        try:
            precision.policy(mode, device)
        except ValueError as err:
            print(f"{mode:>5}: skipped: {err}")
            continue
        model = tiny_gpt2(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.hidden // 64,
            max_position_embeddings=args.seq,
        ).to(device)
        history = fit(
            model, batches, TrainConfig(steps=args.steps, precision=mode, compile=args.compile, progress=False)
        )
        tokens_per_s = statistics.median(h["tokens_per_s"] for h in history[len(history) // 2 :])  # after warm-up
        achieved = tokens_per_s * flops.model_flops_per_token(model, args.seq)
        util = flops.mfu(achieved, flops.device_peak_flops(mode, device))
        print(
            f"{mode:>5}: {tokens_per_s:>12,.0f} tokens/s, {achieved / 1e12:8.2f} TFLOP/s, "
            f"MFU {'n/a' if util is None else f'{util:.1%}'}"
        )
        modes[mode] = {"tokens_per_s": tokens_per_s, "flops_per_s": achieved, "mfu": util}
    results.save_run("precision_mfu", {"modes": modes, **vars(args)}, root=args.results)


if __name__ == "__main__":
    main()
