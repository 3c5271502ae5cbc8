"""Magnitude vs Wanda vs SparseGPT on the default model, side by side in one run: the same sparsities, the same
calibration windows for the two calibrated methods, every model scored by the same perplexity code, and the zeros
counted. Reports perplexity and the seconds each pruning took.

    python benchmarks/pruning_calibrated.py [--sparsities 0.5 2:4] [--blocks 16] [--block-size 512]
"""

from __future__ import annotations

import argparse
import time

from labcourse import results
from labkit import bench, evaluate, prune, quant
from labkit.data import load_corpus
from labkit.models import load_model
from labkit.profiles import get_profile


def _sparsity(text: str) -> float | tuple[int, int]:
    """0.5 for 50 % unstructured, 2:4 for an N:M pattern."""
    if ":" in text:
        n, m = text.split(":")
        return int(n), int(m)
    return float(text)


def main() -> None:
    profile = get_profile()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sparsities", type=_sparsity, nargs="+", default=[0.5, (2, 4)])
    parser.add_argument("--blocks", type=int, default=16, help="calibration windows")
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--documents", type=int, default=profile.eval.documents)
    parser.add_argument("--results", default="results", help="folder for this run's JSON file")
    args = parser.parse_args()

    model, tok = load_model()
    calib = quant.calibration_blocks(tok, load_corpus("wiki", "train"), args.blocks, args.block_size)
    dense = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def ppl() -> float:
        return evaluate.split_perplexity(
            model, tok, documents=args.documents, max_length=profile.eval.max_length, progress=False
        ).perplexity

    print(f"{calib.numel()} calibration tokens, {args.documents} validation articles, {bench.device_name()}")
    runs = [{"method": "dense", "sparsity": 0.0, "ppl": ppl(), "seconds": 0.0}]
    print(f"dense: perplexity {runs[0]['ppl']:.2f}")
    for sparsity in args.sparsities:
        label = f"{sparsity[0]}:{sparsity[1]}" if isinstance(sparsity, tuple) else f"{sparsity:.0%}"
        for method in ("magnitude", "wanda", "sparsegpt"):
            model.load_state_dict(dense)
            start = time.perf_counter()
            if method == "magnitude" and isinstance(sparsity, tuple):
                prune.nm_prune(model, *sparsity, permanent=True)
            elif method == "magnitude":
                prune.magnitude_prune(model, sparsity, permanent=True)
            else:
                prune.calibrated_prune(model, calib, sparsity, method=method, permanent=True, progress=False)
            seconds = time.perf_counter() - start
            zeros = prune.overall_sparsity(prune.sparsity_report(model))
            runs.append({"method": method, "sparsity": label, "zeros": zeros, "ppl": ppl(), "seconds": seconds})
            print(f"{label:>5} {method:>9}: perplexity {runs[-1]['ppl']:9.2f}, {zeros:.1%} zeros, {seconds:.0f} s")
    results.save_run(
        "pruning_calibrated",
        {"calibration_tokens": calib.numel(), "documents": args.documents, "runs": runs},
        root=args.results,
    )


if __name__ == "__main__":
    main()
