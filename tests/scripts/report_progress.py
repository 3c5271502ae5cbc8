"""Under torchrun, for tests/test_parallel_launch.py: rank 0 reports three units of work around a log line."""

from labkit.parallel.launch import rank_context, report_progress, save_result

with rank_context() as (rank, world, device):
    report_progress(0, 3, "first unit")
    print(f"rank {rank} of {world} works", flush=True)
    report_progress(3, 3)
    save_result({"rank": rank})
