"""Plans of virtual stages: ``pp`` ranks holding ``chunks`` contiguous stages each.

The min-max DP (``dynpipe.planner.dp``) splits the layers into ``pp * chunks`` stages on a
cost model whose device ``s`` is the rank that runs stage ``s`` under the schedule's
placement (``schedule_ranks``): balanced virtual stages are the schedule's premise. The DP's
split is then refined against the schedule simulator (``multisim``): each boundary moves one
layer either way while the simulated step time falls, since a rank's load is the sum of its
chunks and a V-shaped rank holds both ends of the pipeline.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from dynpipe.planner.costs import CostModel
from dynpipe.planner.dp import plan_partition
from dynpipe.planner.multisim import schedule_sim, schedule_step_ms, steady_2bw_step_ms
from dynpipe.planner.plan import MULTI_SCHEDULES, Plan, PlanError, StagePlan, schedule_ranks

__all__ = ["expand_costs", "make_virtual_plan", "schedule_table"]

# Bytes/s of a hand-over between two stages of one rank (no wire): free at any size.
_SAME_RANK = 1e30


def expand_costs(costs: CostModel, *, owner: Sequence[int]) -> CostModel:
    """``costs`` with one device per virtual stage: device ``s`` is rank ``owner[s]``'s
    device; two consecutive stages on one rank hand over for free."""
    pp = max(owner) + 1
    cm = costs.for_devices(pp)
    rows = np.asarray(owner)
    bw, lat = [], []
    for a, b in itertools.pairwise(owner):
        if a == b:
            bw.append(_SAME_RANK)
            lat.append(0.0)
        else:
            link = min(a, b) if abs(a - b) == 1 else 0
            bw.append(float(cm.bandwidth[link]))
            lat.append(float(cm.latency_ms[link]))

    def pick(x: np.ndarray | None) -> np.ndarray | None:
        return None if x is None else x[rows]

    return replace(
        cm,
        fwd_ms=cm.fwd_ms[rows],
        bwd_ms=cm.bwd_ms[rows],
        stage_fwd_ms=cm.stage_fwd_ms[rows],
        stage_bwd_ms=cm.stage_bwd_ms[rows],
        host_fwd_ms=pick(cm.host_fwd_ms),
        host_bwd_ms=pick(cm.host_bwd_ms),
        bandwidth=np.asarray(bw, dtype=np.float64),
        latency_ms=np.asarray(lat, dtype=np.float64),
    )


def make_virtual_plan(
    costs: CostModel,
    *,
    pp: int,
    chunks: int,
    schedule: str,
    microbatches: int,
    meta: dict[str, Any] | None = None,
) -> Plan:
    """The plan of ``pp`` ranks x ``chunks`` virtual stages under a multi-stage
    ``schedule`` with the least simulated step time found (DP, then boundary descent)."""
    if schedule not in MULTI_SCHEDULES:
        raise PlanError(
            f"schedule {schedule} runs one stage per rank; plan it with make_plan, or choose "
            f"one of {', '.join(MULTI_SCHEDULES)}"
        )
    n = pp * chunks
    if n > costs.num_layers:
        raise PlanError(
            f"{pp} ranks x {chunks} virtual stages need {n} layers but {costs.model} has "
            f"{costs.num_layers}; use at most {costs.num_layers // chunks} ranks or fewer chunks"
        )
    owner = schedule_ranks(schedule, pp=pp, chunks=chunks)
    wide = expand_costs(costs, owner=owner)
    # The DP ranks its candidates with the one-stage GPipe recurrence, which takes any
    # microbatch count; the schedule's own simulation decides below.
    res = plan_partition(wide, num_stages=n, schedule="gpipe", microbatches=microbatches)
    bounds = [list(b) for b in res.bounds]

    def score(bs: list[list[int]]) -> float:
        return schedule_step_ms(
            costs,
            [tuple(b) for b in bs],
            schedule=schedule,
            microbatches=microbatches,
            chunks=chunks,
        )

    best = score(bounds)
    better = True
    while better:
        better = False
        for s in range(n - 1):
            for d in (-1, 1):
                cut = bounds[s][1] + d
                if not bounds[s][0] < cut < bounds[s + 1][1]:
                    continue
                trial = [list(b) for b in bounds]
                trial[s][1] = trial[s + 1][0] = cut
                t = score(trial)
                if t < best - 1e-9:
                    best, bounds, better = t, trial, True
    cm = costs.for_devices(pp)
    names = costs.layer_names
    stages = []
    for s, (a, b) in enumerate(bounds):
        f, bw = cm.stage_ms(owner[s], a, b)
        stages.append(
            StagePlan(a, b, owner[s], tuple(names[a:b]), fwd_ms=round(f, 6), bwd_ms=round(bw, 6))
        )
    sim = schedule_sim(
        costs,
        [tuple(b) for b in bounds],
        schedule=schedule,
        microbatches=microbatches,
        chunks=chunks,
    )
    info = {
        "method": "dp+descent",
        "step_ms": round(best, 6),
        "bubble": round(sim.bubble, 6),
        "busy_ms": [round(b, 6) for b in sim.busy_ms],
        "dp_bounds": [list(b) for b in res.bounds],
        "bottleneck_ms": round(max(st.fwd_ms + st.bwd_ms for st in stages), 6),
        "costs": {
            **{k: v for k, v in costs.meta.items() if isinstance(v, str | int | float | None)},
            "microbatch_size": costs.microbatch_size,
        },
    }
    return Plan(
        model=costs.model,
        num_layers=costs.num_layers,
        stages=tuple(stages),
        schedule=schedule,
        microbatches=microbatches,
        model_fingerprint=costs.fingerprint,
        meta={**info, **(meta or {})},
        chunks=chunks,
    )


def schedule_table(
    costs: CostModel, *, pp: int, microbatches: int, chunks: int = 2
) -> list[dict[str, Any]]:
    """Per schedule: its best split of ``costs``'s model over ``pp`` ranks (``chunks``
    virtual stages each under the multi-stage schedules) and that split's simulated step
    time, or why the schedule cannot run (``note``). Every time comes from one simulator
    (``multisim``), so the rows compare."""
    from dynpipe.planner.make import make_plan
    from dynpipe.planner.plan import SCHEDULES

    rows = []
    for schedule in SCHEDULES:
        v = chunks if schedule in MULTI_SCHEDULES else 1
        row: dict[str, Any] = {"schedule": schedule, "chunks": v, "step_ms": None, "note": ""}
        try:
            if schedule in MULTI_SCHEDULES:
                if schedule in ("zbv", "dualpipev"):
                    v = row["chunks"] = 2
                plan = make_virtual_plan(
                    costs, pp=pp, chunks=v, schedule=schedule, microbatches=microbatches
                )
                row["step_ms"] = plan.meta["step_ms"]
            else:
                plan = make_plan(costs, num_stages=pp, schedule=schedule, microbatches=microbatches)
                row["step_ms"] = round(
                    schedule_step_ms(
                        costs, plan.bounds, schedule=schedule, microbatches=microbatches
                    ),
                    6,
                )
            row["split"] = [st.stop - st.start for st in plan.stages]
            if schedule == "2bw":
                # What the paper's pipeline reaches without the flush the runtime keeps.
                steady = steady_2bw_step_ms(costs, plan.bounds, microbatches=microbatches)
                row["no_flush_ms"] = round(steady, 6)
                row["note"] = f"changes training; no-flush steady state {steady:.3f} (not run)"
        except PlanError as exc:
            row["note"] = str(exc)
        rows.append(row)
    return rows
