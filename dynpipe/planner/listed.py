"""The split ``plan_partition`` chooses, found by scoring every split when there are few.

``plan_partition`` bounds and searches, which costs a few milliseconds of host time whatever
the size of the problem (2-5 ms for 16 layers on 2 stages). A pipeline of a few stages over
a few dozen layers has only ``C(L - 1, S - 1)`` splits (15 for 16 layers on 2 stages, one on
one stage): scoring all of them in one vectorised simulator call takes a fraction of that,
and gives the same split. On such a problem ``plan_partition``'s search is exhaustive: it
scores every split whose lower bound is within its best score (every other split scores
more), listed in lexicographic order, and keeps the least score, ties going to less
migration, then the smaller bottleneck, then the earlier split. Here every split is listed
in the same order and priced by the same ``Problem`` and ``step_times``, and the same key
picks among them, so the choice is the same split, ties included. Larger problems, and
infeasible ones (whose error ``plan_partition`` words), go to ``plan_partition``.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np

from dynpipe.planner.costs import CostModel
from dynpipe.planner.dp import plan_partition
from dynpipe.planner.evaluate import in_flight
from dynpipe.planner.problem import INF, Problem, memory_limits
from dynpipe.planner.simulate import step_times

__all__ = ["best_bounds"]

# Splits scored at once at most: beyond this ``plan_partition``'s search is cheaper.
MAX_LISTED = 4096


def best_bounds(
    costs: CostModel,
    *,
    num_stages: int,
    schedule: str = "1f1b",
    microbatches: int = 4,
    memory_bytes: float | Sequence[float] | None = None,
) -> tuple[tuple[int, int], ...]:
    """``plan_partition(costs, ...).bounds`` (no current plan: no migration cost)."""
    n = costs.num_layers
    if not 1 <= num_stages <= n or _splits(n, num_stages) > _limit(num_stages, microbatches):
        return _planned(costs, num_stages, schedule, microbatches, memory_bytes)
    if num_stages == 1 and _fits_one(costs, schedule, microbatches, memory_bytes):
        return ((0, n),)  # the one split, within memory as ``Problem`` reads it
    prob = Problem(
        costs.for_devices(num_stages),
        num_stages=num_stages,
        schedule=schedule,
        microbatches=microbatches,
        memory=memory_limits(memory_bytes, num_stages),
    )
    cuts = _every_split(n, num_stages)
    m = prob.metrics(cuts)
    s, a, b = np.arange(num_stages), cuts[:, :-1], cuts[:, 1:]
    # The ranges ``plan_partition`` lists: within memory as its search tables read it (the
    # furthest end from each start), besides ``metrics``' own check.
    listed = m["fits"] & np.all(b <= prob.hi_mem[s, a], axis=1)
    if not listed.any():
        return _planned(costs, num_stages, schedule, microbatches, memory_bytes)
    step = step_times(m["fwd"], m["bwd"], m["comm"], schedule=schedule, microbatches=microbatches)
    sc = np.where(listed, step + m["mig"], INF)
    k = int(np.lexsort((np.arange(len(cuts)), m["bottleneck"], m["mig"], sc))[0])
    return tuple((int(x), int(y)) for x, y in itertools.pairwise(cuts[k]))


def _planned(
    costs: CostModel,
    num_stages: int,
    schedule: str,
    microbatches: int,
    memory_bytes: float | Sequence[float] | None,
) -> tuple[tuple[int, int], ...]:
    res = plan_partition(
        costs,
        num_stages=num_stages,
        schedule=schedule,
        microbatches=microbatches,
        memory_bytes=memory_bytes,
    )
    return tuple((int(x), int(y)) for x, y in res.bounds)


def _fits_one(
    costs: CostModel,
    schedule: str,
    microbatches: int,
    memory_bytes: float | Sequence[float] | None,
) -> bool:
    """Whether one stage holding every layer fits its memory, computed as ``Problem`` does
    (its prefix sums of static and in-flight bytes against the limit)."""
    if memory_bytes is None:
        return True
    lim = float(memory_limits(memory_bytes, 1)[0])
    k = in_flight(schedule, num_stages=1, microbatches=microbatches)
    ws = np.concatenate([[0.0], np.cumsum(costs.static_bytes)])
    wa = np.concatenate([[0.0], np.cumsum(costs.act_bytes)])
    q = ws + k[0] * wa
    return bool(q[-1] - q[0] <= lim and q[-1] <= q[0] + lim)


def _splits(n: int, s: int) -> int:
    return math.comb(n - 1, s - 1)


def _limit(num_stages: int, microbatches: int) -> int:
    """Splits listed at most: ``MAX_LISTED``, and no more than ``plan_partition`` would
    simulate exhaustively with its default budget (so it would be exhaustive too)."""
    per = 2 * microbatches * num_stages
    return min(MAX_LISTED, max(16, min(20000, int(2e7 // per))))


@functools.lru_cache(maxsize=64)
def _every_split(n: int, s: int) -> np.ndarray:
    """Every split of ``n`` layers into ``s`` stages as cuts ``[N, s + 1]``, lexicographic."""
    combos = list(itertools.combinations(range(1, n), s - 1))
    inner = np.array(combos, dtype=np.int64).reshape(len(combos), s - 1)
    out = np.empty((len(inner), s + 1), dtype=np.int64)
    out[:, 0], out[:, -1], out[:, 1:-1] = 0, n, inner
    out.setflags(write=False)
    return out
