"""The post-training quantization landscape on the default model, side by side in one run: 8-bit RTN per
channel, 4-bit RTN, NF4 with double quantization, activation-aware scaling (AWQ-style) + 4-bit RTN and GPTQ
(act-order), each scored by the same perplexity code, with the stored bits per weight of the decoder
linears and the time each took. Then labkit's NF4 against bitsandbytes' on every decoder weight: codes
compared, and the time to quantize the whole model (median of repeats).

    python benchmarks/quant_landscape.py [--group-size 64] [--blocks 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from labcourse import results
from labkit import bench, evaluate, quant
from labkit.data import load_corpus
from labkit.models import load_model
from labkit.profiles import get_profile
from labkit.torchutil import decoder_layers


def decoder_weights(model: nn.Module) -> list[torch.Tensor]:
    return [m.weight.detach() for block in decoder_layers(model) for m in block.modules() if isinstance(m, nn.Linear)]


def nf4_parity(model: nn.Module, repeats: int) -> dict:
    """labkit's NF4 vs bitsandbytes' on every decoder weight: differing codes, and whole-model time (median)."""
    bnbf = quant.import_bitsandbytes().functional

    weights = decoder_weights(model)
    labkit_s, bnb_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ours = [quant.quantize_nf4(w) for w in weights]
        labkit_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        theirs = [bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True) for w in weights]
        bnb_s.append(time.perf_counter() - t0)
    packed_diff = sum(int((o.packed != p.view(-1)).sum()) for o, (p, _) in zip(ours, theirs))
    scale_diff = sum(int((o.absmax != s.absmax).sum()) for o, (_, s) in zip(ours, theirs))
    return {
        "weights": sum(w.numel() for w in weights),
        "packed_bytes_differing": packed_diff,
        "scale_codes": sum(o.absmax.numel() for o in ours),
        "scale_codes_differing": scale_diff,
        "labkit_s": statistics.median(labkit_s),
        "bitsandbytes_s": statistics.median(bnb_s),
    }


def main() -> None:
    profile = get_profile()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=16, help="calibration windows (AWQ, GPTQ)")
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--documents", type=int, default=profile.eval.documents)
    parser.add_argument("--repeats", type=int, default=3, help="NF4 timing repeats")
    parser.add_argument("--results", default="results", help="folder for this run's JSON file")
    args = parser.parse_args()

    model, tok = load_model()
    calib = quant.calibration_blocks(tok, load_corpus("wiki", "train"), args.blocks, args.block_size)

    def ppl(m) -> float:
        return evaluate.split_perplexity(
            m, tok, documents=args.documents, max_length=profile.eval.max_length, progress=False
        ).perplexity

    print(f"{args.documents} validation articles, window {profile.eval.max_length}, {calib.numel()} calibration tokens")
    print(f"{bench.device_name()}, {torch.get_num_threads()} threads")
    rows = [{"method": "fp32", "bits": 32.0, "seconds": 0.0, "ppl": ppl(model)}]
    alphas: list[float] = []
    for point in quant.ptq_landscape(model, calib, ppl, group_size=args.group_size):
        rows.append({"method": point.method, "bits": point.bits, "seconds": point.seconds, "ppl": point.score})
        print(
            f"{point.method:<26} {point.bits:5.2f} bits/weight  perplexity {point.score:8.2f}  ({point.seconds:.0f} s)"
        )
        if point.alphas:
            alphas = list(point.alphas)
            print(f"  α chosen: median {statistics.median(alphas):.2f}, range {min(alphas):.2f}–{max(alphas):.2f}")

    parity = nf4_parity(model, args.repeats)
    print(
        f"NF4, {parity['weights']:,} decoder weights: packed bytes differing {parity['packed_bytes_differing']}, "
        f"scale codes differing {parity['scale_codes_differing']} of {parity['scale_codes']:,}; "
        f"labkit {parity['labkit_s']:.2f} s vs bitsandbytes {parity['bitsandbytes_s']:.2f} s "
        f"({parity['labkit_s'] / parity['bitsandbytes_s']:.2f}x, median of {args.repeats})"
    )
    results.save_run(
        "quant_landscape",
        {
            "group_size": args.group_size,
            "calibration_tokens": calib.numel(),
            "documents": args.documents,
            "rows": rows,
            "awq_alphas": alphas,
            "nf4_parity": parity,
        },
        root=args.results,
    )


if __name__ == "__main__":
    main()
