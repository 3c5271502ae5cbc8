"""labkit's GPTQ against GPTQModel on the default model, side by side in one run: same calibration blocks,
bits, group size, damping and column order. Reports perplexity (both scored by the same fp32 code after
dequantization, and GPTQModel's checkpoint also through its own kernel via transformers), wall time
(quantize + save, each tool), and the share of RTN's perplexity loss that GPTQ wins back.

    python benchmarks/gptq_parity.py [--bits 4] [--group-size 64] [--blocks 32] [--block-size 512]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from labcourse import results
from labkit import bench, evaluate, quant
from labkit.data import load_corpus
from labkit.models import load_model
from labkit.profiles import get_profile


def main() -> None:
    profile = get_profile()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--damp", type=float, default=0.01)
    parser.add_argument("--blocks", type=int, default=profile.quant.calibration_blocks)
    parser.add_argument("--block-size", type=int, default=profile.quant.calibration_block_size)
    parser.add_argument("--documents", type=int, default=profile.eval.documents)
    parser.add_argument("--results", default="results", help="folder for this run's JSON file")
    args = parser.parse_args()
    if not quant.gptqmodel_available():
        raise SystemExit("GPTQModel and optimum are needed: pip install -e '.[gptq]' (see README)")

    model, tok = load_model()
    cfg = quant.QuantConfig(bits=args.bits, group_size=args.group_size, damp=args.damp)
    calib = quant.calibration_blocks(tok, load_corpus("wiki", "train"), args.blocks, args.block_size)

    def ppl(m) -> float:
        return evaluate.split_perplexity(
            m, tok, documents=args.documents, max_length=profile.eval.max_length, progress=False
        ).perplexity

    print(
        f"{cfg.label()}, damp {cfg.damp}, {calib.numel()} calibration tokens ({args.blocks} x {args.block_size}), "
        f"{args.documents} validation articles, {bench.device_name()}"
    )
    methods = {"fp32": {"ppl": ppl(model)}}
    rtn = quant.quantize_model(model, cfg, method="rtn", progress=False)
    methods["rtn"] = {"ppl": ppl(rtn.model), "seconds": rtn.seconds}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        ours = quant.quantize_model(model, cfg, calib, progress=False)
        quant.save_gptq(ours, tok, tmp / "labkit")
        methods["labkit"] = {"ppl": ppl(ours.model), "seconds": time.perf_counter() - start}
        del ours
        model.save_pretrained(tmp / "fp32")
        tok.save_pretrained(tmp / "fp32")
        start = time.perf_counter()
        quant.quantize_with_gptqmodel(tmp / "fp32", calib, cfg, tmp / "gptqmodel")
        seconds = time.perf_counter() - start
        theirs = quant.load_gptq(tmp / "gptqmodel")
        methods["gptqmodel"] = {
            "ppl": ppl(theirs.model),
            "seconds": seconds,
            "ppl_own_kernel": ppl(quant.load_with_transformers(tmp / "gptqmodel")),
        }

    fp, r, ours, theirs = (methods[k]["ppl"] for k in ("fp32", "rtn", "labkit", "gptqmodel"))
    summary = {
        "ppl_ratio_labkit_over_gptqmodel": ours / theirs,
        "time_ratio_labkit_over_gptqmodel": methods["labkit"]["seconds"] / methods["gptqmodel"]["seconds"],
        "rtn_loss_recovered_labkit": (r - ours) / (r - fp),
        "rtn_loss_recovered_gptqmodel": (r - theirs) / (r - fp),
    }
    for name, res in methods.items():
        extra = f", {res['seconds']:.0f} s" if "seconds" in res else ""
        own = f" (own kernel: {res['ppl_own_kernel']:.2f})" if "ppl_own_kernel" in res else ""
        print(f"{name:>10}: perplexity {res['ppl']:.2f}{own}{extra}")
    for key, value in summary.items():
        print(f"{key}: {value:.3f}")
    results.save_run(
        "gptq_parity",
        {
            "config": cfg.label(),
            "damp": cfg.damp,
            "calibration_tokens": calib.numel(),
            "documents": args.documents,
            "methods": methods,
            **summary,
        },
        root=args.results,
    )


if __name__ == "__main__":
    main()
