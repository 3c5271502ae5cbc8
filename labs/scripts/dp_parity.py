"""Under torchrun: torch DDP vs one process on the whole batch vs labkit's from-scratch data parallelism.

    torchrun --nproc_per_node=2 labs/scripts/dp_parity.py [--fail-rank R] [--hang-rank R]
Runs in fp64 so that differences are bugs, not summation order. With padded documents of very different
lengths it also compares dividing by every rank's target tokens with dividing by each rank's own.
"""

import argparse
import copy
import hashlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import precision
from labkit.data import pad_batch
from labkit.models import tiny_llama
from labkit.parallel.ddp import BucketedDataParallel, all_reduce_gradients
from labkit.parallel.launch import rank_context, save_result
from labkit.parallel.ring import ring_all_reduce_
from labkit.train import accumulate_gradients, as_batch

# Documents of very different lengths, rank 0's short and rank 1's long (with 2 ranks): 4 per rank,
# 2 micro-batches of 2, padded. Dividing by each rank's own token count weights the short ones up.
DOC_LENGTHS = (3, 5, 4, 6, 40, 57, 33, 61)


def loss_of(model, x):
    logits = model(input_ids=x[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def padded_documents_errors(base, rank, world, device):
    """Gradient error against one process on all documents, when the ranks divide by every rank's target
    tokens ("tokens") and when each divides by its own ("rank_tokens")."""
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(2, 128, (n,), generator=gen).tolist() for n in DOC_LENGTHS]
    per_rank = len(docs) // world
    fp = precision.policy("fp32", device)
    single = copy.deepcopy(base)
    accumulate_gradients(single, [as_batch(pad_batch(docs, pad_id=0), device)], fp)
    mine = docs[rank * per_rank : (rank + 1) * per_rank]
    micro = [as_batch(pad_batch(mine[i : i + 2], pad_id=0), device) for i in range(0, len(mine), 2)]
    errors = {}
    for normalize in ("tokens", "rank_tokens"):
        ddp = DDP(copy.deepcopy(base))
        accumulate_gradients(ddp, micro, fp, normalize=normalize)
        errors[normalize] = (grads(ddp.module) - grads(single)).abs().max().item()
    return {
        "padded_tokens_vs_single": errors["tokens"],
        "padded_rank_tokens_vs_single": errors["rank_tokens"],
        "padded_gradient_scale": grads(single).abs().max().item(),
        "padded_rank_targets": sum(max(0, len(d) - 1) for d in mine),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--hang-rank", type=int, default=-1)
    args = parser.parse_args()
    with rank_context() as (rank, world, device):
        if rank == args.fail_rank:
            raise ValueError(f"boom from rank {rank}")
        if rank == args.hang_rank:
            time.sleep(3600)  # a dead-locked rank: the launcher's timeout must end the job
        base = (
            tiny_llama(
                vocab_size=128, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=0
            )
            .double()
            .to(device)
        )
        batch = torch.randint(0, 128, (2 * world, 17), generator=torch.Generator().manual_seed(1)).to(device)
        mine = batch[rank * 2 : rank * 2 + 2]  # equal token counts per rank: mean of means = global mean

        ref = copy.deepcopy(base)
        loss_of(ref, batch).backward()

        ddp = DDP(copy.deepcopy(base))
        loss_of(ddp, mine).backward()

        naive = copy.deepcopy(base)
        loss_of(naive, mine).backward()
        all_reduce_gradients(naive)

        bucketed_model = copy.deepcopy(base)
        bucketed = BucketedDataParallel(bucketed_model, bucket_mb=0.02)
        loss_of(bucketed_model, mine).backward()
        bucketed.finish()
        # The ring all-reduce built from point-to-point sends against the library's, on different values
        # per rank (an odd length, so the chunks are uneven).
        ring = torch.randn(1001, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)).to(device)
        library = ring.clone()
        ring_all_reduce_(ring)
        dist.all_reduce(library)
        result = {
            "rank": rank,
            "world": world,
            "device": str(device),
            "buckets": len(bucketed.buckets),
            "ring_elements": ring.numel(),
            "ring_vs_all_reduce": (ring - library).abs().max().item(),
            "ddp_vs_single_batch": (grads(ddp.module) - grads(ref)).abs().max().item(),
            "naive_vs_ddp": (grads(naive) - grads(ddp.module)).abs().max().item(),
            "bucketed_vs_ddp": (grads(bucketed_model) - grads(ddp.module)).abs().max().item(),
            **padded_documents_errors(base, rank, world, device),
        }

        # A few AdamW steps with DDP: ranks must stay identical and match one process on the whole batch.
        single = copy.deepcopy(base)
        opt_ddp = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        opt_single = torch.optim.AdamW(single.parameters(), lr=1e-2)
        for step in range(5):
            data = torch.randint(0, 128, (2 * world, 17), generator=torch.Generator().manual_seed(10 + step)).to(device)
            for model, opt, x in ((ddp, opt_ddp, data[rank * 2 : rank * 2 + 2]), (single, opt_single, data)):
                opt.zero_grad()
                loss_of(model, x).backward()
                opt.step()
        params = torch.cat([p.detach().flatten() for p in ddp.module.parameters()])
        save_result(
            {
                **result,
                "params_after_steps_vs_single": (
                    params - torch.cat([p.detach().flatten() for p in single.parameters()])
                )
                .abs()
                .max()
                .item(),
                "params_sha256": hashlib.sha256(params.cpu().numpy().tobytes()).hexdigest(),
            }
        )


if __name__ == "__main__":
    main()
