"""Under torchrun: lab 09's measurements of sharded data parallelism, on every rank, in one launch.

    torchrun --nproc_per_node=2 labs/scripts/sharding.py [--parts parity,traffic,memory,compression] [sizes]

parity       five float64 AdamW steps of labkit's ZeRO-1, torch's ZeroRedundancyOptimizer and FSDP2, each against
             one process on the whole batch (a fixed tiny model: differences are bugs, not summation order)
traffic      the bytes each rank hands to each collective in one step: DDP (plain, bf16/fp16-compressed, torch's
             fp16 hook), ZeRO-1 (labkit's, torch's), FSDP2
memory       per method: what a rank holds after a step (tensor by tensor), the memory in use it added (allocator
             on a GPU, resident set on a CPU), the step's peak, the median step time — beside memory.state_bytes
compression  a loss curve per DDP gradient hook: uncompressed, bf16, PowerSGD (rank 1 and 4), with bytes per step
"""

import argparse
import copy
import dataclasses
import statistics
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import bench, shards
from labkit.models import llama_shape, tiny_llama
from labkit.parallel import memory
from labkit.parallel.comm import compress_hook, count_collectives
from labkit.parallel.fsdp import shard_model
from labkit.parallel.launch import rank_context, report_progress, save_result
from labkit.parallel.zero import Zero1AdamW
from labkit.profiles import get_profile
from labkit.torchutil import activation_checkpointing

PARTS = ("parity", "traffic", "memory", "compression")
METHODS = ("ddp", "zero1", "zero1_torch", "fsdp", "fsdp_ckpt", "fsdp_offload")
HOOKS = {  # the compression curves: a fresh hook (or (state, hook)) per curve
    "none": lambda: default_hooks.allreduce_hook,
    "bf16": lambda: compress_hook(torch.bfloat16),
    "powersgd_1": lambda: powersgd(1),
    "powersgd_4": lambda: powersgd(4),
}
UNITS = {"parity": 1, "traffic": 1, "memory": len(METHODS), "compression": len(HOOKS)}  # for the launcher's bar


class Ticker:
    """Rank 0 tells the launcher's bar which unit of work starts, and how many are done."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0

    def __call__(self, what: str) -> None:
        report_progress(min(self.done, self.total), self.total, what)
        self.done += 1


def loss_of(model, x):
    logits = model(input_ids=x[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def step(model, optimizer, x):
    optimizer.zero_grad()
    loss = loss_of(model, x)
    loss.backward()
    optimizer.step()
    return loss.detach()


def flat(params):
    return torch.cat([p.detach().flatten() for p in params])


def parity(rank, world, device, steps=5, lr=1e-2):
    """Weights after `steps` AdamW steps of each sharded optimizer against one process (float64)."""
    base = tiny_llama(vocab_size=128, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=0)
    base = base.double().to(device)
    gen = torch.Generator().manual_seed(10)
    data = [torch.randint(0, 128, (2 * world, 17), generator=gen).to(device) for _ in range(steps)]
    mine = [x[rank * 2 : rank * 2 + 2] for x in data]  # 2 sequences per rank
    single = copy.deepcopy(base)
    single_opt = torch.optim.AdamW(single.parameters(), lr=lr)
    for x in data:
        step(single, single_opt, x)
    expected = flat(single.parameters())
    trained, optimizers = {}, {}
    for method in ("zero1", "zero1_torch", "fsdp"):
        model, optimizer, inner, inner_opt = wrap(method, base, lr)
        for x in mine:
            step(model, optimizer, x)
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in inner.parameters()]
        trained[method], optimizers[method] = flat(full), inner_opt
    return {
        "parameters": expected.numel(),
        "scale": expected.abs().max().item(),
        "vs_single": {m: (w - expected).abs().max().item() for m, w in trained.items()},
        "optimizer_bytes": {"single": memory.moment_bytes(single_opt)}
        | {m: memory.moment_bytes(o) for m, o in optimizers.items()},
    }


def wrap(method, base, lr=1e-3, bucket_mb=25.0):
    """(model to call, optimizer to step, the module that holds the parameters, the optimizer that holds the
    state) for one training method, on a copy of `base`; DDP's gradient buckets of `bucket_mb` MiB (its default)."""
    inner = copy.deepcopy(base)
    if method in ("fsdp", "fsdp_ckpt", "fsdp_offload"):
        if method == "fsdp_ckpt":
            activation_checkpointing(inner, on=True)
            inner.train()
        shard_model(inner, offload=method == "fsdp_offload")
        optimizer = torch.optim.AdamW(inner.parameters(), lr=lr)
        return inner, optimizer, inner, optimizer
    if method == "zero1":
        optimizer = Zero1AdamW(inner.parameters(), lr=lr)  # before DDP: it re-homes the parameters in one buffer
        return DDP(inner, gradient_as_bucket_view=True), optimizer, inner, optimizer.optimizer
    model = DDP(inner, gradient_as_bucket_view=True, bucket_cap_mb=bucket_mb)  # gradients live in the buckets
    if method == "zero1_torch":
        optimizer = ZeroRedundancyOptimizer(inner.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
        return model, optimizer, inner, optimizer.optim
    if method == "ddp":
        optimizer = torch.optim.AdamW(inner.parameters(), lr=lr)
        return model, optimizer, inner, optimizer
    raise ValueError(f"unknown method {method!r}")


def traffic(base, x):
    """Bytes this rank hands to each kind of collective in one step, per method; DDP's own all-reduce runs in C++,
    so a Python hook with the same arithmetic makes it visible."""
    hooks = {
        "ddp": default_hooks.allreduce_hook,
        "ddp_bfloat16": compress_hook(torch.bfloat16),
        "ddp_float16": compress_hook(torch.float16),
        "ddp_float16_torch": default_hooks.fp16_compress_hook,
    }
    steps, grads = {}, {}
    for name, hook in hooks.items():
        model, optimizer, inner, _ = wrap("ddp", base)
        model.register_comm_hook(None, hook)
        with count_collectives() as counts:
            step(model, optimizer, x)
        steps[name], grads[name] = dict(counts), flat(p.grad for p in inner.parameters())
    for method in ("zero1", "zero1_torch", "fsdp"):
        model, optimizer, _, _ = wrap(method, base)
        if isinstance(model, DDP):
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        with count_collectives() as counts:
            step(model, optimizer, x)
        steps[method] = dict(counts)
    fp16_difference = (grads["ddp_float16"] - grads["ddp_float16_torch"]).abs().max().item()
    return {"steps": steps, "fp16_hook_vs_torch": fp16_difference}


def measure_memory(base, x, device, repeats, tick):
    """Per method: bytes held after a step, memory in use it added, the step's peak, and the median step time."""
    n = sum(p.numel() for p in base.parameters())
    world, rows = dist.get_world_size(), {}
    for method in METHODS:
        tick(f"memory: {method}")
        if method == "fsdp_offload" and device.type == "cpu":
            continue  # nothing to offload to: CPU ranks hold everything in host memory already
        bench.release_memory()
        before = bench.memory_in_use(device)
        model, optimizer, inner, inner_opt = wrap(method, base)
        with bench.track_peak_memory(device) as peak:
            step(model, optimizer, x)  # the first step allocates gradients and optimizer state
        held = memory.held_bytes(inner, inner_opt, device)
        bench.release_memory()
        added = bench.memory_in_use(device) - before
        seconds = bench.time_fn(partial(step, model, optimizer, x), warmup=0, repeats=repeats, device=device).median
        strategy = "zero3" if method.startswith("fsdp") else "zero1" if method.startswith("zero1") else "ddp"
        predicted = memory.state_bytes(n, strategy, world, offload=method == "fsdp_offload")
        rows[method] = {
            "held": dataclasses.asdict(held),
            "predicted": dataclasses.asdict(predicted),
            "added_bytes": added,
            "peak_bytes": peak.delta_bytes,
            "memory_kind": peak.kind,
            "seconds": seconds,
        }
        del model, optimizer, inner, inner_opt
    return {"parameters": n, "methods": rows}


def compression(base, batches, lr, tick):
    """One loss curve per gradient hook (the mean over ranks of each step's loss) and the bytes per step."""
    curves = {}
    # one bucket: PowerSGD chains collectives in future callbacks, and on gloo two buckets' callbacks can issue
    # them in a different order on each rank (a collective mismatch)
    one_bucket = 4 * sum(p.numel() for p in base.parameters()) / 2**20 + 1
    for name, make in HOOKS.items():
        tick(f"compression: {name}")
        model, optimizer, _, _ = wrap("ddp", base, lr, bucket_mb=one_bucket)
        hook = make()
        model.register_comm_hook(*hook) if isinstance(hook, tuple) else model.register_comm_hook(None, hook)
        losses, sent = [], []
        for x in batches:
            with count_collectives() as counts:
                loss = step(model, optimizer, x)
            sent.append(sum(v for k, v in counts.items() if not k.startswith("calls:")))
            dist.all_reduce(loss)
            losses.append(loss.item() / dist.get_world_size())
        curves[name] = {"losses": losses, "bytes_per_step": statistics.median(sent[2:] or sent)}
    return curves


def powersgd(rank):
    """(state, hook) for torch's PowerSGD: rank-`rank` factors of each gradient matrix, with error feedback; the
    first 2 steps all-reduce uncompressed (a warm start for the error feedback)."""
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2, min_compression_rate=1
    )
    return state, powerSGD_hook.powerSGD_hook


def synthetic_batches(vocab, batch, seq, steps, rank, seed=0):
    """Learnable token streams for when no shards are given: each token is followed by a fixed successor 9 times
    in 10, by a random token otherwise (the loss can fall from ln V towards ~0.5)."""
    gen = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab, generator=gen)
    out = []
    for i in range(steps):
        g = torch.Generator().manual_seed(seed + 1 + i * 1000 + rank)
        x = torch.empty(batch, seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(1, seq + 1):
            noise = torch.randint(0, vocab, (batch,), generator=g)
            keep = torch.rand(batch, generator=g) < 0.9
            x[:, t] = torch.where(keep, successor[x[:, t - 1]], noise)
        out.append(x)
    return out


def main() -> None:
    profile = get_profile()  # the default sizes: lab 09's model at this profile
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated, from " + ", ".join(PARTS))
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument(
        "--hidden", type=int, default=profile.scale.hidden, help="a multiple of 128 (models.llama_shape)"
    )
    parser.add_argument("--layers", type=int, default=profile.scale.layers)
    parser.add_argument("--batch", type=int, default=profile.scale.batch, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=profile.scale.seq, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per method (the median is reported)")
    parser.add_argument("--steps", type=int, default=profile.scale.steps, help="steps per compression curve")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate of the compression curves")
    parser.add_argument("--shards", help="token shards for the compression curves (default: synthetic streams)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    with rank_context() as (rank, world, device):
        base = tiny_llama(**llama_shape(args.vocab, args.hidden, args.layers, args.seq), seed=0).to(device)
        blocks = base.model.layers
        result = {
            "rank": rank,
            "world": world,
            "device": bench.device_name(device),
            "parameters": sum(p.numel() for p in base.parameters()),
            "block_parameters": sum(p.numel() for p in blocks.parameters()),
            "blocks": len(blocks),
        }
        x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(rank))
        x = x.to(device)
        tick = Ticker(sum(UNITS[part] for part in parts))
        if "parity" in parts:
            tick("parity")
            result["parity"] = parity(rank, world, device)
        if "traffic" in parts:
            tick("traffic")
            result["traffic"] = traffic(base, x)
        if "memory" in parts:
            result["memory"] = measure_memory(base, x, device, args.repeats, tick)
        if "compression" in parts:
            if args.shards:
                paths = sorted(Path(args.shards).glob("*.bin"))
                loader = shards.make_loader(paths, args.seq, args.batch, rank=rank, world_size=world, seed=0)
                pairs = zip(loader, range(args.steps), strict=False)  # (inputs, targets shifted by one)
                batches = [torch.cat([inputs, targets[:, -1:]], 1) for (inputs, targets), _ in pairs]
            else:
                batches = synthetic_batches(args.vocab, args.batch, args.seq, args.steps, rank)
            result["compression"] = compression(base, [b.to(device) for b in batches], args.lr, tick)
        report_progress(tick.total, tick.total)
        save_result(result)


if __name__ == "__main__":
    main()
