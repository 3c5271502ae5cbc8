"""Under torchrun: sharded training equals one process. Five AdamW steps, in float64 so that differences are bugs,
not summation order, with: labkit's ZeRO-1 (`Zero1AdamW`) and torch's `ZeroRedundancyOptimizer` under DDP, and
FSDP2 (`fully_shard` per block, then the root), each against one process on the whole batch.

    torchrun --nproc_per_node=2 labs/scripts/zero_parity.py
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit.models import tiny_llama
from labkit.parallel.launch import rank_context, save_result
from labkit.parallel.memory import moment_bytes
from labkit.parallel.zero import Zero1AdamW

STEPS, LR = 5, 1e-2


def loss_of(model, x):
    logits = model(input_ids=x[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def batches(world, device):
    """The global batch of each step: 2 sequences per rank."""
    return [
        torch.randint(0, 128, (2 * world, 17), generator=torch.Generator().manual_seed(10 + step)).to(device)
        for step in range(STEPS)
    ]


def train(model, optimizer, data, rank=None):
    for x in data:
        optimizer.zero_grad()
        loss_of(model, x if rank is None else x[rank * 2 : rank * 2 + 2]).backward()
        optimizer.step()


def flat(params):
    return torch.cat([p.detach().flatten() for p in params])


def main() -> None:
    with rank_context() as (rank, world, device):
        base = (
            tiny_llama(
                vocab_size=128, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=0
            )
            .double()
            .to(device)
        )
        data = batches(world, device)
        single = copy.deepcopy(base)
        single_opt = torch.optim.AdamW(single.parameters(), lr=LR)
        train(single, single_opt, data)
        expected = flat(single.parameters())

        ours = copy.deepcopy(base)
        zero1 = Zero1AdamW(ours.parameters(), lr=LR)  # before DDP: it re-homes the parameters in one buffer
        train(DDP(ours), zero1, data, rank)

        theirs = DDP(copy.deepcopy(base))
        zero_torch = ZeroRedundancyOptimizer(theirs.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
        train(theirs, zero_torch, data, rank)

        sharded = copy.deepcopy(base)
        mesh = init_device_mesh(device.type, (world,))
        for block in sharded.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        fsdp_opt = torch.optim.AdamW(sharded.parameters(), lr=LR)
        train(sharded, fsdp_opt, data, rank)
        full = flat(p.full_tensor() for p in sharded.parameters())
        local = sum(p.to_local().numel() for p in sharded.parameters())

        save_result(
            {
                "rank": rank,
                "world": world,
                "parameters": expected.numel(),
                "zero1_vs_single": (flat(ours.parameters()) - expected).abs().max().item(),
                "zero_redundancy_vs_single": (flat(theirs.module.parameters()) - expected).abs().max().item(),
                "fsdp_vs_single": (full - expected).abs().max().item(),
                "scale": expected.abs().max().item(),
                "optimizer_bytes": {
                    "single": moment_bytes(single_opt),
                    "zero1": moment_bytes(zero1.optimizer),
                    "zero_redundancy": moment_bytes(zero_torch.optim),
                    "fsdp": moment_bytes(fsdp_opt),
                },
                "fsdp_local_parameters": local,
            }
        )
        dist.barrier()


if __name__ == "__main__":
    main()
