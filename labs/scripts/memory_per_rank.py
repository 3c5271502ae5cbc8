"""Under torchrun: what each rank holds after one training step (parameters, gradients, AdamW state, counted tensor by
tensor) under DDP, ZeRO-1 (labkit's and torch's), FSDP2 and FSDP2 with CPU offload, next to `memory.state_bytes`.

    torchrun --nproc_per_node=2 labs/scripts/memory_per_rank.py
"""

import copy
import dataclasses

import torch
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit.models import tiny_llama
from labkit.parallel import memory
from labkit.parallel.fsdp import shard_model
from labkit.parallel.launch import rank_context, save_result
from labkit.parallel.zero import Zero1AdamW


def step(model, optimizer, x):
    optimizer.zero_grad()
    F.cross_entropy(model(input_ids=x[:, :-1]).logits.flatten(0, 1), x[:, 1:].flatten()).backward()
    optimizer.step()


def main() -> None:
    with rank_context() as (rank, world, device):
        base = tiny_llama(vocab_size=512, hidden_size=64, num_layers=4, intermediate_size=128, seed=0).to(device)
        n = sum(p.numel() for p in {id(p): p for p in base.parameters()}.values())
        x = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(rank)).to(device)
        held, predicted = {}, {}

        ddp = DDP(copy.deepcopy(base))
        opt = torch.optim.AdamW(ddp.parameters())
        step(ddp, opt, x)
        held["ddp"], predicted["ddp"] = memory.held_bytes(ddp.module, opt), memory.state_bytes(n, "ddp", world)

        ours = copy.deepcopy(base)
        zero1 = Zero1AdamW(ours.parameters())
        step(DDP(ours), zero1, x)
        held["zero1"] = memory.held_bytes(ours, zero1.optimizer)
        predicted["zero1"] = memory.state_bytes(n, "zero1", world)

        theirs = DDP(copy.deepcopy(base))
        zero_torch = ZeroRedundancyOptimizer(theirs.parameters(), optimizer_class=torch.optim.AdamW)
        step(theirs, zero_torch, x)
        held["zero1_torch"] = memory.held_bytes(theirs.module, zero_torch.optim)
        predicted["zero1_torch"] = predicted["zero1"]

        for name, offload in (("fsdp", False), ("fsdp_offload", True)):
            if offload and device.type == "cpu":
                continue  # nothing to offload to: the ranks already hold everything in host memory
            sharded = shard_model(copy.deepcopy(base), offload=offload)
            opt = torch.optim.AdamW(sharded.parameters())
            step(sharded, opt, x)
            held[name] = memory.held_bytes(sharded, opt)
            predicted[name] = memory.state_bytes(n, "zero3", world, offload=offload)

        save_result(
            {
                "rank": rank,
                "parameters": n,
                "held": {k: dataclasses.asdict(v) for k, v in held.items()},
                "predicted": {k: dataclasses.asdict(v) for k, v in predicted.items()},
            }
        )


if __name__ == "__main__":
    main()
