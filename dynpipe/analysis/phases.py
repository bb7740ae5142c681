"""Interference windows and training phases, derived from a run log's events.

An ``interference_start`` event of step ``k`` is written before step ``k`` runs and an
``interference_stop`` of step ``j`` before step ``j`` runs, so the interferer is on while steps
``k … j - 1`` run. A step's phase is ``clean`` before the first onset, ``interference`` while
any interferer is on, and ``after`` once they are all off again. Its condition names what was
on (or, after, what was on last), e.g. ``emulated ×3 on stage 1`` or ``gemm 50% on stage 0``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from dynpipe.runtime.records import Event

__all__ = ["PHASES", "Window", "assign_phases", "interference_windows"]

PHASES = ("clean", "interference", "after")


@dataclass(frozen=True)
class Window:
    """One interferer on one stage's device, on for steps ``[start, stop)``.

    ``stop`` is the step after the last one it was on for (the run's last step + 1 if it was
    never switched off); ``t_start`` / ``t_stop`` are seconds since the run's first header.
    """

    start: int
    stop: int
    stage: int
    rank: int | None
    kind: str
    intensity: float
    count: int
    factor: float | None
    emulated: bool
    t_start: float
    t_stop: float | None

    @property
    def label(self) -> str:
        if self.emulated or self.kind == "emulate":
            what = f"emulated ×{self.factor:g}"
        else:
            what = f"{self.kind} {self.intensity:.0%}" + (
                f" ×{self.count}" if self.count > 1 else ""
            )
        return f"{what} on stage {self.stage}"

    @property
    def severity(self) -> float:
        """Orders conditions from light to heavy: the dilation factor, or duty × job count."""
        if self.emulated or self.kind == "emulate":
            return float(self.factor or 1.0)
        return 1.0 + self.intensity * max(self.count, 1)


def interference_windows(events: Iterable[Event], *, last_step: int, t0: float) -> list[Window]:
    """Windows from ``interference_start`` / ``interference_stop`` event records, in order."""
    open_: dict[int, Event] = {}
    out: list[Window] = []

    def close(rec: Event, stop: int, t_stop: float | None) -> None:
        out.append(
            Window(
                start=int(rec.step or 0),
                stop=stop,
                stage=int(rec.get("stage", -1)),
                rank=None if rec.get("rank") is None else int(rec["rank"]),
                kind=str(rec.get("kind", "emulate")),
                intensity=float(rec.get("intensity") or 0.0),
                count=int(rec.get("count") or 1),
                factor=None if rec.get("factor") is None else float(rec["factor"]),
                emulated=bool(rec.get("emulated", rec.get("kind") == "emulate")),
                t_start=rec.time - t0,
                t_stop=None if t_stop is None else t_stop - t0,
            )
        )

    for rec in events:
        name, stage = rec.event, int(rec.get("stage", -1))
        if name == "interference_start":
            if stage in open_:
                prev = open_[stage]
                same = all(rec.get(k) == prev.get(k) for k in ("kind", "intensity", "factor"))
                if same:
                    continue  # a relaunch re-announcing what already runs
                close(open_.pop(stage), int(rec.step or 0), rec.time)
            open_[stage] = rec
        elif name == "interference_stop" and stage in open_:
            close(open_.pop(stage), int(rec.step or 0), rec.time)
    for rec in open_.values():
        close(rec, last_step + 1, None)
    return sorted(out, key=lambda w: (w.start, w.stage))


def assign_phases(
    steps: Sequence[int] | np.ndarray, windows: Sequence[Window]
) -> tuple[list[str], list[str | None]]:
    """Phase and condition of every step (condition ``None`` before any interference)."""
    phases: list[str] = []
    conds: list[str | None] = []
    for k in np.asarray(steps, dtype=np.int64).tolist():
        on = [w for w in windows if w.start <= k < w.stop]
        if on:
            phases.append("interference")
            conds.append(" + ".join(w.label for w in on))
            continue
        past = [w for w in windows if w.stop <= k]
        if past:
            last = max(w.stop for w in past)
            phases.append("after")
            conds.append(" + ".join(w.label for w in past if w.stop == last))
        else:
            phases.append("clean")
            conds.append(None)
    return phases, conds
