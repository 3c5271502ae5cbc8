"""labkit.train.fit against a bare hand-written PyTorch loop: same model, same batches, same optimizer,
and both synchronize the device around each step to time it (fit does, to report tokens/s), so the
difference is the trainer's own work. Target: the trainer costs at most 3 % more time per step.

    python benchmarks/trainer_overhead.py [--steps 30] [--repeats 3] [--device cuda]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from labcourse import results
from labkit import bench
from labkit.models import tiny_gpt2
from labkit.train import TrainConfig, fit, make_optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default=None)
    parser.add_argument("--results", default="results", help="folder for this run's JSON file")
    args = parser.parse_args()
    device = bench.as_device(args.device)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, 2000, (8, 128), generator=gen) for _ in range(args.steps)]
    batches = [(x, torch.roll(x, -1, dims=1)) for x in inputs]
    cfg = TrainConfig(steps=args.steps, lr=1e-3, grad_clip=1.0, progress=False)

    def model():
        return tiny_gpt2(vocab_size=2000, hidden_size=256, num_layers=4, num_heads=4, seed=0).to(device)

    def bare() -> None:
        m = model()
        m.train()
        opt = make_optimizer(m, cfg)
        for x, y in batches:
            with bench.stopwatch(device):  # per-step time, synchronized, as any loop that reports tokens/s
                x, y = x.to(device), y.to(device)
                logits = m(input_ids=x).logits
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                loss.backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
        loss.item()

    def trainer() -> None:
        fit(model(), batches, cfg)

    timings = bench.time_interleaved(
        {"bare loop": bare, "labkit.train.fit": trainer}, warmup=0, repeats=args.repeats, device=device
    )
    med = {k: t.median / args.steps for k, t in timings.items()}
    overhead = med["labkit.train.fit"] / med["bare loop"] - 1
    print(f"{args.steps} steps of GPT-2 (4 x 256, vocab 2000), batch 8 x 128, on {bench.device_name(device)}")
    for name, t in med.items():
        print(f"{name:>18}: {bench.fmt_seconds(t)} per step (median of {args.repeats} runs)")
    print(f"trainer overhead: {overhead:+.1%} (target <= +3%)")
    results.save_run(
        "trainer_overhead", {"seconds_per_step": med, "overhead": overhead, **vars(args)}, root=args.results
    )


if __name__ == "__main__":
    main()
