"""Choosing the data x pipeline shape: how many replicas, how many stages, which split.

``G`` GPUs run ``dp`` replicas of a ``pp``-stage pipeline for every ``pp`` dividing ``G``
(``dp = G / pp``; ``pp = 1`` is data parallelism alone, the whole model on every GPU).
Each replica takes ``1 / dp`` of the batch in ``M`` microbatches (``M`` per replica, as
``dynpipe train --microbatches`` counts them), so a microbatch holds ``batch / (dp M)``
samples and the per-layer costs are those of that size.

A shape's step time is one replica's simulated pipeline step (``step_times``) plus the tail
of the gradient all-reduce: stage ``s`` holds its layers' gradients, which a ring
all-reduce over ``dp`` replicas moves ``2 (dp - 1) / dp`` times over the link
(``ring_allreduce_ms``). The reduce starts when the stage's last backward ends; in either
schedule the last microbatch's backward runs from the last stage down to the first, so
stage ``s`` ends its backward ``lead_s`` (the backwards and gradient transfers of stages
``0..s-1``) before the step would end, and its reduce delays the step by what exceeds that
lead. The model counts no overlap of a stage's reduce with its own last backward, which DDP
does bucket by bucket: it is conservative by at most one microbatch's backward.

For each shape the split minimising that step time is found by listing every split when
there are few (``max_exhaustive``), else by improving the pipeline-optimal split of the
exact planner (``plan_partition``) one boundary move at a time. Splits whose stages do not
fit the memory limit are not chosen; a shape none of whose splits fits is reported as such.

Uneven replication (a stage with more replicas than another, as PipeDream's planner
allows) is not considered: the runtime cannot run it (see docs/data-pipeline.md).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dynpipe.planner.costs import CostModel
from dynpipe.planner.dp import plan_partition
from dynpipe.planner.evaluate import in_flight
from dynpipe.planner.plan import PlanError, split_label
from dynpipe.planner.simulate import step_times

__all__ = [
    "ShapeChoice",
    "choose_shape",
    "evaluate_shape",
    "reduce_tail_ms",
    "ring_allreduce_ms",
    "tail_parts",
]

Bounds = tuple[tuple[int, int], ...]


def ring_allreduce_ms(
    nbytes: float | np.ndarray, *, replicas: int, bandwidth: float, latency_ms: float = 0.0
) -> float | np.ndarray:
    """Milliseconds a ring all-reduce of ``nbytes`` takes over ``replicas`` ranks: each rank
    sends and receives ``2 (n - 1) / n`` of the data in ``2 (n - 1)`` latency-bound steps."""
    if replicas <= 1:
        return 0.0 * nbytes
    n = replicas
    return 2 * (n - 1) / n * nbytes / bandwidth * 1e3 + 2 * (n - 1) * latency_ms


def _link(costs: CostModel) -> tuple[float, float]:
    bw = float(costs.bandwidth[0]) if costs.num_devices > 1 else None
    lat = float(costs.latency_ms[0]) if costs.num_devices > 1 else None
    return (
        bw if bw is not None else float(costs.meta.get("link_bandwidth", 25e9)),
        lat if lat is not None else float(costs.meta.get("link_latency_ms", 0.0)),
    )


def tail_parts(
    costs: CostModel, *, bounds: Sequence[tuple[int, int]], replicas: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per stage: its gradient all-reduce across ``replicas`` (ms; 0 for one replica), its
    lead (how long before the step's end its last backward ends: the module docstring)
    and its own backward of one microbatch (what a bucketed reduce overlaps)."""
    cm = costs.for_devices(len(bounds))
    bw, lat = _link(cm)
    reduce, lead, own = np.zeros(len(bounds)), np.zeros(len(bounds)), np.zeros(len(bounds))
    at = 0.0
    for s, (a, b) in enumerate(bounds):
        grads = float(cm.param_bytes[a:b].sum())
        reduce[s] = float(ring_allreduce_ms(grads, replicas=replicas, bandwidth=bw, latency_ms=lat))
        lead[s] = at
        own[s] = float(cm.bwd_ms[s, a:b].sum() + cm.stage_bwd_ms[s])
        at += own[s]
        if s < len(bounds) - 1:
            at += float(cm.out_bytes[b - 1] / cm.bandwidth[s] * 1e3 + cm.latency_ms[s])
    return reduce, lead, own


def reduce_tail_ms(costs: CostModel, *, bounds: Sequence[tuple[int, int]], replicas: int) -> float:
    """How long the gradient all-reduce across ``replicas`` extends the step (see the
    module docstring): ``max_s (reduce_s - lead_s)``, at least 0."""
    if replicas <= 1:
        return 0.0
    reduce, lead, _ = tail_parts(costs, bounds=bounds, replicas=replicas)
    return max(float(np.max(reduce - lead)), 0.0)


@dataclass(frozen=True)
class ShapeChoice:
    """One data x pipeline shape with its best split (times in ms per step).

    microbatches: per replica; microbatch_size: samples per microbatch. pipeline_ms: one
    replica's simulated step; reduce_ms: what the gradient all-reduce adds; step_ms: the
    sum. mem_bytes: the fullest stage's peak. fits: within the memory limit. note: why a
    shape was not planned (then ``bounds`` is empty and the times infinite).
    """

    dp: int
    pp: int
    bounds: Bounds
    microbatches: int
    microbatch_size: int
    pipeline_ms: float
    reduce_ms: float
    step_ms: float
    mem_bytes: int = 0
    fits: bool = True
    candidates: int = 0
    note: str = ""

    def __repr__(self) -> str:
        split = split_label(self.bounds) or "-"
        return (
            f"ShapeChoice({self.dp}x{self.pp} {split} step={self.step_ms:.4g}ms "
            f"(pipe {self.pipeline_ms:.4g} + reduce {self.reduce_ms:.4g}))"
        )


def _cuts_all(n: int, s: int) -> np.ndarray:
    return np.array([(0, *c, n) for c in itertools.combinations(range(1, n), s - 1)], int)


def _score(
    cm: CostModel, cuts: np.ndarray, *, replicas: int, schedule: str, microbatches: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pipeline ms, reduce tail ms, peak stage bytes of every candidate ``[C, S + 1]``."""
    s = cuts.shape[1] - 1
    pf = np.hstack([np.zeros((s, 1)), np.cumsum(cm.fwd_ms, axis=1)])
    pb = np.hstack([np.zeros((s, 1)), np.cumsum(cm.bwd_ms, axis=1)])
    pp_ = np.concatenate([[0.0], np.cumsum(cm.param_bytes)])
    ps = np.concatenate([[0.0], np.cumsum(cm.static_bytes)])
    pa = np.concatenate([[0.0], np.cumsum(cm.act_bytes)])
    rows = np.arange(s)
    lo, hi = cuts[:, :-1], cuts[:, 1:]
    fwd = pf[rows, hi] - pf[rows, lo] + cm.stage_fwd_ms[None, :]
    bwd = pb[rows, hi] - pb[rows, lo] + cm.stage_bwd_ms[None, :]
    if s > 1:
        sent = cm.out_bytes[hi[:, :-1] - 1]
        comm = sent / cm.bandwidth[None, :] * 1e3 + cm.latency_ms[None, :]
    else:
        comm = np.zeros((len(cuts), 0))
    pipe = step_times(fwd, bwd, comm, schedule=schedule, microbatches=microbatches)
    k = in_flight(schedule, num_stages=s, microbatches=microbatches)
    mem = (ps[hi] - ps[lo]) + k[None, :] * (pa[hi] - pa[lo])
    if replicas > 1:
        bw, lat = _link(cm)
        ar = ring_allreduce_ms(pp_[hi] - pp_[lo], replicas=replicas, bandwidth=bw, latency_ms=lat)
        lead = np.zeros_like(bwd)
        if s > 1:
            lead[:, 1:] = np.cumsum(bwd[:, :-1] + comm, axis=1)
        tail = np.maximum((ar - lead).max(axis=1), 0.0)
    else:
        tail = np.zeros(len(cuts))
    return pipe, tail, mem.max(axis=1), np.asarray(mem)


def _neighbours(cuts: np.ndarray, n: int) -> list[tuple[int, ...]]:
    out = []
    for i in range(1, len(cuts) - 1):
        for d in (-2, -1, 1, 2):
            c = cuts.copy()
            c[i] += d
            if all(c[j] < c[j + 1] for j in range(len(c) - 1)) and 0 < c[i] < n:
                out.append(tuple(int(x) for x in c))
    return out


def evaluate_shape(
    costs: CostModel,
    *,
    dp: int,
    pp: int,
    schedule: str = "1f1b",
    microbatches: int,
    memory_bytes: float | None = None,
    max_exhaustive: int = 20000,
) -> ShapeChoice:
    """The best split of one shape for ``costs`` (one device row, at this shape's
    microbatch size)."""
    n = costs.num_layers
    cm = costs.for_devices(pp)
    limit = math.inf if memory_bytes is None else float(memory_bytes)
    kw = {"replicas": dp, "schedule": schedule, "microbatches": microbatches}
    exhaustive = math.comb(n - 1, pp - 1) <= max_exhaustive
    if exhaustive:
        cands = _cuts_all(n, pp)
    else:
        start = plan_partition(cm, num_stages=pp, schedule=schedule, microbatches=microbatches)
        cands = np.array([[0, *(b for _, b in start.bounds)]], int)
    best: tuple[float, np.ndarray] | None = None
    seen: set[tuple[int, ...]] = set()
    while True:
        pipe, tail, peak, _ = _score(cm, cands, **kw)
        total = np.where(peak <= limit, pipe + tail, np.inf)
        i = int(np.argmin(total))
        if best is None or total[i] < best[0] - 1e-12:
            best = (float(total[i]), cands[i])
        seen.update(tuple(int(x) for x in c) for c in cands)
        if exhaustive:
            break
        # Local search from the planner's split: one boundary move at a time.
        nxt = [c for c in _neighbours(best[1], n) if c not in seen]
        if not nxt:
            break
        cands = np.vstack([best[1][None], np.array(nxt, int)])
        if len(seen) > max_exhaustive:
            break
    cuts = best[1]
    pipe, tail, peak, _ = _score(cm, cuts[None], **kw)
    bounds = tuple(itertools.pairwise(int(x) for x in cuts))
    return ShapeChoice(
        dp=dp,
        pp=pp,
        bounds=bounds,
        microbatches=microbatches,
        microbatch_size=costs.microbatch_size,
        pipeline_ms=float(pipe[0]),
        reduce_ms=float(tail[0]),
        step_ms=float(pipe[0] + tail[0]),
        mem_bytes=int(peak[0]),
        fits=bool(peak[0] <= limit),
        candidates=len(seen),
    )


def choose_shape(
    costs_for: Callable[[int], CostModel],
    *,
    gpus: int,
    batch_size: int,
    num_layers: int,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    memory_bytes: float | None = None,
) -> list[ShapeChoice]:
    """Every shape of ``gpus`` GPUs with its best split, fastest fitting shape first.

    costs_for: the model's cost model (one device row) for a microbatch size.
    microbatches: per replica (default ``2 pp``, as ``dynpipe plan --stages`` uses).
    """
    if gpus < 1:
        raise PlanError(f"--gpus must be >= 1, got {gpus}")
    out = []
    for pp in range(1, gpus + 1):
        if gpus % pp:
            continue
        dp = gpus // pp
        m = microbatches or 2 * pp
        if pp > num_layers:
            note = f"{pp} stages exceed the model's {num_layers} layers"
        elif batch_size % (dp * m):
            note = f"batch {batch_size} does not split into {dp} x {m} microbatches"
        elif schedule == "1f1b" and m < pp:
            note = f"1F1B needs >= {pp} microbatches per replica"
        else:
            note = ""
        if note:
            out.append(
                ShapeChoice(dp, pp, (), m, 0, math.inf, math.inf, math.inf, fits=False, note=note)
            )
            continue
        cm = costs_for(batch_size // (dp * m))
        out.append(
            evaluate_shape(
                cm, dp=dp, pp=pp, schedule=schedule, microbatches=m, memory_bytes=memory_bytes
            )
        )
    return sorted(out, key=lambda c: (not c.fits, c.step_ms, c.pp))
