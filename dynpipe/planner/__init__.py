"""Partition planning: the ``Plan`` type, costs, the exact DP, the schedule simulator.

    costs = CostModel.from_model(get_model("gpt"), microbatch_size=8, num_devices=4)
    plan = make_plan(costs.with_slowdown([1, 1, 2.4, 1]), num_stages=4, microbatches=8)
    moves = diff(old_plan, plan, costs=costs)   # what a repartition would move

Names other than the ``Plan`` types are imported lazily so importing the package (as the
runtime does for ``Plan``) does not pull in numpy-heavy planning code.
"""

from __future__ import annotations

import importlib
from typing import Any

from dynpipe.planner.plan import PLAN_VERSION, SCHEDULES, Plan, PlanError, StagePlan

__all__ = [
    "PLAN_VERSION",
    "SCHEDULES",
    "CostModel",
    "PartitionResult",
    "Plan",
    "PlanError",
    "SimResult",
    "StagePlan",
    "Transfer",
    "annotate",
    "baseline_plan",
    "diff",
    "format_plan",
    "make_plan",
    "plan_partition",
    "simulate",
    "simulate_plan",
    "solve_bottleneck",
    "stage_costs",
    "step_times",
]

_WHERE = {
    "CostModel": "costs",
    "PartitionResult": "dp",
    "plan_partition": "dp",
    "solve_bottleneck": "dp",
    "SimResult": "simulate",
    "simulate": "simulate",
    "simulate_plan": "simulate",
    "step_times": "simulate",
    "Transfer": "diff",
    "diff": "diff",
    "annotate": "make",
    "baseline_plan": "make",
    "make_plan": "make",
    "format_plan": "report",
    "stage_costs": "evaluate",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"dynpipe.planner.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'dynpipe.planner' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
