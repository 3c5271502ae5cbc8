"""What pruning buys in time: the default model dense, 50 % unstructured (global magnitude), and structured
(20 % of MLP channels + 3 of 9 query heads), forward pass on the same tokens, interleaved, medians.
On an Ampere-or-newer GPU it also times the fp16 model with 2:4-pruned weights dense vs as torch.sparse
semi-structured tensors, and single linear layers of growing size the same way.

    python benchmarks/pruning_speed.py [--tokens 512] [--repeats 5] [--device cuda]
"""

from __future__ import annotations

import argparse
import copy

import torch

from labcourse import results
from labkit import bench, prune
from labkit.models import count_parameters, load_model

# gpu-check's steps for this script and the goals its runs measure (labcourse.gpucheck reads these literals)
GPU_CHECK = [{"name": "pruning speed and 2:4 kernels", "args": ["--device", "cuda"], "timeout_s": 1200}]
GPU_GOALS = [
    {
        "goal": "2:4 sparse linear speed-up, 8192 x 8192",
        "target": "> 1",
        "figure": ["semi_structured", "8192x8192", "speedup"],
        "best": "max",
    }
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default=None)
    parser.add_argument("--results", default="results", help="folder for this run's JSON file")
    args = parser.parse_args()
    device = bench.as_device(args.device)
    dense, _ = load_model("smollm2-135m", device=device)
    sparse = copy.deepcopy(dense)
    prune.magnitude_prune(sparse, 0.5, scope="global", permanent=True)
    structured = copy.deepcopy(dense)
    prune.prune_mlp_channels(structured, 0.2)
    prune.prune_attention_heads(structured, 3)  # the timing does not depend on which channels go
    models = {"dense": dense, "50% unstructured": sparse, "structured": structured}
    x = torch.randint(0, dense.config.vocab_size, (1, args.tokens), device=device)
    with torch.inference_mode():
        timings = bench.time_interleaved(
            {name: (lambda m=m: m(input_ids=x)) for name, m in models.items()},
            warmup=1,
            repeats=args.repeats,
            device=device,
        )
    med = {k: t.median for k, t in timings.items()}
    print(f"forward of {args.tokens} tokens on {bench.device_name(device)}, median of {args.repeats}")
    for name, t in med.items():
        print(
            f"{name:>17}: {bench.fmt_seconds(t)}  ({t / med['dense']:.2f} x dense), "
            f"{count_parameters(models[name]) / 1e6:.1f} M parameters"
        )
    record = {"tokens": args.tokens, "forward_s": med}
    reason = prune.semi_structured_support(device)
    if reason:
        print(f"2:4 kernels: not measured — {reason}")
    else:
        half = dense.half()
        twin = copy.deepcopy(half)
        prune.nm_prune(twin, 2, 4, permanent=True)
        prune.to_semi_structured(twin)
        x4 = torch.randint(0, dense.config.vocab_size, (8, args.tokens), device=device)
        with torch.inference_mode():
            t = {
                name: timing.median
                for name, timing in bench.time_interleaved(
                    {"fp16 dense": lambda: half(input_ids=x4), "fp16 2:4": lambda: twin(input_ids=x4)},
                    repeats=args.repeats * 4,
                    device=device,
                ).items()
            }
        record["semi_structured_model_s"] = t
        print(
            f"whole model, 8 x {args.tokens} tokens: fp16 dense {bench.fmt_seconds(t['fp16 dense'])}, "
            f"2:4 sparse kernels {bench.fmt_seconds(t['fp16 2:4'])} -> {t['fp16 dense'] / t['fp16 2:4']:.2f}x"
        )
        record["semi_structured"] = {}
        for out_f, in_f in ((1536, 576), (576, 1536), (4096, 4096), (8192, 8192)):
            r = prune.semi_structured_speedup(out_f, in_f, 4096, repeats=args.repeats * 4)
            record["semi_structured"][f"{out_f}x{in_f}"] = r
            print(
                f"2:4 {out_f} x {in_f}, fp16, 4096 tokens: {r['speedup']:.2f}x "
                f"(dense {bench.fmt_seconds(r['dense_s'])}, sparse {bench.fmt_seconds(r['sparse_s'])})"
            )
    results.save_run("pruning_speed", record, root=args.results)


if __name__ == "__main__":
    main()
