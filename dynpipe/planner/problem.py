"""One planning instance as prefix-sum arrays, shared by the DP and the candidate search.

Every cost of a stage on a layer range is a difference of two prefix sums, so any range is
priced in O(1) and whole families of ranges in one numpy call. The meaning of each cost is
the same as ``evaluate.stage_costs`` (tested equal).
"""

from __future__ import annotations

import numpy as np

from dynpipe.planner.costs import CostModel, host_factor
from dynpipe.planner.evaluate import in_flight, memory_limits
from dynpipe.planner.plan import PlanError
from dynpipe.planner.recompute import Recompute, choose_recompute, kept_bytes

__all__ = ["INF", "Problem", "memory_limits", "range_min"]

INF = np.inf


def range_min(val: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Min and argmin of ``val[lo[q] : hi[q] + 1]`` for every query ``q`` (sparse table).

    Empty ranges (``hi < lo``) give ``(inf, -1)``. Ties go to the smaller index.
    """
    n = len(val)
    levels = max(1, int(n).bit_length())
    # tab_v[k, i] = min of val[i : i + 2**k] (inf past the end), tab_i its argmin.
    tab_v = np.full((levels, n), INF)
    tab_i = np.zeros((levels, n), dtype=np.int64)
    tab_v[0] = val
    tab_i[0] = np.arange(n)
    span = 1
    for k in range(1, levels):
        a, b = tab_v[k - 1, : n - span], tab_v[k - 1, span:]
        take_b = b < a
        tab_v[k, : n - span] = np.where(take_b, b, a)
        tab_i[k, : n - span] = np.where(take_b, tab_i[k - 1, span:], tab_i[k - 1, : n - span])
        span *= 2
    length = hi - lo + 1
    ok = length >= 1
    k = np.zeros(len(lo), dtype=np.int64)
    k[ok] = np.log2(length[ok]).astype(np.int64)
    a = np.where(ok, lo, 0)
    b = np.where(ok, hi - (1 << k) + 1, 0)
    va, vb = tab_v[k, a], tab_v[k, b]
    take_b = vb < va
    out_v = np.where(ok, np.where(take_b, vb, va), INF)
    out_i = np.where(ok, np.where(take_b, tab_i[k, b], tab_i[k, a]), -1)
    return out_v, out_i


class Problem:
    """Prefix sums of one instance: ``S`` stages on the ``S`` devices of ``costs``.

    P[s, j]: forward + backward ms of layers ``[0, j)`` on device ``s`` (Pf, Pb apart).
    Hf, Hb: the host's issue times the same way, or None (``CostModel.host_fwd_ms``); they
        enter only the scored metrics, never the pruning bounds.
    C[s, j]: ms to move the activation of a boundary after layer ``j - 1`` over link ``s``
        (``inf`` where no boundary can be: ``j = 0`` and ``j = L``).
    Q[s, j]: bytes layers ``[0, j)`` would occupy on stage ``s`` (static + in-flight).
    G[s, j]: migration ms if stage ``s`` took layers ``[0, j)``.
    """

    def __init__(
        self,
        costs: CostModel,
        *,
        num_stages: int,
        schedule: str,
        microbatches: int,
        memory: np.ndarray,
        migration: np.ndarray | None = None,
    ) -> None:
        cm = costs.for_devices(num_stages)
        n, s = cm.num_layers, num_stages
        if s < 1 or s > n:
            raise PlanError(
                f"cannot split {cm.model} ({n} layers) into {s} stages; use 1–{n} stages"
            )
        self.L, self.S, self.M, self.schedule, self.costs = n, s, microbatches, schedule, cm
        z = np.zeros((s, 1))
        self.Pf = np.hstack([z, np.cumsum(cm.fwd_ms, axis=1)])
        self.Pb = np.hstack([z, np.cumsum(cm.bwd_ms, axis=1)])
        self.P = self.Pf + self.Pb
        self.Hf = self.Hb = None
        if cm.host_fwd_ms is not None and cm.host_bwd_ms is not None:
            self.Hf = np.hstack([z, np.cumsum(cm.host_fwd_ms, axis=1)])
            self.Hb = np.hstack([z, np.cumsum(cm.host_bwd_ms, axis=1)])
        # Pmin[s, i]: least work layers [0, i) can cost on any of devices 0..s-1 — a lower
        # bound on the time before stage s can start its first forward plus finish backward.
        w = cm.fwd_ms + cm.bwd_ms
        cheapest = np.vstack([np.zeros((1, n)), np.minimum.accumulate(w, axis=0)[:-1]])
        self.Pmin = np.hstack([z, np.cumsum(cheapest, axis=1)])
        self.C = np.full((max(s - 1, 0), n + 1), INF)
        if s > 1:
            nb = cm.out_bytes[:-1]
            self.C[:, 1:n] = nb[None, :] / cm.bandwidth[:, None] * 1e3 + cm.latency_ms[:, None]
        self.Ws = np.concatenate([[0.0], np.cumsum(cm.static_bytes)])
        act = cm.act_bytes
        if cm.recompute != "none":
            # Every layer recomputed keeps the least: a lower bound on what a range needs
            # (the exact peak, with the chosen layers, is ``metrics``'s ``fits``).
            act = np.minimum(act, kept_bytes(cm))
        self.Wa = np.concatenate([[0.0], np.cumsum(act)])
        self._recompute: dict[tuple[int, int, int], Recompute] = {}
        self.G = np.zeros((s, n + 1)) if migration is None else migration
        self.set_memory(memory, microbatches)

    def set_memory(self, memory: np.ndarray, microbatches: int | None = None) -> None:
        """(Re)compute the memory-admissible ranges for limits ``memory`` and ``microbatches``."""
        if microbatches is not None:
            self.k = in_flight(self.schedule, num_stages=self.S, microbatches=microbatches)
            self.Q = self.Ws[None, :] + self.k[:, None] * self.Wa[None, :]
        self.lim = memory
        self._recompute = {}
        # hi_mem[s, i]: furthest end j with [i, j) in memory; lo_mem[s, j]: earliest start i.
        self.hi_mem = np.stack(
            [
                np.searchsorted(q, q + m, side="right") - 1
                for q, m in zip(self.Q, memory, strict=True)
            ]
        )
        self.lo_mem = np.stack(
            [np.searchsorted(q, q - m, side="left") for q, m in zip(self.Q, memory, strict=True)]
        )

    # ---- ranges admissible under a cap ----------------------------------------------------
    def hi(self, s: int, cap: float | np.ndarray) -> np.ndarray:
        """``hi[i]``: furthest end ``j`` with stage ``s`` on ``[i, j)`` costing ``<= cap``."""
        if np.isscalar(cap) and cap == INF:
            return self.hi_mem[s]
        h = np.searchsorted(self.P[s], self.P[s] + cap, side="right") - 1
        return np.minimum(h, self.hi_mem[s])

    def valid_end(self, s: int, cap: float) -> np.ndarray:
        """``ok[j]``: stage ``s`` may end at ``j`` (its link within ``cap``, room for the rest)."""
        n = self.L
        ok = np.zeros(n + 1, dtype=bool)
        if s == self.S - 1:
            ok[n] = True
            return ok
        last = n - (self.S - 1 - s)
        ok[s + 1 : last + 1] = self.C[s, s + 1 : last + 1] <= cap
        return ok

    def reach(self, cap: float) -> list[np.ndarray]:
        """``r[s][j]``: layers ``[0, j)`` fit stages ``0..s-1`` with every cost ``<= cap``."""
        n = self.L
        r = np.zeros(n + 1, dtype=bool)
        r[0] = True
        out = [r]
        idx = np.arange(1, n + 1)
        for s in range(self.S):
            # j is reachable iff some reachable i < j has hi(i) >= j.
            best = np.maximum.accumulate(np.where(r, self.hi(s, cap), -1))
            nr = np.zeros(n + 1, dtype=bool)
            nr[1:] = best[:-1] >= idx
            nr &= self.valid_end(s, cap)
            out.append(nr)
            r = nr
        return out

    def feasible(self, cap: float) -> bool:
        return bool(self.reach(cap)[-1][self.L])

    def backtrack(self, cap: float, reach: list[np.ndarray]) -> list[int]:
        """Cuts ``[0, ..., L]`` of a partition within ``cap`` (the latest start per stage)."""
        cuts = [self.L]
        j = self.L
        for s in range(self.S - 1, -1, -1):
            starts = np.flatnonzero(reach[s][:j] & (self.hi(s, cap)[:j] >= j))
            assert starts.size, "reachability lost its predecessor"
            j = int(starts[-1])
            cuts.append(j)
        return cuts[::-1]

    # ---- candidates, vectorised -----------------------------------------------------------
    def recompute(self, s: int, a: int, b: int) -> Recompute:
        """Stage ``s`` on layers ``[a, b)``: its recomputed layers (memoised per range)."""
        key = (s, a, b)
        got = self._recompute.get(key)
        if got is None:
            got = choose_recompute(
                self.costs, device=s, start=a, stop=b, in_flight=int(self.k[s]), limit=self.lim[s]
            )
            self._recompute[key] = got
        return got

    def _recomputed(self, cuts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``[C, S]`` re-forward ms each candidate's stages add, and whether all fit."""
        extra = np.zeros((len(cuts), self.S))
        fits = np.ones(len(cuts), dtype=bool)
        for c, row in enumerate(cuts.tolist()):
            for s in range(self.S):
                r = self.recompute(s, row[s], row[s + 1])
                extra[c, s] = r.extra_ms
                fits[c] &= r.fits
        return extra, fits

    def metrics(self, cuts: np.ndarray) -> dict[str, np.ndarray]:
        """Stage times, link times, memory and migration of candidates ``cuts[C, S + 1]``."""
        s = np.arange(self.S)
        a, b = cuts[:, :-1], cuts[:, 1:]
        # A stage's fixed overhead only adds to its layers' costs, so every bound the search
        # prunes with (built from layer costs alone) stays a lower bound: still exact. So do
        # recomputed layers' re-forwards, which only add to the backward.
        fwd = self.Pf[s, b] - self.Pf[s, a] + self.costs.stage_fwd_ms[None, :]
        bwd = self.Pb[s, b] - self.Pb[s, a] + self.costs.stage_bwd_ms[None, :]
        extra, rec_fits = None, None
        if self.costs.recompute != "none":
            extra, rec_fits = self._recomputed(cuts)
        if self.Hf is not None:
            # The host's issue time bounds a stage too (``CostModel.host_fwd_ms``: one total
            # for a microbatch's forward and backward); it only ever adds, so the bounds
            # below, built from the layers' device times, stay lower bounds and the search
            # stays exact.
            host = self.Hf[s, b] - self.Hf[s, a] + self.Hb[s, b] - self.Hb[s, a]
            k = host_factor(fwd + bwd, host)
            fwd, bwd = fwd * k, bwd * k
        if extra is not None:
            bwd = bwd + extra  # after the host's bound, as ``evaluate.stage_costs`` adds it
        comm = self.C[s[:-1], b[:, :-1]] if self.S > 1 else np.zeros((len(cuts), 0))
        fits = np.all(self.Q[s, b] - self.Q[s, a] <= self.lim, axis=1)
        if rec_fits is not None:
            fits = fits & rec_fits
        return {
            "fwd": fwd,
            "bwd": bwd,
            "comm": comm,
            "mig": (self.G[s, b] - self.G[s, a]).sum(axis=1),
            "fits": fits,
            "bottleneck": np.maximum((fwd + bwd).max(axis=1), comm.max(axis=1, initial=0.0)),
        }
