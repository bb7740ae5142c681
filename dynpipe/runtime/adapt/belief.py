"""The adaptation model's state: device slowdowns, plan step times, and the one move rule.

Everything here is plain data and pure functions over it (no windows, no planner), so the
state saves and restores exactly and the rule is the same for every candidate space.

- ``Device``: one device's log-slowdown ``s`` against its clean speed, a Gaussian
  (mean, variance) filtered once per window (a scalar Kalman update). Its observation noise
  is learned from its own innovations, so a device whose timers swing gets a wide noise and
  moves its belief little per window. A change of conditions is found by a two-sided CUSUM
  of the standardised innovations; it opens a new *segment* of that device (or returns to an
  earlier one whose level the reading matches: an interferer that left).
- ``PlanStat``: per (segment, plan), what the windows measured under that plan read: the
  mean log step time, its count and the learned window-to-window noise.
- ``move_lcb``: the rule. Move iff the lower confidence bound of
  ``horizon * (T_now - T_candidate) - pause`` is positive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Device", "PlanStat", "combine", "move_lcb", "z_of"]

# A fresh segment's level is unknown: this variance (log units; a factor of e either way)
# lets its first reading set it.
_OPEN = 1.0


@dataclass
class Device:
    """One device's log-slowdown belief (see the module docstring).

    s / p: mean and variance of the log-slowdown; r: learned observation noise (variance of
    one window's reading); n_r: innovations that taught it; cu_hi / cu_lo: the CUSUM sums;
    seg: the segment now; levels: per segment, its last mean (what a return matches).
    """

    s: float = 0.0
    p: float = _OPEN
    r: float = 0.0
    n_r: int = 0
    cu_hi: float = 0.0
    cu_lo: float = 0.0
    seg: int = 0
    levels: list[float] = field(default_factory=lambda: [0.0])

    def update(self, y: float, *, r0: float, r_prior: float, change_h: float, check: bool) -> bool:
        """Fold in one window's reading ``y`` (log of measured over clean). ``r0``: the
        window's own noise estimate (from the spread of its steps), the floor of ``r``;
        ``r_prior``: the noise expected before this device has shown its own, worth one
        window; ``change_h``: the CUSUM threshold; ``check``: look for a change point (not
        across a move, whose own effect on the reading is no change of conditions).
        Returns whether a change point opened a new segment."""
        r = max(self.noise(r_prior), r0, 1e-6)
        z = (y - self.s) / math.sqrt(self.p + r)
        changed = False
        if self.p < _OPEN:
            # Noise learning, Huber-style: one window teaches at most 3 sd of what was
            # believed, so a true change (or a window that straddles one) widens the noise
            # little, while swings that keep coming widen it until they stop reading as
            # changes.
            inn = min((y - self.s) ** 2, 9.0 * (self.p + r)) - self.p
            self.n_r += 1
            self.r = max(self.r + (max(inn, 0.0) - self.r) / min(self.n_r, 16), 0.0)
        if check and self.p < _OPEN:
            # Two-sided CUSUM with drift 0.5 (half a standard deviation per window: a shift
            # of one sd is caught within a few windows, noise alone rarely adds up to h).
            self.cu_hi = max(0.0, self.cu_hi + z - 0.5)
            self.cu_lo = max(0.0, self.cu_lo - z - 0.5)
            if self.cu_hi > change_h or self.cu_lo > change_h:
                changed = True
                self._open(y, r)
        if not changed:
            k = self.p / (self.p + r)
            self.s += k * (y - self.s)
            self.p = (1.0 - k) * self.p
        self.levels[self.seg] = self.s
        return changed

    def noise(self, r_prior: float) -> float:
        """The observation noise believed now: the learned one, with the prior as one
        window (a device's timers may swing for windows at a time before they show it)."""
        return (r_prior + self.n_r * self.r) / (1 + self.n_r)

    def loosen(self, var: float) -> None:
        """A move changed this device's load: its level may have moved by ``var``."""
        self.p += var

    def _open(self, y: float, r: float) -> None:
        """A change point: a new segment at ``y``, or an earlier one ``y`` matches."""
        self.cu_hi = self.cu_lo = 0.0
        near = [k for k, lv in enumerate(self.levels) if k != self.seg and (y - lv) ** 2 < 4.0 * r]
        if near:
            self.seg = min(near, key=lambda k: abs(y - self.levels[k]))
            self.s, self.p = self.levels[self.seg], r
        else:
            # Nothing is known of a new level but this reading: it is the level, with the
            # reading's own noise.
            self.levels.append(y)
            self.seg = len(self.levels) - 1
            self.s, self.p = y, r


@dataclass
class PlanStat:
    """The windows measured under one plan in one segment: mean log step and its count."""

    mean: float = 0.0
    n: int = 0

    def add(self, y: float) -> None:
        self.n += 1
        self.mean += (y - self.mean) / self.n


def combine(m1: float, v1: float, m2: float, v2: float) -> tuple[float, float]:
    """Two Gaussian beliefs about one quantity, as one (precision-weighted)."""
    if v1 <= 0:
        return m1, 0.0
    if v2 <= 0:
        return m2, 0.0
    w = v2 / (v1 + v2)
    return w * m1 + (1 - w) * m2, v1 * v2 / (v1 + v2)


def z_of(confidence: float) -> float:
    """The standard normal quantile of ``confidence`` (one-sided)."""
    from statistics import NormalDist

    return NormalDist().inv_cdf(confidence)


def move_lcb(
    *, now_ms: float, d: float, var_d: float, pause_ms: float, horizon: int, z: float
) -> float:
    """The rule: lower confidence bound (ms) of ``horizon * (T_now - T_new) - pause``, where
    ``d = log T_now - log T_new`` has mean ``d`` and variance ``var_d``. Move iff > 0."""
    lo = d - z * math.sqrt(max(var_d, 0.0))
    return horizon * now_ms * (1.0 - math.exp(-lo)) - pause_ms
