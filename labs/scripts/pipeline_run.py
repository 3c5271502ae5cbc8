"""Pipeline parallelism under torchrun: each rank holds one stage of a Llama; GPipe or 1F1B runs the
micro-batches; the script checks loss and gradients against the unsplit model and records a timeline.

One launch runs every configuration asked for (at lab sizes, starting the ranks costs more than a run):

    torchrun --standalone --nproc_per_node=2 labs/scripts/pipeline_run.py --runs gpipe:4 1f1b:4 1f1b:8
"""

import argparse
import copy

import torch
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from labkit.models import tiny_llama
from labkit.parallel.launch import rank_context, report_progress, save_result
from labkit.parallel.pipeline import SCHEDULES, LlamaStage, StageTimeline, max_in_flight, saved_activation_bytes


def parse_run(text: str) -> tuple[str, int]:
    """'1f1b:8' -> ("1f1b", 8)."""
    schedule, _, microbatches = text.partition(":")
    if schedule not in SCHEDULES or not microbatches.isdigit() or int(microbatches) < 1:
        raise argparse.ArgumentTypeError(f"expected SCHEDULE:M with SCHEDULE in {SCHEDULES} and M >= 1, got {text!r}")
    return schedule, int(microbatches)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=parse_run, nargs="+", default=[("gpipe", 4)], metavar="SCHEDULE:M")
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the checked one")
    args = parser.parse_args()
    with rank_context() as (rank, world, device):
        for schedule, microbatches in args.runs:
            if schedule == "1f1b" and microbatches < world:
                raise ValueError(f"1F1B needs at least as many micro-batches as stages ({world}), got {microbatches}")
        runs = []
        for schedule, microbatches in args.runs:
            report_progress(len(runs), len(args.runs), f"{schedule}:{microbatches}")
            runs.append(run(schedule, microbatches, args, rank, world, device))
        report_progress(len(runs), len(args.runs))
        save_result({"runs": runs})


def run(schedule_name: str, microbatches: int, args: argparse.Namespace, rank: int, world: int, device) -> dict:
    """One configuration: check one step against the unsplit model, then time `args.steps` steps."""
    model = tiny_llama(
        vocab_size=512,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=3 * args.hidden,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
        seed=0,
    ).to(device)
    model.train()
    batch = torch.randint(
        0, 512, (microbatches * args.microbatch_size, args.seq + 1), generator=torch.Generator().manual_seed(1)
    ).to(device)
    x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # the stage checks strides: a slice would fail on CUDA

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    reference = copy.deepcopy(model)
    ref_loss = loss_fn(reference(input_ids=x).logits, y)
    ref_loss.backward()

    stage_module = LlamaStage(model, rank, world)
    stage = PipelineStage(stage_module, stage_index=rank, num_stages=world, device=device)
    schedule = (ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B)(
        stage, n_microbatches=microbatches, loss_fn=loss_fn
    )

    def step():
        losses = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        return losses

    losses = step()
    ref_grads = dict(reference.named_parameters())
    grad_diff = max(
        (p.grad - ref_grads[n].grad).abs().max().item() for n, p in model.named_parameters() if p.grad is not None
    )
    loss_diff = abs(torch.stack(losses).mean().item() - ref_loss.item()) if losses else None

    # What one micro-batch leaves in memory for backward on this stage.
    inputs = (
        x[: args.microbatch_size]
        if rank == 0
        else torch.randn(args.microbatch_size, args.seq, args.hidden, device=device, requires_grad=True)
    )
    activation_bytes = saved_activation_bytes(stage_module, inputs)
    model.zero_grad(set_to_none=True)

    timeline = StageTimeline(stage, rank, device)
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        timeline.start()  # keep the last step's timeline
        torch.distributed.barrier()
        step()
    events = timeline.events()
    return {
        "rank": rank,
        "world": world,
        "schedule": schedule_name,
        "microbatches": microbatches,
        "max_grad_diff": grad_diff,
        "loss_diff": loss_diff,
        "events": events,
        "activation_bytes_per_microbatch": activation_bytes,
        "max_in_flight": max_in_flight(events, rank),
    }


if __name__ == "__main__":
    main()
