"""Step time of any schedule, virtual stages included, from per-stage costs.

A schedule is data: per rank, the ordered compute actions torch runs. For the multi-stage
schedules (``interleaved-1f1b``, ``zb``, ``zbv``, ``dualpipev``) the lists are torch's own,
read from the schedule class it runs (``pipeline_order_with_comms``, built here over
stand-in stages without a process group), so the simulator and the runtime cannot disagree
on the order; GPipe and 1F1B come from ``dynpipe.planner.simulate``. Actions:

- ``F`` (forward), ``B`` (whole backward), ``I`` (input-gradient part), ``W`` (weight-gradient
  part) of virtual stage ``s`` on microbatch ``m``; DualPipeV's overlapped forward/backward
  pairs run their two actions back to back on the rank.
- ``F(s, m)`` needs ``F(s - 1, m)`` and its activation's transfer; ``B``/``I(s, m)`` need the
  gradient of ``B``/``I(s + 1, m)`` (the last stage: its own forward); ``W(s, m)`` needs
  ``I(s, m)``. Two stages on one rank hand tensors over for free.
- A rank runs one action at a time, in its list's order. Transfers take the boundary's
  ``comm_ms`` and do not contend (a microbatch's activation is small beside its compute in
  every case this is used for; ``simulate`` models link contention for one-stage schedules).

Zero-bubble schedules split a stage's backward ``bwd_ms[s]`` into ``I = (1 - w_frac) bwd``
and ``W = w_frac bwd``; the first stage's input part computes nothing (its input needs no
gradient), so there ``I = 0`` and ``W = bwd`` as torch runs it. Each rank then runs its
optimizer update (``update_ms``); the step ends when the last rank's does.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from dynpipe.planner.plan import MULTI_SCHEDULES, SCHEDULES, PlanError, microbatch_problem
from dynpipe.planner.plan import schedule_ranks as _ranks
from dynpipe.planner.simulate import Event, SimResult, stage_actions

if TYPE_CHECKING:
    from dynpipe.planner.costs import CostModel
    from dynpipe.planner.plan import Plan

__all__ = [
    "W_FRAC",
    "plan_step_ms",
    "rank_orders",
    "schedule_sim",
    "schedule_step_ms",
    "simulate_schedule",
    "steady_2bw_ms",
    "steady_2bw_step_ms",
]

# The weight-gradient share of a backward: a dense layer's two gradient matmuls are of one
# size (measured on CPU in bench/schedules_cpu.py's logs; docs/schedules.md).
W_FRAC = 0.5

_TORCH = {
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
_COMPUTE = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}

Order = tuple[tuple[tuple[str, int, int], ...], ...]


class _Stand:
    """A stand-in pipeline stage: what torch's schedule constructors read."""

    def __init__(self, index: int, pp: int, num_stages: int) -> None:
        self.stage_index, self.group_size, self.num_stages = index, pp, num_stages
        self.group_rank = 0
        self.submod = None
        self.is_first, self.is_last = index == 0, index == num_stages - 1


def _check(schedule: str, pp: int, chunks: int, microbatches: int) -> None:
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if pp < 1 or chunks < 1 or microbatches < 1:
        raise PlanError(
            f"need at least one rank, chunk and microbatch, got {pp}, {chunks}, {microbatches}"
        )
    if chunks > 1 and schedule not in MULTI_SCHEDULES:
        raise PlanError(f"schedule {schedule} runs one stage per rank, not {chunks}")
    problem = microbatch_problem(schedule, pp=pp, chunks=chunks, microbatches=microbatches)
    if problem:
        raise PlanError(problem)


@lru_cache(maxsize=128)
def rank_orders(schedule: str, *, pp: int, chunks: int, microbatches: int) -> Order:
    """Per rank, its compute actions ``(kind, stage, microbatch)`` in the order torch runs
    them (pure data; ``kind`` is F, B, I or W)."""
    _check(schedule, pp, chunks, microbatches)
    if schedule not in MULTI_SCHEDULES:
        acts = stage_actions(schedule, num_stages=pp, microbatches=microbatches)
        return tuple(tuple((a.kind, s, a.mb) for a in acts[s]) for s in range(pp))
    import torch.distributed.pipelining as pipelining

    n = pp * chunks
    where = _ranks(schedule, pp=pp, chunks=chunks)
    stands = [_Stand(s, pp, n) for s in range(n) if where[s] == 0]
    try:
        sched = getattr(pipelining, _TORCH[schedule])(stands, n_microbatches=microbatches)
    except (AttributeError, ValueError) as exc:
        raise PlanError(
            f"torch cannot build {schedule} for {pp} ranks x {chunks} chunks and "
            f"{microbatches} microbatches ({str(exc).splitlines()[0][:160]})"
        ) from None
    out = []
    for r in range(pp):
        acts: list[tuple[str, int, int]] = []
        for a in sched.pipeline_order_with_comms[r]:
            subs = a.sub_actions if a.sub_actions else (a,)
            for sub in subs:
                kind = _COMPUTE.get(sub.computation_type.name)
                if kind is not None:
                    acts.append((kind, sub.stage_index, sub.microbatch_index))
        out.append(tuple(acts))
    return tuple(out)


def simulate_schedule(
    fwd_ms: Sequence[float],
    bwd_ms: Sequence[float],
    *,
    schedule: str,
    microbatches: int,
    chunks: int = 1,
    comm_ms: Sequence[float] | None = None,
    update_ms: Sequence[float] | None = None,
    w_frac: float = W_FRAC,
    bwd_w_ms: Sequence[float] | None = None,
    action_ms: float = 0.0,
) -> SimResult:
    """Simulate one step: ``fwd_ms[s]``/``bwd_ms[s]`` per microbatch of (virtual) stage
    ``s`` of ``len(fwd_ms) = pp * chunks``, ``comm_ms[s]`` to move a microbatch's
    activation or gradient between stages ``s`` and ``s + 1``, ``update_ms[r]`` for rank
    ``r``'s optimizer step. ``bwd_w_ms[s]``: the weight-gradient part of ``bwd_ms[s]`` where
    it is known (measured), else ``w_frac`` of it. ``action_ms``: the schedule runtime's host
    time around each compute action (its loop, posting the action's transfers), which the
    stages' compute timers do not see. ``SimResult.busy_ms`` is per rank."""
    n = len(fwd_ms)
    if len(bwd_ms) != n or n % chunks:
        raise PlanError(
            f"{len(fwd_ms)} forward and {len(bwd_ms)} backward times for {chunks} chunks per "
            "rank; give one of each per stage, a multiple of chunks"
        )
    pp = n // chunks
    comm = [0.0] * (n - 1) if comm_ms is None else [float(c) for c in comm_ms]
    if len(comm) != n - 1:
        raise PlanError(f"{n} stages need {n - 1} boundary transfer times, got {len(comm)}")
    upd = [0.0] * pp if update_ms is None else [float(u) for u in update_ms]
    if len(upd) != pp:
        raise PlanError(f"{pp} ranks need {pp} update times, got {len(upd)}")
    orders = rank_orders(schedule, pp=pp, chunks=chunks, microbatches=microbatches)
    owner = _ranks(schedule, pp=pp, chunks=chunks) if schedule in MULTI_SCHEDULES else []
    owner = owner or list(range(pp))

    def dur(kind: str, s: int) -> float:
        if kind == "F":
            return float(fwd_ms[s])
        if kind == "B":
            return float(bwd_ms[s])
        if bwd_w_ms is not None:
            w = min(float(bwd_w_ms[s]), float(bwd_ms[s]))
            return float(bwd_ms[s]) - w if kind == "I" else w
        if kind == "I":
            return 0.0 if s == 0 else (1.0 - w_frac) * float(bwd_ms[s])
        return float(bwd_ms[s]) if s == 0 else w_frac * float(bwd_ms[s])

    def hop(a: int, b: int) -> float:  # transfer between stages a < b = a + 1
        return 0.0 if owner[a] == owner[b] else comm[a]

    done: dict[tuple[str, int, int], float] = {}
    ptr, free = [0] * pp, [0.0] * pp
    events: list[Event] = []
    left = sum(len(o) for o in orders)
    while left:
        moved = False
        for r in range(pp):
            while ptr[r] < len(orders[r]):
                kind, s, m = orders[r][ptr[r]]
                if kind == "F":
                    ready = 0.0 if s == 0 else _at(done, ("F", s - 1, m), hop(s - 1, s))
                elif kind == "W":
                    ready = done.get(("G", s, m))
                elif s == n - 1:
                    ready = done.get(("F", s, m))
                else:
                    ready = _at(done, ("G", s + 1, m), hop(s, s + 1))
                if ready is None:
                    break
                start = max(free[r], ready)
                free[r] = end = start + dur(kind, s) + action_ms
                # "G": the input gradient is out (a whole backward or an input part).
                done[("G" if kind in "BI" else kind, s, m)] = end
                events.append(Event(kind, s, m, start, end))
                ptr[r] += 1
                left -= 1
                moved = True
        if not moved:
            raise AssertionError(f"{schedule} simulation deadlocked at {ptr}")
    ends = [f + u for f, u in zip(free, upd, strict=True)]
    step = max(ends, default=0.0)
    busy = [0.0] * pp
    for e in events:
        busy[owner[e.stage]] += e.end - e.start
    bubble = 1.0 - sum(busy) / (pp * step) if step > 0 else 0.0
    events.sort(key=lambda e: e.start)
    return SimResult(step, tuple(busy), bubble, schedule, microbatches, tuple(events))


def _at(done: dict, key: tuple[str, int, int], delay: float) -> float | None:
    t = done.get(key)
    return None if t is None else t + delay


def schedule_step_ms(
    costs: CostModel,
    bounds: Sequence[tuple[int, int]],
    *,
    schedule: str,
    microbatches: int,
    chunks: int = 1,
    w_frac: float = W_FRAC,
) -> float:
    """Simulated step time of the (virtual) stages ``bounds`` under ``schedule``, device
    ``r`` of ``costs`` running rank ``r``'s stages (``schedule_ranks``). The function the
    adaptation core prices a candidate split with under the schedule in force."""
    return schedule_sim(
        costs,
        bounds,
        schedule=schedule,
        microbatches=microbatches,
        chunks=chunks,
        w_frac=w_frac,
    ).step_ms


def schedule_sim(
    costs: CostModel,
    bounds: Sequence[tuple[int, int]],
    *,
    schedule: str,
    microbatches: int,
    chunks: int = 1,
    w_frac: float = W_FRAC,
) -> SimResult:
    """``schedule_step_ms``'s whole simulation (events, per-rank busy time, bubble)."""
    n = len(bounds)
    fwd, bwd, comm, pp = _stage_times(costs, bounds, schedule=schedule, chunks=chunks)
    return simulate_schedule(
        fwd,
        bwd,
        schedule=schedule,
        microbatches=microbatches,
        chunks=chunks,
        comm_ms=comm if pp > 1 else [0.0] * (n - 1),
        w_frac=w_frac,
    )


def _stage_times(
    costs: CostModel, bounds: Sequence[tuple[int, int]], *, schedule: str, chunks: int
) -> tuple[list[float], list[float], list[float], int]:
    """Per (virtual) stage its forward and backward per microbatch on its rank's device,
    the transfer time of each boundary, and the rank count."""
    n = len(bounds)
    if n % chunks:
        raise PlanError(f"{n} stages cannot be {chunks} chunks per rank; give a multiple")
    pp = n // chunks
    owner = _ranks(schedule, pp=pp, chunks=chunks) if schedule in MULTI_SCHEDULES else None
    owner = owner or list(range(pp))
    from dynpipe.planner.evaluate import transfer_ms

    cm = costs.for_devices(pp)
    fwd, bwd, comm = [], [], []
    for s, (a, b) in enumerate(bounds):
        f, b_ = cm.stage_ms(owner[s], a, b)
        fwd.append(f)
        bwd.append(b_)
        if s < n - 1:
            # The link between the two ranks (a looped schedule's wrap from the last rank
            # to the first is priced as the first link).
            ra, rb = owner[s], owner[s + 1]
            link = min(ra, rb) if abs(ra - rb) == 1 else 0
            comm.append(0.0 if ra == rb else float(transfer_ms(cm, link, cm.out_bytes[b - 1])))
    return fwd, bwd, comm, pp


def steady_2bw_ms(
    fwd_ms: Sequence[float],
    bwd_ms: Sequence[float],
    *,
    microbatches: int,
    comm_ms: Sequence[float] | None = None,
    update_ms: Sequence[float] | None = None,
) -> float:
    """PipeDream-2BW's step time in its steady state, with no flush between steps: step
    ``t + 1``'s forwards fill the gaps of step ``t``'s backwards, so each stage is busy
    with its ``microbatches`` forwards and backwards and its update (``update_ms[s]``: the
    optimizer step and the copy of the weights it keeps) and the slowest stage sets the
    pace, unless a boundary's ``microbatches`` transfers each way take longer.

    dynpipe's 2bw runtime keeps the flush (``docs/schedules.md``): its step is the 1F1B
    simulation's (``schedule_step_ms(..., schedule="2bw")``); this is what the paper's
    pipeline would reach, for comparison."""
    n = len(fwd_ms)
    if len(bwd_ms) != n or n < 1 or microbatches < 1:
        raise PlanError(
            f"{len(fwd_ms)} forward and {len(bwd_ms)} backward times, {microbatches} "
            "microbatches; give one of each per stage and at least one microbatch"
        )
    upd = [0.0] * n if update_ms is None else [float(u) for u in update_ms]
    comm = [0.0] * (n - 1) if comm_ms is None else [float(c) for c in comm_ms]
    if len(upd) != n or len(comm) != n - 1:
        raise PlanError(
            f"{n} stages need {n} update times and {n - 1} transfer times, got {len(upd)} "
            f"and {len(comm)}"
        )
    m = microbatches
    busy = max(m * (float(f) + float(b)) + u for f, b, u in zip(fwd_ms, bwd_ms, upd, strict=True))
    return max(busy, max((m * c for c in comm), default=0.0))


def steady_2bw_step_ms(
    costs: CostModel, bounds: Sequence[tuple[int, int]], *, microbatches: int
) -> float:
    """``steady_2bw_ms`` of the stages ``bounds``, device ``s`` of ``costs`` running stage
    ``s`` (the cost model has no update time: left out, as for every schedule here)."""
    fwd, bwd, comm, _ = _stage_times(costs, bounds, schedule="2bw", chunks=1)
    return steady_2bw_ms(fwd, bwd, microbatches=microbatches, comm_ms=comm)


def plan_step_ms(plan: Plan, costs: CostModel, *, schedule: str | None = None) -> float:
    """Simulated step time of ``plan`` (its own schedule, or ``schedule`` over the same
    virtual stages) with per-device costs from ``costs``."""
    return schedule_step_ms(
        costs,
        plan.bounds,
        schedule=schedule or plan.schedule,
        microbatches=plan.microbatches,
        chunks=plan.chunks,
    )
