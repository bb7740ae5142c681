"""Virtual stages in the plan: placement, JSON, and one-line errors (no process group)."""

from __future__ import annotations

import pytest

from dynpipe.models import get_model
from dynpipe.planner.plan import Plan, PlanError, microbatch_problem, schedule_ranks


@pytest.fixture
def model():
    return get_model("mlp", depth=6, width=16)  # 8 layers


def test_placement_follows_torch() -> None:
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for pp in (1, 2, 3, 4):
        for v in (1, 2, 3):
            loop = generate_stage_to_rank_mapping(pp, pp * v)
            assert schedule_ranks("interleaved-1f1b", pp=pp, chunks=v) == [
                loop[s] for s in range(pp * v)
            ]
            vee = generate_stage_to_rank_mapping(pp, pp * v, style="v")
            assert schedule_ranks("zbv", pp=pp, chunks=v) == [vee[s] for s in range(pp * v)]


def test_virtual_stage_plan_views_and_json(model) -> None:
    plan = Plan.even(model, 2, schedule="zbv", chunks=2)
    assert plan.num_stages == 4 and plan.pp == 2 and plan.world_size == 2
    assert plan.ranks == [0, 1, 1, 0]
    assert plan.stages_of_rank(0) == [0, 3] and plan.layers_of_rank(1) == [2, 3, 4, 5]
    assert plan.owner(7) == 0 and plan.validate(model, 2) is plan
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.chunks == 2
    assert "chunks" not in Plan.even(model, 2).to_dict()  # one-stage plans read as before


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"schedule": "1f1b", "chunks": 2}, "runs one stage per rank"),
        ({"schedule": "zbv", "chunks": 3}, "needs exactly 2 virtual stages per rank"),
        ({"schedule": "interleaved-1f1b", "chunks": 0}, "must be >= 1"),
    ],
)
def test_bad_chunks_are_one_line(model, kwargs, match) -> None:
    with pytest.raises(PlanError, match=match) as err:
        Plan.even(model, 2, **kwargs)
    assert "\n" not in str(err.value)


def test_layer_count_that_cannot_be_split(model) -> None:
    with pytest.raises(PlanError, match=r"8 layers\) into 3 ranks x 3 virtual stages") as err:
        Plan.even(model, 3, schedule="interleaved-1f1b", chunks=3)
    assert "\n" not in str(err.value) and "at most 2 ranks" in str(err.value)
    with pytest.raises(PlanError, match="cannot be shared out"):
        Plan.from_bounds(model, [3, 3, 2], schedule="interleaved-1f1b", chunks=2)


def test_misplaced_stage_names_the_placement(model) -> None:
    with pytest.raises(PlanError, match=r"stage 2 sits on rank 0 but zbv .* places it on rank 1"):
        Plan.from_bounds(model, [2, 2, 2, 2], schedule="zbv", chunks=2, ranks=[0, 1, 0, 1])


def test_virtual_stages_refuse_replicas_and_idle_ranks(model) -> None:
    plan = Plan.even(model, 2, schedule="interleaved-1f1b", chunks=2)
    with pytest.raises(PlanError, match="runs one pipeline only"):
        Plan(**{**plan.__dict__, "dp": 2})
    with pytest.raises(PlanError, match="world has 3 ranks"):
        plan.validate(model, 3, elastic=True)


def test_microbatch_needs_are_one_line() -> None:
    assert microbatch_problem("interleaved-1f1b", pp=2, chunks=2, microbatches=4) is None
    assert microbatch_problem("zb", pp=4, chunks=2, microbatches=10) is None  # 2 rounds of 5
    msg = microbatch_problem("interleaved-1f1b", pp=4, chunks=2, microbatches=9)
    assert msg and "rounds" in msg and "--microbatches 8 or 12" in msg
    msg = microbatch_problem("dualpipev", pp=2, chunks=2, microbatches=3)
    assert msg and "3 < 4" in msg and "--microbatches 4" in msg
    assert microbatch_problem("1f1b", pp=4, chunks=1, microbatches=2)
    for m in (msg,):
        assert "\n" not in m


def test_engine_refuses_too_few_microbatches(model) -> None:
    from dynpipe.errors import UserError
    from dynpipe.runtime.engine import check_batch

    plan = Plan.even(model, 2, schedule="dualpipev", chunks=2, microbatches=2)
    with pytest.raises(UserError, match="dualpipev needs at least as many microbatches"):
        check_batch(plan, 8)


def test_plan_cli_refusals_are_one_line(capsys) -> None:
    from dynpipe.cli import main

    for argv, match in (
        (["--gpus", "4", "--schedule", "zb"], "runs one pipeline: plan it with --stages"),
        (["--stages", "4", "--schedule", "dualpipev", "--microbatches", "4"], "4 < 8"),
        (["--stages", "6", "--schedule", "zbv", "--microbatches", "8"], "at most 4 ranks"),
    ):
        assert main(["plan", "--model", "mlp", "--set", "depth=6", *argv]) != 0
        err = capsys.readouterr().err.strip()
        assert match in err and "\n" not in err, err
