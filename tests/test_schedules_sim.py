"""The schedule simulator over torch's own action lists (no process group)."""

from __future__ import annotations

import pytest

from dynpipe.planner.multisim import rank_orders, simulate_schedule
from dynpipe.planner.plan import PlanError
from dynpipe.planner.simulate import simulate


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_stage_schedules_match_the_recurrence(schedule: str) -> None:
    fwd, bwd = [1.0, 2.0, 1.5], [2.0, 3.0, 2.5]
    got = simulate_schedule(fwd, bwd, schedule=schedule, microbatches=5)
    want = simulate(fwd, bwd, schedule=schedule, microbatches=5)
    assert got.step_ms == pytest.approx(want.step_ms)


@pytest.mark.parametrize(
    ("schedule", "chunks"), [("interleaved-1f1b", 2), ("zb", 2), ("zbv", 2), ("dualpipev", 2)]
)
def test_every_action_runs_once_and_in_dependency_order(schedule: str, chunks: int) -> None:
    pp, m = 3, 6
    orders = rank_orders(schedule, pp=pp, chunks=chunks, microbatches=m)
    n = pp * chunks
    fwd = [1.0 + 0.1 * s for s in range(n)]
    bwd = [2.0 * f for f in fwd]
    res = simulate_schedule(fwd, bwd, schedule=schedule, microbatches=m, chunks=chunks)
    fwds = {(e.stage, e.mb): e for e in res.events if e.kind == "F"}
    assert len(fwds) == n * m
    for (s, mb), e in fwds.items():
        if s > 0:
            assert e.start >= fwds[(s - 1, mb)].end
    # Work is conserved: every rank is busy for its stages' forward and backward times.
    assert sum(res.busy_ms) == pytest.approx(m * (sum(fwd) + sum(bwd)))
    assert res.step_ms >= max(res.busy_ms)
    assert sum(len(o) for o in orders) >= 2 * n * m


def test_virtual_stages_shrink_the_bubble() -> None:
    # The same 8 equal layers on 4 ranks: one stage of 2 each, or two of 1 each.
    one = simulate_schedule([2.0] * 4, [4.0] * 4, schedule="1f1b", microbatches=4)
    two = simulate_schedule(
        [1.0] * 8, [2.0] * 8, schedule="interleaved-1f1b", microbatches=4, chunks=2
    )
    assert two.step_ms < one.step_ms and two.bubble < one.bubble


def test_zero_bubble_fills_a_slow_stage_with_weight_work() -> None:
    fwd = [1.0] * 8
    bwd = [2.0] * 8
    fwd[3], bwd[3] = 3.0, 6.0  # one slow virtual stage
    inter = simulate_schedule(fwd, bwd, schedule="interleaved-1f1b", microbatches=8, chunks=2)
    zb = simulate_schedule(fwd, bwd, schedule="zb", microbatches=8, chunks=2)
    assert zb.step_ms <= inter.step_ms


def test_bad_input_is_one_line() -> None:
    with pytest.raises(PlanError, match="dualpipev needs at least as many microbatches") as e:
        simulate_schedule([1.0] * 4, [1.0] * 4, schedule="dualpipev", microbatches=2, chunks=2)
    assert "\n" not in str(e.value)
    with pytest.raises(PlanError, match="runs one stage per rank"):
        rank_orders("1f1b", pp=2, chunks=2, microbatches=4)


def _costs(slow: float = 1.0):
    from dynpipe.models import get_model
    from dynpipe.planner.costs import CostModel

    model = get_model("mlp", depth=10, width=64)  # 12 layers
    cm = CostModel.from_model(model, microbatch_size=8).for_devices(3)
    return cm.with_slowdown([1.0, slow, 1.0])


def test_virtual_plan_is_valid_and_no_worse_than_its_dp_split() -> None:
    from dynpipe.models import get_model
    from dynpipe.planner.multisim import schedule_step_ms
    from dynpipe.planner.virtual import make_virtual_plan

    model = get_model("mlp", depth=10, width=64)
    cm = _costs(slow=3.0)
    for schedule in ("interleaved-1f1b", "zb", "zbv", "dualpipev"):
        plan = make_virtual_plan(cm, pp=3, chunks=2, schedule=schedule, microbatches=6)
        plan.validate(model, 3)
        dp = [tuple(b) for b in plan.meta["dp_bounds"]]
        kw = {"schedule": schedule, "microbatches": 6, "chunks": 2}
        assert plan.meta["step_ms"] <= schedule_step_ms(cm, dp, **kw) + 1e-5
        assert plan.meta["step_ms"] == pytest.approx(
            schedule_step_ms(cm, plan.bounds, **kw), abs=1e-5
        )
        # The slowed rank 1 gets fewer layers than either clean rank.
        held = [len(plan.layers_of_rank(r)) for r in range(3)]
        assert held[1] < min(held[0], held[2]), (schedule, held)


def test_plan_cli_prints_every_schedule(capsys) -> None:
    from dynpipe.cli import main

    assert main(["plan", "--model", "mlp", "--stages", "2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    table = out.split("predicted step time per schedule")[1]
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "zb", "zbv", "dualpipev"):
        assert f"\n{schedule} " in table
    assert "<- fastest" in table


def test_recorded_cpu_run_is_predicted_within_ten_percent() -> None:
    """The simulator against the committed raw log of bench/schedules_cpu.py (4 ranks,
    clean and one rank slowed), and the docs table is the one the log gives."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("tbl", root / "bench/schedules_table.py")
    tbl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tbl)
    text, rows = tbl.table(root / "bench/results/schedules-cpu.jsonl")
    assert {r["schedule"] for r in rows} == {
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "zb",
        "zbv",
        "dualpipev",
    }
    for r in rows:
        for cond in ("clean", "slowed"):
            assert abs(r[cond][2]) <= 0.10, (r["schedule"], cond, r[cond])
        assert r["slowed"][0] > 1.3 * r["clean"][0]  # the slowdown is visible
    assert text in (root / "docs/schedules.md").read_text()
