"""The Plan type: JSON round-trip, structural checks, validation against model and world."""

from __future__ import annotations

import json
import warnings

import pytest

from dynpipe.models import get_model
from dynpipe.planner.plan import PLAN_VERSION, Plan, PlanError, StagePlan


@pytest.fixture(scope="module")
def model():
    return get_model("mlp", depth=6)  # 8 layers: inp, fc00..fc05, head


def test_json_round_trip_keeps_everything(model, tmp_path) -> None:
    plan = Plan.from_bounds(
        model,
        [3, 3, 2],
        ranks=[2, 0, 1],
        schedule="gpipe",
        microbatches=6,
        meta={"method": "test", "step_ms": 1.5},
    )
    plan = plan.__class__(
        **{
            **plan.__dict__,
            "stages": tuple(
                StagePlan(
                    **{
                        **st.__dict__,
                        "fwd_ms": 0.5,
                        "bwd_ms": 1.0,
                        "mem_bytes": 123,
                        "comm_ms": 0.01 if i < 2 else None,
                        "send_bytes": 64 if i < 2 else None,
                    }
                )
                for i, st in enumerate(plan.stages)
            ),
        }
    )
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.meta == plan.meta
    assert again.stages[0].layers == ("inp", "fc00", "fc01") and again.stages[1].comm_ms == 0.01
    assert Plan.load(plan.save(tmp_path / "p.json")) == plan
    d = json.loads(plan.to_json())
    assert d["version"] == PLAN_VERSION and d["stages"][0]["rank"] == 2
    # A plan written before the predicted fields existed still loads.
    for st in d["stages"]:
        del st["comm_ms"], st["send_bytes"]
    assert Plan.from_dict(d).bounds == plan.bounds


def test_views(model) -> None:
    plan = Plan.from_bounds(model, [(0, 2), (2, 7), (7, 8)], ranks=[1, 2, 0])
    assert plan.bounds == [(0, 2), (2, 7), (7, 8)] and plan.ranks == [1, 2, 0]
    assert plan.stage_of_rank(2) == 1 and plan.stage_of_rank(5) is None
    assert plan.owner(7) == 0 and plan.owner(3) == 2 and plan.stage_of_layer(1) == 0
    assert repr(plan) == "Plan(mlp L=8 1f1b mb=4: [0:2)@r1 [2:7)@r2 [7:8)@r0)"
    assert Plan.even(model, 3).bounds == [(0, 3), (3, 6), (6, 8)]


@pytest.mark.parametrize(
    ("stages", "pattern"),
    [
        ([(0, 3), (4, 8)], r"misses layers 3–3 before stage 1"),
        ([(0, 3), (2, 8)], r"repeats layers 2–2 before stage 1"),
        ([(0, 3), (3, 7)], r"covers layers 0–6 but mlp has 8"),
        ([(0, 3), (3, 3), (3, 8)], r"stage 1 holds no layers"),
        ([(1, 8)], r"misses layers 0–0 before stage 0"),
    ],
)
def test_missing_or_repeated_layers_are_refused(stages, pattern) -> None:
    with pytest.raises(PlanError, match=pattern):
        Plan(
            model="mlp",
            num_layers=8,
            stages=tuple(StagePlan(a, b, r) for r, (a, b) in enumerate(stages)),
        )


def test_structural_errors() -> None:
    with pytest.raises(PlanError, match="3 stages but mlp has only 2 layers"):
        Plan(
            model="mlp",
            num_layers=2,
            stages=(StagePlan(0, 1, 0), StagePlan(1, 2, 1), StagePlan(2, 2, 2)),
        )
    with pytest.raises(PlanError, match="two stages on one rank"):
        Plan(model="m", num_layers=2, stages=(StagePlan(0, 1, 0), StagePlan(1, 2, 0)))
    with pytest.raises(PlanError, match="unknown schedule"):
        Plan(model="m", num_layers=1, stages=(StagePlan(0, 1, 0),), schedule="pipedream")
    with pytest.raises(PlanError, match="version 9"):
        Plan(model="m", num_layers=1, stages=(StagePlan(0, 1, 0),), version=9)
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{")
    with pytest.raises(PlanError, match="malformed plan"):
        Plan.from_dict({"model": "m", "num_layers": 1, "stages": [{"start": 0}]})
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load("/nonexistent/plan.json")


def test_validate_against_model_and_world(model) -> None:
    plan = Plan.from_bounds(model, [4, 4], microbatches=4)
    assert plan.validate(model, world_size=2) is plan
    with pytest.raises(PlanError, match="2 stages but the world has 3 ranks"):
        plan.validate(model, world_size=3)
    with pytest.raises(PlanError, match="is for model 'mlp' but the model is 'gpt'"):
        plan.validate(get_model("gpt", depth=6), world_size=2)
    with pytest.raises(PlanError, match="covers layers 0–7 but mlp has 10"):
        plan.validate(get_model("mlp", depth=8), world_size=2)
    outside = Plan.from_bounds(model, [4, 4], ranks=[0, 5])
    with pytest.raises(PlanError, match=r"ranks \[5\] outside 0–1"):
        outside.validate(model, world_size=2)
    renamed = Plan.from_dict(
        {
            **plan.to_dict(),
            "stages": [
                {**plan.to_dict()["stages"][0], "layers": ["a", "b", "c", "d"]},
                plan.to_dict()["stages"][1],
            ],
        }
    )
    with pytest.raises(PlanError, match="stage 0 names layers"):
        renamed.validate(model)
    stale = Plan.from_dict({**plan.to_dict(), "model_fingerprint": "deadbeef"})
    with pytest.raises(PlanError, match="fingerprint deadbeef"):
        stale.validate(model)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        Plan.from_bounds(model, [4, 4], microbatches=1).validate(model)
    assert any("1 microbatches for 2 stages" in str(x.message) for x in w)
