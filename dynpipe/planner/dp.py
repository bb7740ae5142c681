"""Exact contiguous partitioning of ``L`` layers into ``S`` pipeline stages.

Stage ``s`` runs on device ``s`` with that device's own per-layer times. A partition ``P``
costs, per microbatch, ``T(P) = max(max_s F_s + B_s, max_s c_s)``: the busiest stage or the
busiest boundary link (``c_s`` = activation bytes / bandwidth + latency). Every stage runs
``M`` forwards and ``M`` backwards and every link carries ``M`` transfers each way, so
``step(P) >= M * T(P)`` for either schedule. The planner uses that bound twice:

1. **Bottleneck.** ``T* = min_P T(P)`` exactly, by parametric search: for a cap ``T`` a
   vectorised reachability pass over prefix sums (``O(S L log L)``) decides whether some
   partition has ``T(P) <= T`` within every device's memory; bisection on ``T`` then
   converges to ``T*`` and the partition that attains it.
2. **Step time.** Candidates near ``T*`` — for a few caps ``T >= T*``, the partition with the
   least total work, transfer and migration cost under that cap (a windowed min-sum DP with
   sparse-table range minima) — are scored by the event simulator (``step_times``). With the
   best score ``B`` found, only partitions whose lower bound (``search``) is ``<= B`` can
   still win; when those are few (counted exactly by a backward DP) they are all listed and
   simulated, which makes the answer the exact optimum of simulated step time plus
   migration cost (``PartitionResult.exhaustive``). When they are many, steepest descent
   over boundary moves improves the best candidate first, which usually shrinks them enough.

Memory: stage ``s`` holds its layers' parameters, gradients, optimizer state and buffers
plus the activations of the microbatches in flight (``in_flight``); a range is admissible
only if that fits the device. An infeasible problem raises ``PlanError`` saying what fits.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dynpipe.planner.costs import CostModel
from dynpipe.planner.plan import Plan, PlanError
from dynpipe.planner.problem import INF, Problem, memory_limits, range_min
from dynpipe.planner.search import bounded, every, improve
from dynpipe.planner.simulate import step_times

__all__ = ["PartitionResult", "memory_limits", "plan_partition", "solve_bottleneck"]


@dataclass(frozen=True)
class PartitionResult:
    """The chosen partition and how it was found.

    bottleneck_ms: ``T(P)`` of the chosen partition; ``optimal_bottleneck_ms`` is ``T*`` (with
        ``costs.recompute``, a lower bound on it: ``T*`` of the layers without re-forwards).
    score_ms: simulated step time plus migration cost — what was minimised.
    exhaustive: every partition that could beat the choice was simulated, so the choice is
        the exact optimum of ``score_ms``.
    """

    bounds: tuple[tuple[int, int], ...]
    bottleneck_ms: float
    optimal_bottleneck_ms: float
    step_ms: float
    migration_ms: float
    migration_bytes: int
    score_ms: float
    candidates: int
    exhaustive: bool
    solve_ms: float
    # Per stage, the layers it recomputes (global indices; ``costs.recompute``).
    recompute: tuple[tuple[int, ...], ...] = ()

    def __repr__(self) -> str:
        parts = " ".join(f"[{a}:{b})" for a, b in self.bounds)
        return (
            f"PartitionResult({parts} step={self.step_ms:.4g}ms T={self.bottleneck_ms:.4g}ms "
            f"T*={self.optimal_bottleneck_ms:.4g}ms cand={self.candidates} "
            f"exact={self.exhaustive} {self.solve_ms:.1f}ms)"
        )


def _values_in(prob: Problem, lo: float, hi: float, limit: int) -> np.ndarray | None:
    """Every stage or link cost in ``(lo, hi]``, or ``None`` if there are more than ``limit``."""
    parts, total = [], 0
    for s in range(prob.S):
        p = prob.P[s]
        a = np.searchsorted(p, p + lo, side="right")
        cnt = np.searchsorted(p, p + hi, side="right") - a
        n = int(cnt.sum())
        total += n
        if total > limit:
            return None
        # Ends j of every start i whose range cost lies in (lo, hi]: a[i], a[i] + 1, ...
        i = np.repeat(np.arange(len(p)), cnt)
        j = np.repeat(a, cnt) + np.arange(n) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        parts.append(p[j] - p[i])
    if prob.S > 1:
        c = prob.C[np.isfinite(prob.C)]
        parts.append(c[(c > lo) & (c <= hi)])
    vals = np.unique(np.concatenate(parts)) if parts else np.zeros(0)
    return vals if len(vals) <= limit else None


def _bisect(prob: Problem) -> tuple[float, list[int]]:
    """Exact ``T*`` and a partition attaining it (memory already known feasible).

    Bisection on the cap narrows ``(lo, hi]`` until it holds few distinct stage or link
    costs; those are then listed and searched, so ``T*`` is a realised cost, not a float
    within a tolerance of it.
    """
    w = prob.P[:, 1:] - prob.P[:, :-1]
    lo = float(max(w.min(axis=0).max(), w.min(axis=0).sum() / prob.S))
    hi = float(prob.P[:, -1].max() + (prob.C[np.isfinite(prob.C)].max() if prob.S > 1 else 0.0))
    hi = max(hi, lo)
    eps = 1 + 1e-12  # a cap equal to a cost must admit it despite rounding in the sums
    if prob.feasible(lo * eps):
        hi = lo
    else:
        for it in range(200):
            if it % 4 == 3 or hi - lo <= 1e-9 * hi:
                vals = _values_in(prob, lo, hi, 64)
                if vals is not None:
                    a, b = 0, len(vals)  # T* is vals[k] for the first feasible k (or hi)
                    while a < b:
                        mid_k = (a + b) // 2
                        if prob.feasible(float(vals[mid_k]) * eps):
                            b = mid_k
                        else:
                            a = mid_k + 1
                    hi = float(vals[a]) if a < len(vals) else hi
                    break
            mid = 0.5 * (lo + hi)
            if not lo < mid < hi:
                break
            if prob.feasible(mid):
                hi = mid
            else:
                lo = mid
    cap = hi * eps
    cuts = prob.backtrack(cap, prob.reach(cap))
    t = float(prob.metrics(np.array([cuts]))["bottleneck"][0])
    if prob.costs.recompute != "none":
        # The caps price layers without their re-forwards: ``hi`` is a lower bound on T*,
        # and this partition's own bottleneck (with them) may not be the least.
        t = min(t, hi)
    return t, cuts


def _min_sum(prob: Problem, cap: float) -> list[int] | None:
    """Under ``T(P) <= cap``: the partition of least work + 2 x transfer + migration."""
    n = prob.L
    best = np.full(n + 1, INF)
    best[0] = 0.0
    args = []
    j = np.arange(n + 1)
    for s in range(prob.S):
        p, g = prob.P[s], prob.G[s]
        if cap == INF:
            lo_t = np.zeros(n + 1, dtype=int)
        else:
            lo_t = np.searchsorted(p, p - cap, side="left")
        lo = np.maximum(lo_t, prob.lo_mem[s])
        rm, ra = range_min(best - p - g, lo, j - 1)
        new = rm + p + g
        if s < prob.S - 1:
            new = new + 2.0 * np.where(np.isfinite(prob.C[s]), prob.C[s], 0.0)
        new[~prob.valid_end(s, cap)] = INF
        args.append(ra)
        best = new
    if not np.isfinite(best[n]):
        return None
    cuts = [n]
    for s in range(prob.S - 1, -1, -1):
        cuts.append(int(args[s][cuts[-1]]))
    return cuts[::-1]


def _migration(
    costs: CostModel,
    current: Plan | None,
    ranks: Sequence[int],
    ms_per_byte: float,
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Prefix ``G[s, j]`` of migration ms if stage ``s`` takes layers ``[0, j)``; bytes too."""
    if current is None or ms_per_byte <= 0:
        return None, None
    n = costs.num_layers
    if current.num_layers != n:
        raise PlanError(
            f"current plan has {current.num_layers} layers but the cost model has {n}; "
            "migration cost needs a plan of the same model"
        )
    owner = np.empty(n, dtype=int)
    for st in current.stages:
        owner[st.start : st.stop] = st.rank
    state = costs.state_bytes
    moved = np.where(owner[None, :] != np.asarray(ranks)[:, None], state[None, :], 0.0)
    z = np.zeros((len(ranks), 1))
    gb = np.hstack([z, np.cumsum(moved, axis=1)])
    return gb * ms_per_byte, gb


def _infeasible(prob: Problem) -> PlanError:
    """What would fit: the least per-device memory, fewer microbatches, another schedule."""
    cm, lim = prob.costs, prob.lim
    probe = Problem.__new__(Problem)
    probe.__dict__.update(prob.__dict__)
    lo, hi = 0.0, float(prob.Q[:, -1].max()) + 1.0
    while hi - lo > 1e-4 * hi:
        mid = 0.5 * (lo + hi)
        probe.set_memory(np.full(prob.S, mid))
        lo, hi = (lo, mid) if probe.feasible(INF) else (mid, hi)
    limits = sorted({round(float(x) / 1024**3, 2) for x in lim})
    need = math.ceil(hi / 1024**3 * 100) / 100
    fixes = [f"raise --memory-gb to {need:g}"]
    if prob.S < prob.L:
        fixes.append("use more stages")
    # Fewer microbatches of the same size keep fewer activations (a smaller global batch);
    # 1F1B holds min(M, S - s) of them, so only M < S can lower its peak.
    top = prob.M - 1 if prob.schedule == "gpipe" else min(prob.M - 1, prob.S - 1)
    for m in range(top, 0, -1):
        probe.set_memory(lim, m)
        if probe.feasible(INF):
            fixes.append(
                f"use at most {m} microbatch{'es' if m > 1 else ''} of {cm.microbatch_size} samples"
            )
            break
    if prob.schedule == "gpipe":
        fixes.append("use --schedule 1f1b (fewer activations in flight)")
    return PlanError(
        f"{cm.model} does not fit {prob.S} stages within {'/'.join(f'{x:g}' for x in limits)} "
        f"GiB per device ({prob.schedule}, {prob.M} microbatches): the best split needs "
        f"{need:g} GiB on its fullest device; " + ", or ".join(fixes)
    )


def _over_memory(prob: Problem, cuts: Sequence[int]) -> PlanError:
    """Even the layers recomputed that can be, some stage of the best split is over its
    device's memory: needed against available per stage, and what to lower."""
    cm = prob.costs
    parts = []
    for s in range(prob.S):
        r = prob.recompute(s, int(cuts[s]), int(cuts[s + 1]))
        parts.append(f"stage {s} {r.peak_bytes / 1024**3:.3g}/{prob.lim[s] / 1024**3:.3g}")
    return PlanError(
        f"{cm.model} does not fit {prob.S} stages even recomputing activations (--recompute "
        f"{cm.recompute}): needed/available GiB {', '.join(parts)}; lower --batch-size (or "
        f"raise --microbatches: {cm.microbatch_size} samples a microbatch now), use more "
        "stages, or raise --memory-gb if the devices have more"
    )


def solve_bottleneck(
    costs: CostModel,
    *,
    num_stages: int,
    schedule: str = "1f1b",
    microbatches: int = 4,
    memory_bytes: float | Sequence[float] | None = None,
) -> tuple[float, tuple[tuple[int, int], ...]]:
    """Exact ``T* = min_P T(P)`` and one partition attaining it, within memory."""
    prob = Problem(
        costs,
        num_stages=num_stages,
        schedule=schedule,
        microbatches=microbatches,
        memory=memory_limits(memory_bytes, num_stages),
    )
    if not prob.feasible(INF):
        raise _infeasible(prob)
    t, cuts = _bisect(prob)
    return t, tuple(itertools.pairwise(cuts))


def plan_partition(
    costs: CostModel,
    *,
    num_stages: int,
    schedule: str = "1f1b",
    microbatches: int = 4,
    memory_bytes: float | Sequence[float] | None = None,
    current: Plan | None = None,
    migration_ms_per_byte: float = 0.0,
    ranks: Sequence[int] | None = None,
    caps: int = 6,
    sim_budget: float = 2e7,
    max_exhaustive: int = 20000,
) -> PartitionResult:
    """The partition minimising simulated step time (+ migration cost from ``current``).

    migration_ms_per_byte: what moving one byte of layer state costs, amortised per step
        (e.g. ``1e3 / bandwidth / steps_until_next_replan``); layers whose owner rank
        changes from ``current`` pay it, so a tiny gain does not move half the model.
    caps: how many caps between ``T*`` and the pruning bound feed min-sum candidates.
    sim_budget: simulated actions (candidates x 2 M S) each search phase may spend; bounds
        how many candidates an exhaustive search may list (at most ``max_exhaustive``) and
        how far descent may go.
    """
    t0 = time.perf_counter()
    ranks = list(range(num_stages)) if ranks is None else list(ranks)
    if len(ranks) != num_stages:
        raise PlanError(f"{num_stages} stages but {len(ranks)} ranks given; give one each")
    cm = costs.for_devices(num_stages)
    g, gbytes = _migration(cm, current, ranks, migration_ms_per_byte)
    prob = Problem(
        cm,
        num_stages=num_stages,
        schedule=schedule,
        microbatches=microbatches,
        memory=memory_limits(memory_bytes, num_stages),
        migration=g,
    )
    if not prob.feasible(INF):
        raise _infeasible(prob)
    t_star, cuts0 = _bisect(prob)
    per_candidate = 2 * microbatches * num_stages
    limit = max(16, min(max_exhaustive, int(sim_budget // per_candidate)))

    def score(cands: np.ndarray) -> np.ndarray:
        m = prob.metrics(cands)
        step = step_times(
            m["fwd"], m["bwd"], m["comm"], schedule=schedule, microbatches=microbatches
        )
        return np.where(m["fits"], step + m["mig"], INF)

    pool: dict[tuple[int, ...], None] = {tuple(cuts0): None}
    bound = float(score(np.array([cuts0]))[0])
    # Min-sum candidates under caps from T* up to the pruning bound, denser near T*.
    fracs = [0.0] + [2.0 ** -(caps - 2 - i) for i in range(caps - 1)]
    for f in fracs:
        cap = t_star + f * max(bound / microbatches - t_star, 0.0)
        c = _min_sum(prob, cap * (1 + 1e-12))
        if c is not None:
            pool.setdefault(tuple(c), None)
    cands = np.array(list(pool), dtype=np.int64)
    sc = score(cands)
    best_cuts, best = cands[int(np.argmin(sc))], float(sc.min())
    if not np.isfinite(best) and cm.recompute != "none":
        raise _over_memory(prob, cuts0)
    tables = bounded(prob, best, limit)
    exhaustive = tables.count <= limit
    if not exhaustive:
        best_cuts, best, _ = improve(prob, best_cuts, score, budget=limit)
        cands = np.vstack([cands, best_cuts[None]])
        tables = bounded(prob, best, limit)
        exhaustive = tables.count <= limit
    if exhaustive:
        cands = every(prob, tables)
        assert len(cands) == int(tables.count), (len(cands), tables.count)
    m = prob.metrics(cands)
    step = step_times(m["fwd"], m["bwd"], m["comm"], schedule=schedule, microbatches=microbatches)
    sc = np.where(m["fits"], step + m["mig"], INF)
    # Ties: less migration, then the smaller bottleneck, then the earlier candidate.
    k = int(np.lexsort((np.arange(len(cands)), m["bottleneck"], m["mig"], sc))[0])
    cuts = [int(x) for x in cands[k]]
    moved = 0
    if gbytes is not None:
        st = np.arange(num_stages)
        moved = int((gbytes[st, cuts[1:]] - gbytes[st, cuts[:-1]]).sum())
    return PartitionResult(
        bounds=tuple(itertools.pairwise(cuts)),
        bottleneck_ms=float(m["bottleneck"][k]),
        optimal_bottleneck_ms=t_star,
        step_ms=float(step[k]),
        migration_ms=float(m["mig"][k]),
        migration_bytes=moved,
        score_ms=float(sc[k]),
        candidates=len(cands),
        exhaustive=bool(exhaustive),
        solve_ms=(time.perf_counter() - t0) * 1e3,
        recompute=tuple(prob.recompute(s, cuts[s], cuts[s + 1]).layers for s in range(num_stages))
        if cm.recompute != "none"
        else (),
    )
