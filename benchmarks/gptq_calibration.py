"""Does whole-model GPTQ improve with more calibration data? labkit's GPTQ on the default model at several
calibration sizes, each with several random draws of windows, against round-to-nearest (which needs none), all
scored by the same perplexity code in one run. Lab 07 sweeps calibration size for one layer's held-out error;
this is the same question for the whole model's perplexity, where a draw-to-draw spread can hide the trend.

    python benchmarks/gptq_calibration.py [--bits 4] [--group-size 64] [--blocks 8 32 128] [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import statistics

from labcourse import results
from labkit import bench, evaluate, quant
from labkit.data import load_corpus
from labkit.models import load_model
from labkit.profiles import get_profile


def main() -> None:
    profile = get_profile()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64, help="-1: one scale per output row")
    parser.add_argument("--blocks", type=int, nargs="+", default=[8, 32, 128], help="calibration windows per run")
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="random draws of windows per size")
    parser.add_argument("--documents", type=int, default=profile.eval.documents)
    parser.add_argument("--results", default="results", help="folder for this run's JSON file")
    args = parser.parse_args()
    if min(args.blocks) < 1 or not args.seeds:
        raise SystemExit("--blocks must be positive and at least one seed is needed")

    model, tok = load_model()
    cfg = quant.QuantConfig(bits=args.bits, group_size=args.group_size)
    train_texts = load_corpus("wiki", "train")

    def ppl(m) -> float:
        return evaluate.split_perplexity(
            m, tok, documents=args.documents, max_length=profile.eval.max_length, progress=False
        ).perplexity

    print(
        f"{cfg.label()}, {args.documents} validation articles, window {profile.eval.max_length}, {bench.device_name()}"
    )
    fp32 = ppl(model)
    rtn = ppl(quant.quantize_model(model, cfg, method="rtn", progress=False).model)
    print(f"fp32 {fp32:.2f}, RTN {rtn:.2f}")
    runs = []
    for n in sorted(args.blocks):
        for seed in args.seeds:
            calib = quant.calibration_blocks(tok, train_texts, n, args.block_size, seed=seed)
            result = quant.quantize_model(model, cfg, calib, progress=False)
            run = {"blocks": n, "tokens": calib.numel(), "seed": seed, "seconds": result.seconds}
            run["ppl"] = ppl(result.model)
            runs.append(run)
            del result
            print(f"{run['tokens']:>7} tokens, seed {seed}: perplexity {run['ppl']:.2f} ({run['seconds']:.0f} s)")
    for n in sorted(args.blocks):
        ppls = [r["ppl"] for r in runs if r["blocks"] == n]
        print(
            f"{n * args.block_size:>7} tokens: GPTQ median {statistics.median(ppls):.2f} "
            f"(draws {min(ppls):.2f}–{max(ppls):.2f}), RTN {rtn:.2f}, fp32 {fp32:.2f}"
        )
    results.save_run(
        "gptq_calibration",
        {
            "config": cfg.label(),
            "block_size": args.block_size,
            "documents": args.documents,
            "fp32": fp32,
            "rtn": rtn,
            "runs": runs,
        },
        root=args.results,
    )


if __name__ == "__main__":
    main()
