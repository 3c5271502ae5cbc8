"""LoRA against a full fine-tune of the default model on the same task data (lab 08's title task):
trainable share, median step time, peak memory of the training loop, and the score each reaches;
QLoRA (the same adapters on a GPTQ 4-bit base kept packed in memory) alongside.

Each run goes in its own fresh process, so that its peak memory is not mixed with the other's: the
resident set on CPU, the CUDA allocator's peak on a GPU. Both see the same batches in the same order.

    python benchmarks/lora_vs_full.py [--steps 30] [--rank 8] [--targets q_proj v_proj]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from labcourse import results
from labkit import bench, lora, quant, tasks, train
from labkit.data import load_corpus
from labkit.models import count_parameters, load_model
from labkit.profiles import get_profile

# gpu-check's steps for this script (labcourse.gpucheck reads this literal without importing the script)
GPU_CHECK = [{"name": "LoRA vs full fine-tune memory", "args": [], "timeout_s": 2400}]

LEARNING_RATES = {"full": 5e-5, "lora": 1e-3, "qlora": 1e-3}


def run_one(method: str, args: argparse.Namespace) -> dict:
    """Train and score one method in this process; returns the measured figures."""
    device = bench.as_device(None)
    model, tokenizer = load_model(device=device)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    n_params = count_parameters(model)
    if method == "qlora":
        profile = get_profile()
        calibration = quant.calibration_blocks(
            tokenizer,
            load_corpus("wiki", "train"),
            profile.quant.calibration_blocks,
            profile.quant.calibration_block_size,
        )
        qm = quant.quantize_model(
            model, quant.QuantConfig(bits=4, group_size=64), calibration, inplace=True, progress=False
        )
        model = quant.pack_model(qm)
        del qm
    if method != "full":
        lora.add_lora(model, args.targets, r=args.rank, alpha=2 * args.rank)
    examples = tasks.title_examples("train")[: args.steps * args.batch_size]
    held_out = tasks.title_examples("validation", limit=args.eval_examples)
    cfg = train.TrainConfig(steps=args.steps, lr=LEARNING_RATES[method], warmup_steps=args.steps // 10, progress=False)
    result = lora.finetune_and_score(
        method, model, tokenizer, examples, held_out, cfg, args.batch_size, args.max_length
    )
    return {
        "method": method,
        "trainable": result.trainable,
        "share": result.trainable / n_params,
        "step_seconds": result.step_seconds,
        "peak_bytes": result.peak_memory.peak_bytes,
        "memory_kind": result.peak_memory.kind,
        "state_bytes": result.state_bytes["total"],
        "accuracy": result.accuracy,
        "eval_loss": result.eval_loss,
        "first_loss": result.losses[0],
        "last_loss": result.losses[-1],
        "device": bench.device_name(device),
    }


def main() -> None:
    profile = get_profile()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=profile.lora.steps)
    parser.add_argument("--batch-size", type=int, default=profile.lora.batch_size)
    parser.add_argument("--max-length", type=int, default=profile.lora.max_length)
    parser.add_argument("--eval-examples", type=int, default=profile.lora.eval_examples)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", nargs="+", default=["q_proj", "v_proj"])
    parser.add_argument("--methods", nargs="+", choices=sorted(LEARNING_RATES), default=["full", "lora", "qlora"])
    parser.add_argument("--results", default="results", help="folder for this run's JSON file")
    parser.add_argument("--child", choices=sorted(LEARNING_RATES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child, args)))
        return

    methods = {}
    if not {"full", "lora"} <= set(args.methods):
        raise SystemExit("--methods must include full and lora: the ratios compare them")
    for method in args.methods:
        child = [
            sys.executable,
            __file__,
            "--child",
            method,
            "--steps",
            str(args.steps),
            "--batch-size",
            str(args.batch_size),
            "--max-length",
            str(args.max_length),
            "--eval-examples",
            str(args.eval_examples),
            "--rank",
            str(args.rank),
            "--targets",
            *args.targets,
        ]
        out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
        methods[method] = json.loads(out.strip().splitlines()[-1])
    full, low = methods["full"], methods["lora"]
    if "qlora" in methods:
        methods["qlora"]["method"] += " (GPTQ 4-bit base, packed)"
    print(
        f"{args.steps} steps x {args.batch_size} examples (max {args.max_length} tokens), {args.eval_examples} "
        f"held-out articles, {full['device']}; LoRA r={args.rank} on {', '.join(args.targets)}"
    )
    for name, r in methods.items():
        print(
            f"{name:>5}: trainable {r['trainable']:,} ({100 * r['share']:.2f} %), step {r['step_seconds']:.2f} s, "
            f"peak {bench.fmt_bytes(r['peak_bytes'])} ({r['memory_kind']}), state {bench.fmt_bytes(r['state_bytes'])}, "
            f"exact match {100 * r['accuracy']:.1f} %, answer loss {r['eval_loss']:.3f}"
        )
    summary = {
        "lora_trainable_share": low["share"],
        "step_time_ratio_lora_over_full": low["step_seconds"] / full["step_seconds"],
        "peak_memory_ratio_lora_over_full": low["peak_bytes"] / full["peak_bytes"],
        "state_ratio_lora_over_full": low["state_bytes"] / full["state_bytes"],
        "accuracy_lora": low["accuracy"],
        "accuracy_full": full["accuracy"],
    }
    if "qlora" in methods:
        summary["peak_memory_ratio_qlora_over_full"] = methods["qlora"]["peak_bytes"] / full["peak_bytes"]
        summary["accuracy_qlora"] = methods["qlora"]["accuracy"]
    for key, value in summary.items():
        print(f"{key}: {value:.4f}")
    results.save_run(
        "lora_vs_full",
        {
            "profile": profile.name,
            "rank": args.rank,
            "targets": args.targets,
            "steps": args.steps,
            "methods": methods,
            **summary,
        },
        root=args.results,
    )


if __name__ == "__main__":
    main()
