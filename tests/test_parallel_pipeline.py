"""Pipeline parallelism: stages compose to the full model, both schedules match it on 2 gloo ranks,
and the recorded timelines have the shape of their schedule."""

from pathlib import Path

import pytest
import torch

from labkit.models import tiny_llama
from labkit.parallel import launch, pipeline
from tests.numerics import FLOAT64

SCRIPT = Path(__file__).parents[1] / "labs" / "scripts" / "pipeline_run.py"


def test_bubble_formula():
    assert pipeline.bubble_formula(1, 8) == 0
    assert pipeline.bubble_formula(2, 1) == 0.5
    assert pipeline.bubble_formula(4, 8) == pytest.approx(3 / 11)
    with pytest.raises(ValueError):
        pipeline.bubble_formula(2, 0)


def test_layer_ranges_cover_every_layer_once():
    ranges = pipeline.layer_ranges(30, 4)
    assert ranges[0][0] == 0 and ranges[-1][1] == 30
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= 1
    with pytest.raises(ValueError, match="cannot split"):
        pipeline.layer_ranges(2, 3)


def test_stages_chained_equal_the_whole_model():
    model = tiny_llama(num_layers=3, tie_word_embeddings=False).double()  # two code paths: compared in float64
    x = torch.randint(0, 512, (2, 12))
    h = x
    for s in range(3):
        h = pipeline.LlamaStage(model, s, 3)(h)
    assert h.dtype == torch.float64
    torch.testing.assert_close(h, model(input_ids=x).logits, **FLOAT64)
    with pytest.raises(ValueError, match="tied"):
        pipeline.LlamaStage(tiny_llama(), 0, 2)


def test_in_flight_counts_finished_forwards_minus_finished_backwards():
    def ev(kind, m, t):
        return {"rank": 0, "kind": kind, "microbatch": m, "start": t - 0.5, "end": t}

    gpipe = [ev("F", 0, 1), ev("F", 1, 2), ev("F", 2, 3), ev("B", 0, 4), ev("B", 1, 5), ev("B", 2, 6)]
    one_f_one_b = [ev("F", 0, 1), ev("F", 1, 2), ev("B", 0, 3), ev("F", 2, 4), ev("B", 1, 5), ev("B", 2, 6)]
    assert pipeline.max_in_flight(gpipe, 0) == 3 and pipeline.max_in_flight(one_f_one_b, 0) == 2


def test_saved_activation_bytes_grow_with_the_batch():
    stage = pipeline.LlamaStage(tiny_llama(num_layers=2, tie_word_embeddings=False), 0, 2)
    one = pipeline.saved_activation_bytes(stage, torch.randint(0, 512, (1, 16)))
    two = pipeline.saved_activation_bytes(stage, torch.randint(0, 512, (2, 16)))
    assert one > 0 and 1.8 < two / one < 2.2


def test_bubble_fraction_of_a_known_timeline():
    events = [
        {"rank": 0, "kind": "F", "microbatch": 0, "start": 0.0, "end": 1.0},
        {"rank": 1, "kind": "F", "microbatch": 0, "start": 1.0, "end": 2.0},
    ]
    assert pipeline.bubble_fraction(events) == 0.5  # each rank busy 1 of 2 time units


@pytest.fixture(scope="module")
def both_schedules():
    """Both schedules at 4 micro-batches, in one launch: {schedule: [rank 0's result, rank 1's]}."""
    per_rank = launch.launch(SCRIPT, nproc=2, args=["--runs", "gpipe:4", "1f1b:4"], echo=None, timeout=240)
    return {s: [rank["runs"][i] for rank in per_rank] for i, s in enumerate(("gpipe", "1f1b"))}


@pytest.fixture(params=["gpipe", "1f1b"])
def run(request, both_schedules):
    return request.param, both_schedules[request.param]


def test_schedule_matches_the_unsplit_model(run):
    _, res = run
    assert all(r["max_grad_diff"] < 1e-6 for r in res)
    assert res[-1]["loss_diff"] < 1e-5  # the last stage computes the loss


def test_timeline_has_the_shape_of_the_schedule(run):
    schedule, res = run
    for r in res:
        assert sorted((e["kind"], e["microbatch"]) for e in r["events"]) == sorted(
            (k, m) for k in "FB" for m in range(4)
        )
    first = sorted(res[0]["events"], key=lambda e: e["start"])
    kinds = "".join(e["kind"] for e in first)
    for r in res:  # what torch ran is what schedule_order says
        assert pipeline.executed_order(r["events"], r["rank"]) == pipeline.schedule_order(schedule, r["rank"], 2, 4)
    if schedule == "gpipe":
        assert kinds == "FFFFBBBB"  # all forwards, then all backwards
    else:
        assert kinds.index("B") < kinds.rindex("F")  # 1F1B interleaves: a backward before the last forward
    in_flight = pipeline.max_in_flight(res[0]["events"], 0)
    assert in_flight == (4 if schedule == "gpipe" else 2)  # GPipe holds m micro-batches, 1F1B about p
    fig = pipeline.plot_timeline([e for r in res for e in r["events"]])
    assert len(fig.axes[0].patches) == 16


@pytest.mark.parametrize("stages,m", [(2, 4), (4, 4), (4, 8), (3, 2)])
def test_1f1b_order_runs_every_microbatch_once_and_holds_at_most_warmup_in_flight(stages, m):
    for stage in range(stages):
        order = pipeline.schedule_order("1f1b", stage, stages, m)
        assert sorted(order) == sorted((k, i) for k in "FB" for i in range(m))
        held = peak = 0
        for kind, i in order:
            assert kind == "F" or ("F", i) in order[: order.index((kind, i))]  # backward after its forward
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        assert peak == min(m, stages - stage)
    assert pipeline.schedule_order("1f1b", 0, 2, 4) == [
        ("F", 0),
        ("F", 1),
        ("B", 0),
        ("F", 2),
        ("B", 1),
        ("F", 3),
        ("B", 2),
        ("B", 3),
    ]
    assert pipeline.schedule_order("gpipe", 1, 2, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def test_schedule_order_refuses_bad_arguments():
    with pytest.raises(ValueError, match="schedule must be one of"):
        pipeline.schedule_order("zero-bubble", 0, 2, 4)
    with pytest.raises(ValueError, match="0 <= stage < stages"):
        pipeline.schedule_order("1f1b", 2, 2, 4)


def test_1f1b_with_too_few_microbatches_is_refused():
    with pytest.raises(launch.RankError, match="at least as many micro-batches as stages"):
        launch.launch(SCRIPT, nproc=2, args=["--runs", "gpipe:1", "1f1b:1"], echo=None, timeout=120)
