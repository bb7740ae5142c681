"""diff(old, new): the layers a repartition moves, as plain data."""

from __future__ import annotations

import numpy as np
import pytest

from dynpipe.models import get_model
from dynpipe.planner.costs import CostModel
from dynpipe.planner.diff import Transfer, diff, total_bytes
from dynpipe.planner.plan import Plan, PlanError


@pytest.fixture(scope="module")
def model():
    return get_model("mlp", depth=6)  # 8 layers


def test_only_layers_that_change_owner_move(model) -> None:
    old = Plan.from_bounds(model, [4, 4])
    new = Plan.from_bounds(model, [2, 6])
    moves = diff(old, new)
    assert moves == [Transfer(2, "fc01", 0, 1), Transfer(3, "fc02", 0, 1)]
    assert repr(moves[0]) == "fc01#2:r0->r1"
    assert diff(old, old) == []
    back = diff(new, old)
    assert [(t.layer, t.src, t.dst) for t in back] == [(2, 1, 0), (3, 1, 0)]


def test_rank_changes_move_layers_even_with_the_same_bounds(model) -> None:
    old = Plan.from_bounds(model, [3, 3, 2])
    swapped = old.with_ranks([0, 2, 1])
    moves = diff(old, swapped)
    assert [(t.layer, t.src, t.dst) for t in moves] == [
        (3, 1, 2),
        (4, 1, 2),
        (5, 1, 2),
        (6, 2, 1),
        (7, 2, 1),
    ]


def test_bytes_from_param_sizes_or_a_cost_model(model) -> None:
    old = Plan.from_bounds(model, [4, 4])
    new = Plan.from_bounds(model, [5, 3])
    sizes = [10, 20, 30, 40, 50, 60, 70, 80]
    moves = diff(old, new, param_bytes=sizes)
    assert moves == [Transfer(4, "fc03", 1, 0, 50)] and total_bytes(moves) == 50
    assert repr(moves[0]) == "fc03#4:r1->r0 50B"
    cm = CostModel(
        model="mlp",
        layer_names=tuple(model.layer_names),
        fwd_ms=np.ones((1, 8)),
        bwd_ms=np.ones((1, 8)),
        param_bytes=np.array(sizes, float),
        out_bytes=np.ones(8),
        act_bytes=np.zeros(8),
        opt_mult=np.full(8, 2.0),
        buffer_bytes=np.full(8, 1.0),
        bandwidth=[],
        latency_ms=[],
    )
    # Parameters, two Adam moments and buffers move; gradients do not.
    assert diff(old, new, costs=cm)[0].nbytes == 50 * 3 + 1
    with pytest.raises(PlanError, match="no sizes"):
        total_bytes(diff(old, new))
    with pytest.raises(PlanError, match="3 parameter sizes for 8 layers"):
        diff(old, new, param_bytes=[1, 2, 3])


def test_plans_of_different_models_cannot_be_diffed(model) -> None:
    other = get_model("mlp", depth=7)
    with pytest.raises(PlanError, match="same model"):
        diff(Plan.from_bounds(model, [4, 4]), Plan.from_bounds(other, [4, 5]))


def test_names_fall_back_when_plans_carry_none() -> None:
    from dynpipe.planner.plan import StagePlan

    a = Plan(model="m", num_layers=3, stages=(StagePlan(0, 2, 0), StagePlan(2, 3, 1)))
    b = Plan(model="m", num_layers=3, stages=(StagePlan(0, 1, 0), StagePlan(1, 3, 1)))
    assert diff(a, b) == [Transfer(1, "layer1", 0, 1)]
