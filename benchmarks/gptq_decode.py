"""Greedy decode of the default model in fp16 against its 4-bit GPTQ checkpoint loaded the standard way
(transformers + GPTQModel's kernel for the device), side by side in one run: tokens/s at batch 1 and the
memory each model adds, each loaded inside its own measurement (bench.decode_benchmark). Prints which
GPTQModel kernel ran. The checkpoint is quantized with RTN here, which has GPTQ's format and kernel: the
speed does not depend on how the codes were chosen.

    python benchmarks/gptq_decode.py [--device cuda] [--new-tokens 128] [--batch 1]
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from labcourse import results
from labkit import bench, quant
from labkit.data import load_corpus
from labkit.models import DEFAULT_MODEL, load_model
from labkit.profiles import get_profile

# gpu-check's steps for this script and the goals its runs measure (labcourse.gpucheck reads these literals)
GPU_CHECK = [{"name": "GPTQ 4-bit decode vs fp16", "args": ["--device", "cuda"], "timeout_s": 1200}]
GPU_GOALS = [{"goal": "GPTQ 4-bit / fp16 decode speed, batch 1", "target": "> 1", "figure": ["speedup"], "best": "max"}]


def main() -> None:
    profile = get_profile()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=profile.timing.repeats)
    parser.add_argument("--results", default="results", help="folder for this run's JSON file")
    args = parser.parse_args()
    if not quant.gptqmodel_available():
        raise SystemExit("GPTQModel and optimum are needed: pip install -e '.[gptq]' (make does)")
    device = bench.as_device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model, tokenizer = load_model(DEFAULT_MODEL, dtype=torch.float32)
    prompt = torch.tensor([tokenizer(load_corpus("wiki", "validation")[0])["input_ids"][:64]] * args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        qm = quant.quantize_model(
            model, quant.QuantConfig(bits=args.bits, group_size=args.group_size), method="rtn", progress=False
        )
        quant.save_gptq(qm, tokenizer, tmp)
        del model, qm
        loaders = {
            str(dtype).removeprefix("torch."): lambda: load_model(DEFAULT_MODEL, dtype=dtype, device=device)[0],
            f"GPTQ {args.bits}-bit g{args.group_size}": lambda: quant.load_with_transformers(tmp, str(device)),
        }
        kernels = quant.gptq_kernels(quant.load_with_transformers(tmp, str(device)))
        decodes = {
            label: bench.decode_benchmark(load, prompt, args.new_tokens, device=device, repeats=args.repeats)
            for label, load in loaders.items()
        }
    print(
        f"{DEFAULT_MODEL}, batch {args.batch}, {args.new_tokens} new tokens, on {bench.device_name(device)}; "
        f"GPTQModel kernels: {kernels}"
    )
    for label, r in decodes.items():
        print(
            f"{label:>14}: {r['tokens_per_s']:8.1f} tokens/s, weights {bench.fmt_bytes(r['weights_bytes'])}, "
            f"generation +{bench.fmt_bytes(r['generate_bytes'])} ({r['memory_kind']})"
        )
    dense, packed = decodes.values()
    print(f"4-bit / dense decode speed: {packed['tokens_per_s'] / dense['tokens_per_s']:.2f}x")
    results.save_run(
        "gptq_decode",
        {
            "kernels": kernels,
            "batch": args.batch,
            "new_tokens": args.new_tokens,
            **{
                f"{label} {key}": r[key]
                for label, r in decodes.items()
                for key in ("tokens_per_s", "weights_bytes", "generate_bytes")
            },
            "speedup": packed["tokens_per_s"] / dense["tokens_per_s"],
        },
        root=args.results,
    )


if __name__ == "__main__":
    main()
