"""Event simulator of one pipeline training step under GPipe or 1F1B.

A schedule is data: per stage, an ordered list of actions ``F<mb>`` / ``B<mb>`` — the same
order ``torch.distributed.pipelining`` runs (``ScheduleGPipe``: all forwards, then all
backwards; ``Schedule1F1B``: ``min(M, S - s)`` warm-up forwards, then one backward and one
forward alternately, then the remaining backwards). The simulator runs those lists against
their dependencies:

- ``F(s, m)`` needs the activation of ``F(s - 1, m)`` to have arrived over link ``s - 1``;
- ``B(s, m)`` needs the gradient of ``B(s + 1, m)`` (the last stage: its own ``F(s, m)``);
- a stage runs one action at a time, in its list's order;
- each link direction carries one transfer at a time, first come first served; sends are
  asynchronous (the sender goes on computing), so a transfer is its own event.

Step time is when the last backward finishes. ``step_times`` evaluates the same recurrence
for many candidate partitions at once (numpy over candidates), which is what lets the
planner rank hundreds of candidates by simulated step time in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from dynpipe.planner.plan import SCHEDULES, PlanError

if TYPE_CHECKING:
    from dynpipe.planner.costs import CostModel
    from dynpipe.planner.plan import Plan

# The schedules this module's per-stage recurrence covers (one stage per rank).
_ONE_STAGE = ("gpipe", "1f1b", "2bw")  # 2bw runs 1F1B's order (flushed)

__all__ = [
    "Action",
    "Event",
    "SimResult",
    "format_actions",
    "simulate",
    "simulate_plan",
    "stage_actions",
    "step_times",
]


class Action(NamedTuple):
    """One compute action of a stage: ``kind`` is ``"F"`` or ``"B"``, ``mb`` the microbatch."""

    kind: str
    mb: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}"


@dataclass(frozen=True)
class Event:
    """Something that took time: compute (``F``/``B`` on ``stage``) or a transfer.

    Transfers are ``SF`` (activation from ``stage`` to ``stage + 1``) and ``SB`` (gradient
    from ``stage`` to ``stage - 1``).
    """

    kind: str
    stage: int
    mb: int
    start: float
    end: float

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}@s{self.stage}[{self.start:.4g}–{self.end:.4g}]"


@dataclass(frozen=True)
class SimResult:
    """Simulated step: its time, per-stage busy time, bubble fraction and every event."""

    step_ms: float
    busy_ms: tuple[float, ...]
    bubble: float
    schedule: str
    microbatches: int
    events: tuple[Event, ...]

    def __repr__(self) -> str:
        busy = ", ".join(f"{b:.3g}" for b in self.busy_ms)
        return (
            f"SimResult({self.schedule} S={len(self.busy_ms)} M={self.microbatches} "
            f"step={self.step_ms:.4g}ms bubble={self.bubble:.1%} busy=[{busy}] "
            f"events={len(self.events)})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_ms": self.step_ms,
            "busy_ms": list(self.busy_ms),
            "bubble": self.bubble,
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "events": [[e.kind, e.stage, e.mb, e.start, e.end] for e in self.events],
        }


def _check(schedule: str, num_stages: int, microbatches: int) -> None:
    if schedule not in _ONE_STAGE:
        other = (
            " (a multi-stage schedule: simulate it with dynpipe.planner.multisim)"
            if schedule in SCHEDULES
            else ""
        )
        raise PlanError(f"schedule {schedule!r} is not one of {', '.join(_ONE_STAGE)}{other}")
    if num_stages < 1 or microbatches < 1:
        raise PlanError(
            f"need at least one stage and one microbatch, got {num_stages} and {microbatches}"
        )


@lru_cache(maxsize=256)
def _actions(schedule: str, num_stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    _check(schedule, num_stages, microbatches)
    m = microbatches
    out = []
    for s in range(num_stages):
        if schedule == "gpipe":
            acts = [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
        else:
            warm = min(m, num_stages - s)
            acts = [Action("F", i) for i in range(warm)]
            for i in range(m - warm):
                acts += [Action("B", i), Action("F", warm + i)]
            acts += [Action("B", i) for i in range(m - warm, m)]
        out.append(tuple(acts))
    return tuple(out)


def stage_actions(schedule: str, *, num_stages: int, microbatches: int) -> list[list[Action]]:
    """Per-stage ordered action lists of ``schedule`` (pure data)."""
    return [list(a) for a in _actions(schedule, num_stages, microbatches)]


def format_actions(actions: Sequence[Sequence[Action]]) -> str:
    """One line per stage: ``s0: F0 F1 B0 F2 …``."""
    return "\n".join(f"s{s}: " + " ".join(map(repr, acts)) for s, acts in enumerate(actions))


def _run(
    fwd: Sequence[float],
    bwd: Sequence[float],
    comm: Sequence[float],
    schedule: str,
    microbatches: int,
) -> tuple[list[Event], list[tuple[str, int, int]]]:
    """Dependency-driven execution; returns the events and the order actions became ready."""
    n = len(fwd)
    orders = _actions(schedule, n, microbatches)
    ptr = [0] * n
    free = [0.0] * n
    link_f = [0.0] * max(n - 1, 0)
    link_b = [0.0] * max(n - 1, 0)
    arrive_f: dict[tuple[int, int], float] = {}
    arrive_b: dict[tuple[int, int], float] = {}
    done_f: dict[tuple[int, int], float] = {}
    events: list[Event] = []
    trace: list[tuple[str, int, int]] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(n):
            while ptr[s] < len(orders[s]):
                kind, mb = orders[s][ptr[s]]
                if kind == "F":
                    ready = 0.0 if s == 0 else arrive_f.get((s, mb))
                else:
                    ready = done_f.get((s, mb)) if s == n - 1 else arrive_b.get((s, mb))
                if ready is None:
                    break  # waits on a neighbour; another stage must move first
                start = max(free[s], ready)
                end = start + (fwd[s] if kind == "F" else bwd[s])
                free[s] = end
                events.append(Event(kind, s, mb, start, end))
                trace.append((kind, s, mb))
                if kind == "F":
                    done_f[(s, mb)] = end
                    if s < n - 1:
                        t0 = max(link_f[s], end)
                        link_f[s] = arrive_f[(s + 1, mb)] = t0 + comm[s]
                        events.append(Event("SF", s, mb, t0, link_f[s]))
                elif s > 0:
                    t0 = max(link_b[s - 1], end)
                    link_b[s - 1] = arrive_b[(s - 1, mb)] = t0 + comm[s - 1]
                    events.append(Event("SB", s, mb, t0, link_b[s - 1]))
                ptr[s] += 1
                remaining -= 1
                progressed = True
        assert progressed, f"{schedule} schedule deadlocked at {ptr}"
    return events, trace


def _comm(comm_ms: Sequence[float] | None, n: int) -> list[float]:
    c = [0.0] * max(n - 1, 0) if comm_ms is None else [float(x) for x in comm_ms]
    if len(c) != max(n - 1, 0):
        raise PlanError(f"{n} stages need {n - 1} boundary transfer times, got {len(c)}")
    return c


def simulate(
    fwd_ms: Sequence[float],
    bwd_ms: Sequence[float],
    *,
    comm_ms: Sequence[float] | None = None,
    schedule: str = "1f1b",
    microbatches: int = 4,
) -> SimResult:
    """Simulate one step of stages with per-microbatch ``fwd_ms[s]``, ``bwd_ms[s]``.

    ``comm_ms[s]`` is the time to move one microbatch's activation (or its gradient) over the
    link between stage ``s`` and ``s + 1``.
    """
    n = len(fwd_ms)
    if len(bwd_ms) != n:
        raise PlanError(f"{n} forward times but {len(bwd_ms)} backward times; give one per stage")
    _check(schedule, n, microbatches)
    fwd = [float(x) for x in fwd_ms]
    bwd = [float(x) for x in bwd_ms]
    events, _ = _run(fwd, bwd, _comm(comm_ms, n), schedule, microbatches)
    events.sort(key=lambda e: e.start)  # stable: ties keep execution order
    step = max((e.end for e in events), default=0.0)
    busy = tuple(microbatches * (f + b) for f, b in zip(fwd, bwd, strict=True))
    bubble = 1.0 - sum(busy) / (n * step) if step > 0 else 0.0
    return SimResult(step, busy, bubble, schedule, microbatches, tuple(events))


@lru_cache(maxsize=64)
def _levels(
    schedule: str, num_stages: int, microbatches: int
) -> tuple[int, tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], ...]]:
    """The step as a DAG grouped into levels of mutually independent nodes.

    Nodes are compute actions and transfers; each has at most two predecessors (the previous
    action of its stage or link, and the data it needs) and a duration row: ``F`` of stage
    ``s`` reads row ``s``, ``B`` row ``S + s``, a transfer over link ``l`` row ``2S + l``.
    Node ``N`` is a zero sentinel standing in for a missing predecessor.
    """
    n, m = num_stages, microbatches
    orders = _actions(schedule, n, m)
    ids: dict[tuple[str, int, int], int] = {}
    for s in range(n):
        for kind, mb in orders[s]:
            ids[(kind, s, mb)] = len(ids)
        for mb in range(m):
            if s < n - 1:
                ids[("SF", s, mb)] = len(ids)
            if s > 0:
                ids[("SB", s, mb)] = len(ids)
    sentinel = len(ids)
    preds: dict[int, tuple[int, int]] = {}
    row: dict[int, int] = {}
    for s in range(n):
        prev = sentinel
        for kind, mb in orders[s]:
            me = ids[(kind, s, mb)]
            if kind == "F":
                data = ids[("SF", s - 1, mb)] if s > 0 else sentinel
                row[me] = s
            else:
                data = ids[("SB", s + 1, mb)] if s < n - 1 else sentinel
                row[me] = n + s
            preds[me] = (prev, data)
            prev = me
        for mb in range(m):
            # Each direction of a link is FIFO in production order, which is microbatch order.
            if s < n - 1:
                me = ids[("SF", s, mb)]
                preds[me] = (ids[("F", s, mb)], ids[("SF", s, mb - 1)] if mb else sentinel)
                row[me] = 2 * n + s
            if s > 0:
                me = ids[("SB", s, mb)]
                preds[me] = (ids[("B", s, mb)], ids[("SB", s, mb - 1)] if mb else sentinel)
                row[me] = 2 * n + s - 1
    level = {sentinel: 0}
    pending = list(preds)
    while pending:  # longest-path depth; every node waits for both predecessors' depths
        left = []
        for node in pending:
            a, b = preds[node]
            if a in level and b in level:
                level[node] = 1 + max(level[a], level[b])
            else:
                left.append(node)
        assert len(left) < len(pending), "schedule DAG has a cycle"
        pending = left
    groups: dict[int, list[int]] = {}
    for node, lv in level.items():
        if node != sentinel:
            groups.setdefault(lv, []).append(node)
    out = []
    for lv in sorted(groups):
        nodes = np.array(groups[lv])
        out.append(
            (
                nodes,
                np.array([preds[x][0] for x in nodes]),
                np.array([preds[x][1] for x in nodes]),
                np.array([row[x] for x in nodes]),
            )
        )
    return sentinel, tuple(out)


def step_times(
    fwd_ms: np.ndarray,
    bwd_ms: np.ndarray,
    comm_ms: np.ndarray | None = None,
    *,
    schedule: str = "1f1b",
    microbatches: int = 4,
) -> np.ndarray:
    """Simulated step time of ``C`` candidates at once: inputs ``[C, S]`` and ``[C, S - 1]``.

    Same dependencies and link model as ``simulate`` (tested equal), evaluated as a longest
    path over the schedule's DAG one level of independent actions at a time, vectorised over
    actions and candidates; events are not kept.
    """
    fwd = np.atleast_2d(np.asarray(fwd_ms, dtype=np.float64))
    bwd = np.atleast_2d(np.asarray(bwd_ms, dtype=np.float64))
    c, n = fwd.shape
    _check(schedule, n, microbatches)
    links = max(n - 1, 0)
    comm = np.zeros((c, links)) if comm_ms is None else np.asarray(comm_ms, dtype=float)
    dur = np.vstack([fwd.T, bwd.T, comm.reshape(c, links).T, np.zeros((1, c))])
    sentinel, levels = _levels(schedule, n, microbatches)
    finish = np.zeros((sentinel + 1, c))
    for nodes, p1, p2, rows in levels:
        finish[nodes] = np.maximum(finish[p1], finish[p2]) + dur[rows]
    return finish.max(axis=0)


def simulate_plan(plan: Plan, costs: CostModel) -> SimResult:
    """Simulate ``plan`` with per-stage times from ``costs`` (device ``s`` runs stage ``s``)."""
    from dynpipe.planner.evaluate import stage_costs

    sc = stage_costs(costs, plan.bounds, schedule=plan.schedule, microbatches=plan.microbatches)
    return simulate(
        sc.fwd_ms,
        sc.bwd_ms,
        comm_ms=sc.comm_ms,
        schedule=plan.schedule,
        microbatches=plan.microbatches,
    )
