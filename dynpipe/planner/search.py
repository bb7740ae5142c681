"""Candidate search over partitions, scored by the simulator.

A partition ``P`` cannot take less than ``LB(P) = max_s M (F_s + B_s) + W_<s`` where ``W_<s``
is the least work its earlier stages can do: stage ``s`` cannot start its first forward
before microbatch 0 has passed them, and its last backward's gradient still has to go back
through them. Links give ``M c_s``. Once some partition scores ``B``, only partitions with
``LB(P) <= B`` can beat it; ``count`` counts those exactly (a backward DP) and ``every``
lists them (vectorised, stage by stage), so when they are few the search is exhaustive.
``improve`` is the fallback when they are many: steepest descent over boundary moves.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dynpipe.planner.problem import Problem

__all__ = ["Bounded", "bounded", "every", "improve"]

Scorer = Callable[[np.ndarray], np.ndarray]


class Bounded:
    """Per stage: furthest end ``his[s][i]`` and admissible ends ``good[s]``; the count."""

    def __init__(self, his: list[np.ndarray], good: list[np.ndarray], count: float) -> None:
        self.his, self.good, self.count = his, good, count


def bounded(prob: Problem, bound: float, limit: int) -> Bounded:
    """Partitions with ``LB(P) <= bound`` (within memory): tables and count (``> limit`` clips)."""
    n, m = prob.L, prob.M
    bound = bound * (1 + 1e-12)
    cnt = np.zeros(n + 1)
    cnt[n] = 1.0
    his: list[np.ndarray] = [np.zeros(0, int)] * prob.S
    good: list[np.ndarray] = [np.zeros(0, bool)] * prob.S
    i = np.arange(n + 1)
    for s in range(prob.S - 1, -1, -1):
        ok = prob.valid_end(s, bound / m) & (cnt > 0)
        good[s] = ok
        h = prob.hi(s, (bound - prob.Pmin[s]) / m)
        his[s] = h
        cs = np.concatenate([[0.0], np.cumsum(np.where(ok, cnt, 0.0))])
        # Clipping keeps sums exact while they are small; beyond the limit only "more" matters.
        cnt = np.where(h > i, cs[np.maximum(h, i) + 1] - cs[i + 1], 0.0)
        cnt = np.minimum(cnt, limit + 1)
    return Bounded(his, good, float(cnt[0]))


def every(prob: Problem, tables: Bounded) -> np.ndarray:
    """All partitions ``tables`` admits, as cuts ``[N, S + 1]``, built a stage at a time."""
    paths = np.zeros((1, 1), dtype=np.int64)
    for s in range(prob.S):
        start = paths[:, -1]
        ends = np.flatnonzero(tables.good[s])
        a = np.searchsorted(ends, start, side="right")
        b = np.searchsorted(ends, tables.his[s][start], side="right")
        cnt = np.maximum(b - a, 0)
        total = int(cnt.sum())
        rows = np.repeat(np.arange(len(paths)), cnt)
        pos = np.repeat(a, cnt) + np.arange(total) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        paths = np.hstack([paths[rows], ends[pos][:, None]])
    return paths


def improve(
    prob: Problem, cuts: np.ndarray, score: Scorer, *, budget: int, rounds: int = 50
) -> tuple[np.ndarray, float, int]:
    """Steepest descent from ``cuts`` moving one boundary by ±1, ±2, ±4, … layers.

    Stops at a local optimum, after ``rounds`` moves, or when ``budget`` candidate
    evaluations are spent; returns the cuts, their score and the evaluations used.
    """
    cur = np.asarray(cuts, dtype=np.int64)
    best = float(score(cur[None])[0])
    if prob.S == 1:
        return cur, best, 1
    steps = [1]
    # Step sizes up to the mean stage length, fewer if a round would not fit the budget.
    while (
        steps[-1] * 2 <= max(1, prob.L // prob.S) and 4 * (prob.S - 1) * len(steps) <= budget // 4
    ):
        steps.append(steps[-1] * 2)
    deltas = np.array(steps + [-d for d in steps])
    ks = np.arange(1, prob.S)
    k_rep = np.repeat(ks, len(deltas))
    d_rep = np.tile(deltas, len(ks))
    used = 1
    for _ in range(rounds):
        if used + len(k_rep) > budget:
            break
        nb = np.repeat(cur[None], len(k_rep), axis=0)
        nb[np.arange(len(k_rep)), k_rep] += d_rep
        nb = nb[np.all(np.diff(nb, axis=1) > 0, axis=1)]
        if not len(nb):
            break
        sc = score(nb)
        used += len(nb)
        k = int(np.argmin(sc))
        if not sc[k] < best * (1 - 1e-12):
            break
        cur, best = nb[k], float(sc[k])
    return cur, best, used
