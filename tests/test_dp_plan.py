"""Data x pipeline parallelism as plain data: plans with replicas and batch shares, the
planner's choice of shape, scenarios that name a replica or a rank, the window and log
records of a replicated run, and bad input as one line before any process starts."""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest

from dynpipe.cli import main
from dynpipe.errors import UserError
from dynpipe.models import get_model
from dynpipe.planner import Plan, PlanError
from dynpipe.planner.costs import CostModel
from dynpipe.planner.shape import (
    choose_shape,
    evaluate_shape,
    reduce_tail_ms,
    ring_allreduce_ms,
)
from dynpipe.runtime.mesh import Mesh, check_dp

MLP = get_model("mlp", depth=6, width=32)  # 8 layers


def _one_line_error(capsys, argv: list[str], *needles: str) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, lines
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# ---- plans -------------------------------------------------------------------------------
def test_plan_with_replicas_round_trips_and_one_replica_writes_as_before() -> None:
    one = Plan.even(MLP, 2)
    assert "dp" not in one.to_dict() and "shares" not in one.to_dict()
    two = dataclasses.replace(one, dp=2, shares=(6, 2), dropped=(1,))
    back = Plan.from_json(two.to_json())
    assert back == two and back.dp == 2 and back.shares == (6, 2) and back.dropped == (1,)
    assert two.world_size == 4 and two.total_microbatches == 8
    assert two.replica_slice(0) == (0, 6) and two.replica_slice(1) == (6, 8)
    assert two.counted_microbatches == 6 and two.partial
    assert "dp=2 shares=6/2 dropped=[1]" in repr(two)
    even = dataclasses.replace(one, dp=2)
    assert even.replica_microbatches == (4, 4) and not even.partial


@pytest.mark.parametrize(
    "fields,needle",
    [
        ({"dp": 0}, "dp must be >= 1"),
        ({"dp": 2, "shares": (5, 2)}, "do not give 2 replicas 8 microbatches"),
        ({"dp": 2, "shares": (8, 0)}, ">= 1 per replica"),
        ({"dp": 2, "dropped": (2,)}, "not replicas 0–1"),
        ({"dp": 2, "dropped": (0, 1)}, "drops every replica"),
    ],
)
def test_bad_replica_fields_are_one_line_errors(fields, needle) -> None:
    with pytest.raises(PlanError, match=needle):
        dataclasses.replace(Plan.even(MLP, 2), **fields)


def test_world_size_must_be_stages_times_replicas() -> None:
    plan = dataclasses.replace(Plan.even(MLP, 2), dp=2)
    plan.validate(MLP, 4)
    with pytest.raises(PlanError, match=r"2 stages x 2 replicas = 4 ranks but the world has 3"):
        plan.validate(MLP, 3)


def test_mesh_arithmetic_and_dp_dividing_the_gpus() -> None:
    m = Mesh(dp=2, pp=3, rank=4)
    assert (m.replica, m.pp_rank) == (1, 1) and m.global_rank(2) == 5
    assert m.global_rank(0, replica=0) == 0 and m.replica_ranks(1) == [3, 4, 5]
    assert m.pp_group is None and m.dp_group is None  # no groups without a device mesh
    assert check_dp(2, world_size=4) == 2
    with pytest.raises(UserError, match=r"--dp 3 does not divide 4 workers.*--dp 1 or 2 or 4"):
        check_dp(3, world_size=4)


# ---- the command line: bad input before any process starts ---------------------------------
def test_dp_not_dividing_the_gpus(capsys) -> None:
    _one_line_error(capsys, ["train", "--nproc", "4", "--dp", "3"], "--dp 3", "4 workers")


def test_plan_whose_replicas_miss_a_layer(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json"
    stages = [{"start": 0, "stop": 3, "rank": 0}, {"start": 4, "stop": 10, "rank": 1}]
    bad.write_text(json.dumps({"model": "mlp", "num_layers": 10, "stages": stages, "dp": 2}))
    _one_line_error(
        capsys, ["train", "--plan", str(bad)], "misses layers 3", "each of its 2 replicas"
    )


def test_plan_with_replicas_on_the_wrong_world(tmp_path, capsys) -> None:
    plan = tmp_path / "p.json"
    dataclasses.replace(Plan.even(get_model("mlp"), 2), dp=2).save(plan)
    _one_line_error(
        capsys,
        ["train", "--plan", str(plan), "--nproc", "6"],
        "2 stages x 2 replicas = 4 ranks",
        "6 ranks",
        "--nproc 4",
    )


def test_batch_not_splitting_over_replicas(capsys) -> None:
    _one_line_error(
        capsys,
        ["train", "--nproc", "4", "--dp", "2", "--batch-size", "12", "--microbatches", "4"],
        "2 replicas x 4 microbatches = 8",
    )


# ---- the planner's shape -------------------------------------------------------------------
def test_ring_allreduce_and_the_reduce_tail() -> None:
    assert ring_allreduce_ms(1e9, replicas=1, bandwidth=1e9) == 0
    assert ring_allreduce_ms(1e9, replicas=4, bandwidth=1e9) == pytest.approx(1.5e3)
    costs = CostModel.from_model(MLP, microbatch_size=4, bandwidth=1e6)
    bounds = ((0, 4), (4, 8))
    assert reduce_tail_ms(costs, bounds=bounds, replicas=1) == 0

    def ring(a: int, b: int) -> float:  # two replicas: each sends and receives it all once
        return float(costs.param_bytes[a:b].sum()) / 1e6 * 1e3 + 2 * 0.02

    # Stage 0 finishes its backward last, so its reduce is all tail; stage 1's starts
    # earlier by stage 0's last backward and the gradient sent to it.
    lead = float(costs.bwd_ms[0, :4].sum()) + float(costs.out_bytes[3]) / 1e6 * 1e3 + 0.02
    want = max(ring(0, 4), ring(4, 8) - lead)
    assert reduce_tail_ms(costs, bounds=bounds, replicas=2) == pytest.approx(want)
    assert want > 0


def test_shape_split_is_the_best_of_every_split() -> None:
    costs = CostModel.from_model(MLP, microbatch_size=4, bandwidth=5e8).with_slowdown([1.0])
    rng = np.random.default_rng(0)
    costs = dataclasses.replace(costs, fwd_ms=costs.fwd_ms * rng.uniform(0.5, 3, (1, 8)))
    got = evaluate_shape(costs, dp=2, pp=3, microbatches=4)
    want = min(
        (
            evaluate_shape(costs, dp=2, pp=3, microbatches=4, max_exhaustive=0).step_ms,
            *[_step(costs, (0, a, b, 8)) for a, b in itertools.combinations(range(1, 8), 2)],
        )
    )
    assert got.step_ms == pytest.approx(want)
    assert got.candidates == 21 and got.fits


def _step(costs: CostModel, cuts: tuple[int, ...]) -> float:
    from dynpipe.planner.shape import _score

    pipe, tail, _, _ = _score(
        costs.for_devices(3),
        np.array([cuts]),
        replicas=2,
        schedule="1f1b",
        microbatches=4,
    )
    return float(pipe[0] + tail[0])


def test_choose_shape_ranks_every_shape_and_says_why_one_cannot_run() -> None:
    shapes = choose_shape(
        lambda mb: CostModel.from_model(MLP, microbatch_size=mb),
        gpus=4,
        batch_size=48,
        num_layers=len(MLP),
        microbatches=3,
    )
    assert {(c.dp, c.pp) for c in shapes} == {(4, 1), (2, 2), (1, 4)}
    runnable = [c for c in shapes if c.fits]
    assert {(c.dp, c.pp) for c in runnable} == {(4, 1), (2, 2)}
    assert runnable == sorted(runnable, key=lambda c: c.step_ms) and shapes[:2] == runnable
    (bad,) = [c for c in shapes if not c.fits]
    assert (bad.dp, bad.pp) == (1, 4) and "1F1B needs >= 4" in bad.note
    fits_memory = choose_shape(
        lambda mb: CostModel.from_model(MLP, microbatch_size=mb),
        gpus=2,
        batch_size=64,
        num_layers=len(MLP),
        memory_bytes=1.0,
    )
    assert not any(c.fits for c in fits_memory)


def test_plan_gpus_writes_the_chosen_shape(tmp_path, capsys) -> None:
    out = tmp_path / "p.json"
    argv = ["plan", "--model", "mlp", "--gpus", "4", "--batch-size", "64", "-o", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "dp x pp" in text and "4 x 1" in text and "2 x 2" in text and "1 x 4" in text
    plan = Plan.load(out)
    best = plan.meta["shapes"][0]
    assert plan.dp == best["dp"] and plan.num_stages == best["pp"]
    assert plan.dp * plan.num_stages == 4 and plan.meta["step_ms"] == best["step_ms"]
    plan.validate(get_model("mlp"), 4)


def test_plan_gpus_bad_input(capsys) -> None:
    _one_line_error(capsys, ["plan", "--model", "mlp"], "--stages S", "--gpus G", "neither")
    _one_line_error(capsys, ["plan", "--model", "mlp", "--stages", "2", "--gpus", "2"], "not both")
    _one_line_error(
        capsys, ["plan", "--model", "mlp", "--gpus", "4", "--slowdown", "1,2"], "--slowdown"
    )


# ---- scenarios -----------------------------------------------------------------------------
def test_scenario_names_a_replica_or_a_rank(tmp_path) -> None:
    from dynpipe.runtime.scenario import ScenarioRunner, load_scenario

    p = tmp_path / "s.toml"
    p.write_text(
        '[[events]]\nstep = 3\naction = "start"\nkind = "emulate"\nfactor = 2.0\nstage = 1\n'
        'replica = 1\n[[events]]\nstep = 5\naction = "start"\nkind = "emulate"\nrank = 0\n'
        '[[events]]\nstep = 7\naction = "stop"\nstage = 1\nreplica = 1\n'
    )
    sc = load_scenario(p, num_stages=2, dp=2)
    assert set(sc.active_at(5)) == {(1, 1), (-1, 0)} and set(sc.active_at(7)) == {(-1, 0)}

    class Timer:
        dilation = 1.0

    timer = Timer()
    runner = ScenarioRunner(sc, rank=3, target_ranks=[0, 1], device="cpu", timer=timer, dp=2)
    recs = runner.apply(3)
    assert recs[0]["rank"] == 3 and recs[0]["replica"] == 1 and timer.dilation == 2.0
    assert runner.apply(5)[0]["rank"] == 0 and timer.dilation == 2.0
    assert runner.apply(7)[0]["event"] == "interference_stop" and timer.dilation == 1.0
    with pytest.raises(UserError, match="replica 1 is not a replica"):
        load_scenario(p, num_stages=2, dp=1)
    p.write_text('[[events]]\nstep = 3\naction = "start"\nrank = 9\n')
    with pytest.raises(UserError, match="rank 9 is not a rank of this 4-rank run"):
        load_scenario(p, num_stages=2, dp=2)


# ---- the window and the log ----------------------------------------------------------------
def _record(step: int) -> dict:
    from dynpipe.runtime.records import ReplicaTiming, StageTiming, Step

    def stages(r: int) -> tuple:
        return tuple(
            StageTiming(stage=s, rank=2 * r + s, layers=b, fwd_ms=4.0 + r, bwd_ms=8.0, wait_ms=1)
            for s, b in enumerate(((0, 4), (4, 8)))
        )

    reps = tuple(
        ReplicaTiming(
            replica=r, microbatches=(6, 2)[r], compute_ms=12.0 + r, reduce_ms=r, stages=stages(r)
        )
        for r in (0, 1)
    )
    return Step(step=step, wall=0.1, step_ms=30.0, stages=reps[0].stages, replicas=reps).to_dict()


def test_window_of_a_replicated_run_holds_every_replica() -> None:
    from dynpipe.runtime.adapt.window import Window
    from dynpipe.runtime.records import Step

    recs = [_record(s) for s in range(3)]
    assert Step.from_dict(recs[0]).replicas[1].stages[1].rank == 3
    tel = [{"tel_util": float(r)} for r in range(4)]
    w = Window.from_records(
        recs,
        bounds=((0, 4), (4, 8)),
        ranks=(0, 1),
        microbatches=4,
        schedule="1f1b",
        telemetry=tel,
        memory_bytes=[1.0, 2.0, 3.0, 4.0],
        shares=(6, 2),
    )
    assert w.dp == 2 and w.shares == (6, 2) and list(w.step_ms) == [30.0] * 3
    one = w.replicas[1]
    assert one.microbatches == 2 and list(one.step_ms) == [13.0] * 3
    assert one.stage_fwd_ms[0].tolist() == [5.0, 5.0]
    assert one.telemetry == tuple(tel[2:]) and one.memory_bytes.tolist() == [3.0, 4.0]
    assert w.reduce_ms.tolist() == [[0.0, 1.0]] * 3
    # One replica: no replica fields, in the window or in the log.
    from dynpipe.runtime.records import Step as S

    plain = S(step=0, wall=0.0, step_ms=1.0).to_dict()
    assert "replicas" not in plain
