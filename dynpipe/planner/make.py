"""From costs to a ``Plan`` carrying its own predictions.

``make_plan`` runs the DP; ``baseline_plan`` builds the reference splits; ``annotate`` fills
any partition's per-stage predictions (times, transfer, memory) and its simulated step, so
every plan — ours or a baseline — is described and compared the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dynpipe.planner.baselines import baseline_bounds
from dynpipe.planner.costs import CostModel
from dynpipe.planner.dp import memory_limits, plan_partition
from dynpipe.planner.evaluate import stage_costs
from dynpipe.planner.plan import Plan, PlanError, StagePlan
from dynpipe.planner.simulate import simulate

__all__ = ["annotate", "baseline_plan", "make_plan"]


def _cost_meta(costs: CostModel) -> dict[str, Any]:
    keep = {k: v for k, v in costs.meta.items() if isinstance(v, str | int | float | list | None)}
    return {**keep, "microbatch_size": costs.microbatch_size}


def annotate(
    costs: CostModel,
    bounds: Sequence[tuple[int, int]],
    *,
    schedule: str = "1f1b",
    microbatches: int = 4,
    ranks: Sequence[int] | None = None,
    method: str = "given",
    memory_bytes: float | Sequence[float] | None = None,
    meta: dict[str, Any] | None = None,
) -> Plan:
    """A ``Plan`` of ``bounds`` with per-stage predictions and the simulated step in ``meta``."""
    n = len(bounds)
    ranks = list(range(n)) if ranks is None else list(ranks)
    if len(ranks) != n:
        raise PlanError(f"{n} stages but {len(ranks)} ranks given; give one each")
    sc = stage_costs(
        costs, bounds, schedule=schedule, microbatches=microbatches, memory_bytes=memory_bytes
    )
    sim = simulate(
        sc.fwd_ms, sc.bwd_ms, comm_ms=sc.comm_ms, schedule=schedule, microbatches=microbatches
    )
    names = costs.layer_names
    stages = tuple(
        StagePlan(
            start=a,
            stop=b,
            rank=int(r),
            layers=tuple(names[a:b]),
            fwd_ms=round(sc.fwd_ms[s], 6),
            bwd_ms=round(sc.bwd_ms[s], 6),
            mem_bytes=int(sc.mem_bytes[s]),
            comm_ms=round(sc.comm_ms[s], 6) if s < n - 1 else None,
            send_bytes=int(sc.send_bytes[s]) if s < n - 1 else None,
            recompute=tuple(names[i] for i in sc.recompute[s]) if sc.recompute else (),
        )
        for s, ((a, b), r) in enumerate(zip(sc.bounds, ranks, strict=True))
    )
    loads = sc.load_ms
    link = max(sc.comm_ms, default=0.0)
    on_link = link > max(loads)
    lim = memory_limits(memory_bytes, n)
    info: dict[str, Any] = {
        "method": method,
        "step_ms": round(sim.step_ms, 6),
        "bubble": round(sim.bubble, 6),
        "bottleneck_stage": int(np.argmax(sc.comm_ms) if on_link else np.argmax(loads)),
        "bottleneck_kind": "link" if on_link else "compute",
        "bottleneck_ms": round(sc.bottleneck_ms, 6),
        "busy_ms": [round(b, 6) for b in sim.busy_ms],
        "fits_memory": bool(np.all(np.asarray(sc.mem_bytes) <= lim)),
        "memory_limit_bytes": None if not np.isfinite(lim).any() else [float(x) for x in lim],
        "costs": _cost_meta(costs),
        # Predicted peak bytes per stage (what ``torch.cuda.max_memory_allocated`` measures).
        "peak_bytes": [int(x) for x in sc.mem_bytes],
        "recompute_mode": costs.recompute,
        **(meta or {}),
    }
    return Plan(
        model=costs.model,
        num_layers=costs.num_layers,
        stages=stages,
        schedule=schedule,
        microbatches=microbatches,
        model_fingerprint=costs.fingerprint,
        meta=info,
    )


def make_plan(
    costs: CostModel,
    *,
    num_stages: int,
    schedule: str = "1f1b",
    microbatches: int = 4,
    memory_bytes: float | Sequence[float] | None = None,
    current: Plan | None = None,
    migration_ms_per_byte: float = 0.0,
    ranks: Sequence[int] | None = None,
    **solver: Any,
) -> Plan:
    """The step-time-optimal plan for ``costs`` (see ``plan_partition``)."""
    res = plan_partition(
        costs,
        num_stages=num_stages,
        schedule=schedule,
        microbatches=microbatches,
        memory_bytes=memory_bytes,
        current=current,
        migration_ms_per_byte=migration_ms_per_byte,
        ranks=ranks,
        **solver,
    )
    extra: dict[str, Any] = {
        "optimal_bottleneck_ms": round(res.optimal_bottleneck_ms, 6),
        "candidates": res.candidates,
        "exhaustive": res.exhaustive,
        "planner_ms": round(res.solve_ms, 3),
    }
    if current is not None and migration_ms_per_byte > 0:
        extra.update(
            migration_bytes=res.migration_bytes,
            migration_ms=round(res.migration_ms, 6),
            migration_ms_per_byte=migration_ms_per_byte,
        )
    return annotate(
        costs,
        res.bounds,
        schedule=schedule,
        microbatches=microbatches,
        ranks=ranks,
        method="dp",
        memory_bytes=memory_bytes,
        meta=extra,
    )


def baseline_plan(
    costs: CostModel,
    method: str,
    *,
    num_stages: int,
    schedule: str = "1f1b",
    microbatches: int = 4,
    ranks: Sequence[int] | None = None,
    memory_bytes: float | Sequence[float] | None = None,
) -> Plan:
    """The ``even`` or ``parameters`` split of ``costs``'s model, annotated like ours."""
    bounds = baseline_bounds(method, param_bytes=costs.param_bytes, num_stages=num_stages)
    return annotate(
        costs,
        bounds,
        schedule=schedule,
        microbatches=microbatches,
        ranks=ranks,
        method=method,
        memory_bytes=memory_bytes,
    )
