"""Time one all-reduce per buffer size across the ranks of a torchrun job (gloo on CPU, NCCL on GPU):
the library's, and labkit's ring built from point-to-point sends, side by side.

    torchrun --standalone --nproc_per_node=2 labs/scripts/allreduce_bench.py --megabytes 1 4 16 64
"""

import argparse

import torch.distributed as dist

from labcourse import results
from labkit.parallel.ddp import time_all_reduce
from labkit.parallel.launch import rank_context, save_result
from labkit.parallel.ring import ring_all_reduce_

# gpu-check's step for this script: NCCL needs a GPU per rank (labcourse.gpucheck reads this literal)
GPU_CHECK = [{"name": "all-reduce on NCCL", "args": [], "timeout_s": 600, "gpus": 2, "torchrun": True}]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--megabytes", type=float, nargs="+", default=[0.25, 1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--results", help="also save rank 0's rows as a run in this folder (labcourse.results.save_run)"
    )
    args = parser.parse_args()
    with rank_context() as (rank, world, device):
        rows = []
        for mb in args.megabytes:
            numel = int(mb * 2**20 / 4)  # fp32
            rows.append(
                {
                    "bytes": numel * 4,
                    "seconds": time_all_reduce(numel, device, args.repeats),
                    "ring_seconds": time_all_reduce(numel, device, args.repeats, all_reduce=ring_all_reduce_),
                }
            )
        save_result({"rank": rank, "world": world, "device": str(device), "rows": rows})
        if args.results and rank == 0:
            results.save_run(
                "all_reduce", {"world": world, "backend": dist.get_backend(), "rows": rows}, root=args.results
            )


if __name__ == "__main__":
    main()
