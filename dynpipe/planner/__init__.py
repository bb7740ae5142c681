"""Partition planning: the ``Plan`` type, the exact DP, the schedule simulator."""

from __future__ import annotations

from dynpipe.planner.plan import PLAN_VERSION, SCHEDULES, Plan, PlanError, StagePlan

__all__ = ["PLAN_VERSION", "SCHEDULES", "Plan", "PlanError", "StagePlan"]
