"""Under torchrun: the bytes each rank hands to collectives in one training step, for DDP (uncompressed and bf16),
ZeRO-1 (torch's and labkit's) and FSDP2; and labkit's fp16 compression hook against torch's (same gradients).

    torchrun --nproc_per_node=2 labs/scripts/comm_volume.py
"""

import copy

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit.models import tiny_llama
from labkit.parallel.comm import compress_hook, count_collectives
from labkit.parallel.launch import rank_context, save_result
from labkit.parallel.zero import Zero1AdamW


def loss_of(model, x):
    logits = model(input_ids=x[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def one_step(model, optimizer, x):
    """One training step, its collectives counted."""
    with count_collectives() as counts:
        optimizer.zero_grad()
        loss_of(model, x).backward()
        optimizer.step()
    return dict(counts)


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def main() -> None:
    with rank_context() as (rank, world, device):
        base = tiny_llama(
            vocab_size=128, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=0
        ).to(device)
        x = torch.randint(0, 128, (2 * world, 17), generator=torch.Generator().manual_seed(1)).to(device)
        mine = x[rank * 2 : rank * 2 + 2]
        steps = {}

        ddp = DDP(copy.deepcopy(base))
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)  # DDP's own all-reduce, from Python
        steps["ddp"] = one_step(ddp, torch.optim.AdamW(ddp.parameters()), mine)

        for dtype in (torch.bfloat16, torch.float16):
            ddp = DDP(copy.deepcopy(base))
            ddp.register_comm_hook(None, compress_hook(dtype))
            steps[f"ddp_{str(dtype).split('.')[1]}"] = one_step(ddp, torch.optim.AdamW(ddp.parameters()), mine)
        ours = ddp  # float16: torch's own hook runs on gloo too (its bf16 hook is refused off NCCL)
        theirs = DDP(copy.deepcopy(base))
        theirs.register_comm_hook(None, default_hooks.fp16_compress_hook)
        steps["ddp_float16_torch"] = one_step(theirs, torch.optim.AdamW(theirs.parameters()), mine)

        zero_torch = DDP(copy.deepcopy(base))
        zero_torch.register_comm_hook(None, default_hooks.allreduce_hook)
        steps["zero1_torch"] = one_step(
            zero_torch, ZeroRedundancyOptimizer(zero_torch.parameters(), optimizer_class=torch.optim.AdamW), mine
        )
        zero_ours = copy.deepcopy(base)
        optimizer = Zero1AdamW(zero_ours.parameters())
        zero_ours = DDP(zero_ours)
        zero_ours.register_comm_hook(None, default_hooks.allreduce_hook)
        steps["zero1"] = one_step(zero_ours, optimizer, mine)

        sharded = copy.deepcopy(base)
        mesh = init_device_mesh(device.type, (world,))
        blocks = list(sharded.model.layers)
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        steps["fsdp"] = one_step(sharded, torch.optim.AdamW(sharded.parameters()), mine)

        save_result(
            {
                "rank": rank,
                "world": world,
                "parameters": sum(p.numel() for p in base.parameters()),
                "block_parameters": sum(p.numel() for b in base.model.layers for p in b.parameters()),
                "steps": steps,
                "fp16_hook_vs_torch": (grads(ours) - grads(theirs)).abs().max().item(),
            }
        )


if __name__ == "__main__":
    main()
