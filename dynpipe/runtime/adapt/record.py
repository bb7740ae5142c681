"""What the run has measured of its own plans and moves (plain data).

``PlanMemory`` keeps the measured step time of every plan the run has held, with the regime
of conditions it ran under (``CostEstimates.regime``). A measured step time outranks the
speed model: a plan measured clearly faster under the same conditions is moved back to. This
one rule, with the verdict on each move, replaces the undo, the ban on refuted moves and the
probes a stage-time model needed.

``MoveRecord`` is one move from decision to verdict, owned by the policy that decided it:
the loop that applies the move only fills in what the move cost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

__all__ = ["Bounds", "MoveRecord", "PlanMemory", "as_bounds"]

Bounds = tuple[tuple[int, int], ...]


def as_bounds(bounds: Sequence[Sequence[int]]) -> Bounds:
    """A plan's ranges as the hashable tuples plans are keyed by (from lists, as JSON has
    them)."""
    return tuple((int(a), int(b)) for a, b in bounds)


K = TypeVar("K", bound=Hashable)


class PlanMemory(Generic[K]):
    """Measured median step time per window of each plan held, with its regime.

    A plan is named by ``key`` of what ``add`` is given: its bounds by default; the replica
    policy names a configuration (split, batch shares) by itself."""

    def __init__(self, *, keep: int = 256, key: Callable[[Any], K] = as_bounds) -> None:
        self.keep, self._key = keep, key
        self.entries: list[tuple[K, int, float]] = []

    def add(self, plan: Any, regime: int, step_ms: float) -> None:
        self.entries.append((self._key(plan), int(regime), float(step_ms)))
        self.entries = self.entries[-self.keep :]

    def _pick(self, regime: int | None, last: int | None) -> list[tuple[K, int, float]]:
        # The regime's own last windows, however long ago: conditions that come back (an
        # interferer gone) bring back what was measured under them.
        entries = [e for e in self.entries if regime is None or e[1] == regime]
        return entries[-last:] if last else entries

    def measured(self, plan: Any, regime: int | None, *, last: int | None = None) -> float | None:
        """Median step time of ``plan`` over its windows in ``regime`` (None: any), among
        the ``last`` windows recorded in that regime (None: all)."""
        key = self._key(plan)
        ms = [t for b, _, t in self._pick(regime, last) if b == key]
        return float(np.median(ms)) if ms else None

    def count(self, plan: Any, regime: int | None, *, last: int | None = None) -> int:
        """Windows of ``plan`` in ``regime`` among the ``last`` recorded in that regime."""
        key = self._key(plan)
        return sum(1 for b, _, _ in self._pick(regime, last) if b == key)

    def noise(self, regime: int | None, *, last: int | None = None) -> float:
        """Relative standard deviation of one window's median step in ``regime`` about its
        plan's median (robust, pooled over the plans held for two windows or more; 0 while
        fewer than four such windows are known): how far one window strays by itself."""
        by: dict[K, list[float]] = {}
        for b, _, t in self._pick(regime, last):
            by.setdefault(b, []).append(float(np.log(max(t, 1e-12))))
        res = [x - float(np.median(xs)) for xs in by.values() if len(xs) >= 2 for x in xs]
        if len(res) < 4:
            return 0.0
        return 1.4826 * float(np.median(np.abs(res)))

    def best(
        self,
        regime: int | None,
        *,
        last: int | None = None,
        allow: Callable[[K], bool] | None = None,
    ) -> tuple[K, float] | None:
        """The plan measured fastest in ``regime`` (None: any) among the ``last`` windows
        recorded in that regime, and its step time; ``allow``: only plans it accepts."""
        plans = {b for b, _, _ in self._pick(regime, last) if allow is None or allow(b)}
        scored = [(b, self.measured(b, regime, last=last)) for b in plans]
        scored = [(b, t) for b, t in scored if t is not None]
        return min(scored, key=lambda x: x[1]) if scored else None

    def faster(
        self,
        plan: Any,
        here: float,
        regime: int,
        *,
        last: int,
        window_noise: float,
        here_windows: int | None = None,
        allow: Callable[[K], bool] | None = None,
    ) -> tuple[K, float] | None:
        """The plan measured fastest in ``regime`` (among its ``last`` windows) and its step
        time, if it beats ``here``, ``plan``'s step time, beyond three standard errors of
        the two plans' difference: each plan's median over its windows (``here_windows``
        for ``plan`` if given), one window's spread from the memory (``noise``) or from
        the spread of the current window's steps (``window_noise``: ``Window.step_noise``),
        whichever is more. Two measurements of one regime need only beat their own noise;
        what a move costs is the caller's to weigh."""
        best = self.best(regime, last=last, allow=allow)
        if best is None or best[0] == self._key(plan) or best[1] >= here:
            return None
        one = max(self.noise(regime, last=last), window_noise)
        n_a = here_windows or max(1, self.count(plan, regime, last=last))
        n_b = max(1, self.count(best[0], regime, last=last))
        if np.log(here / best[1]) <= 3.0 * one * float(np.sqrt(1.0 / n_a + 1.0 / n_b)):
            return None
        return best

    def state(self) -> list:
        # Bounds as lists (JSON); a memory keyed otherwise is saved by its owner.
        rows: list[Any] = self.entries
        return [[[list(r) for r in b], g, t] for b, g, t in rows]

    def load_state(self, entries: list) -> None:
        self.entries = [(self._key(b), int(g), float(t)) for b, g, t in entries]


@dataclass
class MoveRecord:
    """One move: why it was made, what it cost, and how it did as measured.

    step: the first step under the new plan. before_ms: median step of the window that
    decided it; predicted_ms: the speed model's step time under the new plan (on the same
    scale as its prediction for the old one, ``model_before_ms``). slowdown: per-device
    slowdowns when decided; regime: the conditions' regime then; model: proposed by the speed
    model (False: chosen by measured step times alone); returns_to: the earlier regime whose
    plan the move returns to, its devices reading as they ran then (None: not a return);
    before_noise: the relative standard
    error of ``before_ms`` (``Window.step_noise``). verdict: ``faster`` /
    ``no better`` / ``slower`` when the window after it ran in the same regime, else
    ``conditions changed`` (an onset or an end between the two windows says nothing about
    the move).
    """

    step: int
    src: Bounds
    dst: Bounds
    reason: str
    before_ms: float
    model_before_ms: float
    predicted_ms: float
    slowdown: tuple[float, ...]
    regime: int = 0
    model: bool = True
    returns_to: int | None = None
    before_noise: float = 0.0
    pause_ms: float | None = None
    moved_bytes: int | None = None
    after_ms: float | None = None
    after_slowdown: tuple[float, ...] | None = None
    verdict: str | None = None

    def noise(self, after_noise: float) -> float:
        """How much of a before/after difference two windows' noise could make (relative:
        three standard errors of their difference)."""
        return 3.0 * float(np.hypot(self.before_noise, after_noise))

    def judge(
        self,
        after_ms: float,
        slow: Sequence[float],
        *,
        regime: int,
        tol: float,
        after_noise: float = 0.0,
    ) -> str:
        """Record the first trusted window after the move and return the verdict. A
        difference counts only beyond ``tol`` and beyond what the two windows' noise could
        make (``after_noise``: the after window's ``Window.step_noise``)."""
        self.after_ms, self.after_slowdown = float(after_ms), tuple(float(x) for x in slow)
        tol = max(tol, self.noise(after_noise))
        if regime != self.regime:
            self.verdict = "conditions changed"
        elif after_ms > self.before_ms * (1 + tol):
            self.verdict = "slower"
        elif after_ms < self.before_ms * (1 - tol / 2):
            self.verdict = "faster"
        else:
            self.verdict = "no better"
        return self.verdict

    @property
    def predicted_gain(self) -> float:
        return 1.0 - self.predicted_ms / max(self.model_before_ms, 1e-9)

    @property
    def achieved_gain(self) -> float | None:
        if self.after_ms is None:
            return None
        return 1.0 - self.after_ms / max(self.before_ms, 1e-9)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["src"], d["dst"] = [list(b) for b in self.src], [list(b) for b in self.dst]
        d["predicted_gain"] = round(self.predicted_gain, 4)
        ag = self.achieved_gain
        d["achieved_gain"] = None if ag is None else round(ag, 4)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MoveRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["src"], kw["dst"] = as_bounds(kw["src"]), as_bounds(kw["dst"])
        for k in ("slowdown", "after_slowdown"):
            if kw.get(k) is not None:
                kw[k] = tuple(kw[k])
        return cls(**kw)
