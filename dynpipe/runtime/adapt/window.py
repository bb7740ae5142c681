"""``Window``: what one monitoring window measured, as plain numbers.

The training loop gathers every stage's step timings, every layer's sampled timings and
every device's telemetry once per window; a ``Window`` holds them in one place, so the
policy sees the same type whether it runs in a training process, over a recorded log
(``bench/replay_controller.py``) or in the controller simulator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dynpipe.planner.plan import split_label

__all__ = ["Window"]


@dataclass(frozen=True, eq=False)
class Window:
    """One monitoring window ending after ``step``, under one plan.

    bounds / ranks: the plan in force (stage ``s`` holds layers ``[a, b)`` on rank
        ``ranks[s]``); microbatches / schedule: how it runs.
    step_ms: ``[k]`` the window's step times.
    stage_fwd_ms, stage_bwd_ms: ``[k, S]`` each stage's forward / backward compute per step
        (all microbatches).
    layer_fwd_ms, layer_bwd_ms: ``[L]`` each layer's time per microbatch on its device, from
        the window's sampled step (NaN where a layer was not timed), or None if no layer was.
    sampled_fwd_ms, sampled_bwd_ms: ``[S]`` each stage's compute per microbatch on that same
        step: what a stage spends beyond its layers is its fixed overhead.
    host_fwd_ms, host_bwd_ms / device_fwd_ms, device_bwd_ms: ``[L]`` on a GPU, the host's
        time to issue each layer and the device's time alone on the same step (the layer's
        time above is the longer of the two), or None (CPU, older logs).
    telemetry: one ``tel_*`` dict per rank, or None.
    memory_bytes: ``[R]`` bytes each rank's stage may occupy (NaN where unknown), or None.
    replicas: with data parallelism, one window per pipeline replica (its own stages, layers,
        telemetry and memory; ``step_ms`` its busiest stage's compute, ``microbatches`` what
        it ran: 0 for a replica partial reduce leaves out, which measures nothing), else
        None. The fields above are then
        replica 0's, but ``step_ms``: the job's step times.
    shares / dropped: the plan's batch shares per replica and the replicas partial reduce
        leaves out (None / empty for one replica).
    reduce_ms: ``[k, dp]`` each replica's longest all-reduce tail per step, or None.
    idle: ranks the plan leaves idle (one pipeline whose plan holds a subset of the ranks);
        the fields above describe the active stages only.
    probes: per probing rank, ``(layer, fwd_ms, bwd_ms)``: one microbatch of that layer
        timed on its device on the window's sampled step, or None. A probing rank is idle
        (it holds nothing to time) or light: it holds layers, too little work for its
        timers to read its device (``CostEstimates.light_probes``), and times a layer it
        does not hold; ``idle`` tells the two apart.
    between_ms: ``[k]`` the job's time between each step and the one before it (the
        longest of any rank's: its batch, the adaptation loop's host work, a move's whole
        pause), or None (older logs).
    update_ms: ``[k, S]`` each stage's optimizer update per step (NaN where not timed), or
        None (older logs).
    """

    step: int
    bounds: tuple[tuple[int, int], ...]
    ranks: tuple[int, ...]
    microbatches: int
    schedule: str
    step_ms: np.ndarray
    stage_fwd_ms: np.ndarray
    stage_bwd_ms: np.ndarray
    layer_fwd_ms: np.ndarray | None = None
    layer_bwd_ms: np.ndarray | None = None
    sampled_fwd_ms: np.ndarray | None = None
    sampled_bwd_ms: np.ndarray | None = None
    host_fwd_ms: np.ndarray | None = None
    host_bwd_ms: np.ndarray | None = None
    device_fwd_ms: np.ndarray | None = None
    device_bwd_ms: np.ndarray | None = None
    telemetry: tuple[Mapping[str, Any], ...] | None = None
    memory_bytes: np.ndarray | None = None
    replicas: tuple[Window, ...] | None = None
    shares: tuple[int, ...] | None = None
    dropped: tuple[int, ...] = ()
    reduce_ms: np.ndarray | None = None
    idle: tuple[int, ...] = ()
    probes: Mapping[int, tuple[int, float, float]] | None = None
    between_ms: np.ndarray | None = None
    update_ms: np.ndarray | None = None

    @property
    def key(self) -> tuple[tuple[int, int], ...]:
        """The plan as one range per rank (an idle rank's empty): what names a plan when
        ranks may be idle; the bounds themselves when none is."""
        if not self.idle:
            return self.bounds
        by_rank = dict(zip(self.ranks, self.bounds, strict=True))
        out, at = [], 0
        for r in range(len(self.ranks) + len(self.idle)):
            a, b = by_rank.get(r, (at, at))
            out.append((a, b))
            at = b
        return tuple(out)

    def __repr__(self) -> str:
        split = split_label(self.bounds)
        has = "layers" if self.has_layers else "stages only"
        dp = "" if self.replicas is None else f", dp={self.dp} shares={list(self.shares or ())}"
        return f"Window(step={self.step}, {split}{dp}, {len(self.step_ms)} steps, {has})"

    @property
    def dp(self) -> int:
        return 1 if self.replicas is None else len(self.replicas)

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    @property
    def num_layers(self) -> int:
        return self.bounds[-1][1]

    @property
    def has_layers(self) -> bool:
        return self.layer_fwd_ms is not None and bool(np.isfinite(self.layer_fwd_ms).any())

    @property
    def median_step_ms(self) -> float:
        return float(np.median(self.step_ms))

    @property
    def step_noise(self) -> float:
        """Relative standard error of ``median_step_ms``, from the spread of the window's
        steps (about 1.25 x their robust spread over the root of their count)."""
        k = len(self.step_ms)
        if k < 2:
            return 0.0
        med = float(np.median(self.step_ms))
        mad = float(np.median(np.abs(self.step_ms - med)))
        return 1.25 * 1.4826 * mad / max(med, 1e-9) / float(np.sqrt(k))

    def stage_medians(self) -> tuple[np.ndarray, np.ndarray]:
        """Per stage, the median forward and backward compute per step: medians, not means,
        so one step stalled by something else on the machine does not look like a slowed
        device."""
        return np.median(self.stage_fwd_ms, axis=0), np.median(self.stage_bwd_ms, axis=0)

    def update_medians(self) -> np.ndarray | None:
        """Per stage, the median optimizer update over the window's steps that timed it
        (NaN for a stage none did), or None where no step did."""
        if self.update_ms is None or not np.isfinite(self.update_ms).any():
            return None
        u = self.update_ms
        return np.array(
            [np.median(c[np.isfinite(c)]) if np.isfinite(c).any() else np.nan for c in u.T]
        )

    def move_cost_ms(self, first: int, pause_ms: float) -> float | None:
        """What a move whose first step is ``first`` cost the job, from this window that
        starts with that step: its logged ``pause_ms``, or the stand before the first step
        beyond the window's other stands if longer, plus the first step's excess over the
        window's other steps (new buffers, communicators set up on first use, a schedule's
        first run). None where the window does not start with ``first`` or has no other
        step."""
        if self.step - len(self.step_ms) + 1 != first or len(self.step_ms) < 2:
            return None
        cost = float(pause_ms)
        if self.between_ms is not None:
            cost = max(cost, float(self.between_ms[0] - np.median(self.between_ms[1:])))
        return cost + max(float(self.step_ms[0] - np.median(self.step_ms[1:])), 0.0)

    @classmethod
    def from_records(
        cls,
        records: Sequence[Mapping[str, Any]],
        *,
        bounds: Sequence[Sequence[int]],
        ranks: Sequence[int],
        microbatches: int,
        schedule: str,
        layers: Mapping[str, Any] | None = None,
        telemetry: Sequence[Mapping[str, Any]] | None = None,
        memory_bytes: Sequence[float] | None = None,
        shares: Sequence[int] | None = None,
        dropped: Sequence[int] = (),
        replica_layers: Sequence[Mapping[str, Any] | None] | None = None,
        idle: Sequence[int] = (),
        probes: Mapping[int, tuple[int, float, float]] | None = None,
    ) -> Window:
        """From the run log's step records of one window (and its ``layer_times`` record).

        With ``shares`` (data parallelism) the records carry ``replicas``; ``telemetry``
        and ``memory_bytes`` are then per global rank, ``replica_layers`` one
        ``layer_times`` dict per replica.
        """
        # The job's time between steps (None in logs that predate it).
        gaps = [r.get("between_ms") for r in records]
        between = np.array(gaps, float) if all(g is not None for g in gaps) else None
        if shares is not None:
            win = cls._with_replicas(
                records,
                bounds=bounds,
                ranks=ranks,
                schedule=schedule,
                telemetry=telemetry,
                memory_bytes=memory_bytes,
                shares=shares,
                dropped=dropped,
                replica_layers=replica_layers,
            )
            return dataclasses.replace(win, between_ms=between)
        s = len(bounds)
        fwd = np.array([[r["stages"][i]["fwd_ms"] for i in range(s)] for r in records], float)
        bwd = np.array([[r["stages"][i]["bwd_ms"] for i in range(s)] for r in records], float)

        upd = [[r["stages"][i].get("update_ms") for i in range(s)] for r in records]
        update = None
        if any(v is not None for row in upd for v in row):
            update = np.array([[np.nan if v is None else v for v in row] for row in upd], float)

        def arr(key: str) -> np.ndarray | None:
            if layers is None or layers.get(key) is None:
                return None
            return _readings([np.nan if v is None else v for v in layers[key]])

        return cls(
            step=int(records[-1]["step"]),
            bounds=tuple((int(a), int(b)) for a, b in bounds),
            ranks=tuple(int(r) for r in ranks),
            microbatches=int(microbatches),
            schedule=str(schedule),
            step_ms=np.array([r["step_ms"] for r in records], float),
            stage_fwd_ms=fwd,
            stage_bwd_ms=bwd,
            layer_fwd_ms=arr("fwd_ms"),
            layer_bwd_ms=arr("bwd_ms"),
            sampled_fwd_ms=arr("stage_fwd_ms"),
            sampled_bwd_ms=arr("stage_bwd_ms"),
            host_fwd_ms=arr("launch_fwd_ms"),
            host_bwd_ms=arr("launch_bwd_ms"),
            device_fwd_ms=arr("device_fwd_ms"),
            device_bwd_ms=arr("device_bwd_ms"),
            telemetry=tuple(telemetry) if telemetry is not None else None,
            memory_bytes=np.array(memory_bytes, float) if memory_bytes is not None else None,
            idle=tuple(int(r) for r in idle),
            probes=dict(probes) if probes else None,
            between_ms=between,
            update_ms=update,
        )

    @classmethod
    def _with_replicas(
        cls,
        records: Sequence[Mapping[str, Any]],
        *,
        bounds: Sequence[Sequence[int]],
        ranks: Sequence[int],
        schedule: str,
        telemetry: Sequence[Mapping[str, Any]] | None,
        memory_bytes: Sequence[float] | None,
        shares: Sequence[int],
        dropped: Sequence[int],
        replica_layers: Sequence[Mapping[str, Any] | None] | None,
    ) -> Window:
        pp, dp = len(bounds), len(shares)
        subs = []
        for r in range(dp):
            recs = [
                {
                    "step": rec["step"],
                    "step_ms": rec["replicas"][r]["compute_ms"],
                    "stages": rec["replicas"][r]["stages"],
                }
                for rec in records
            ]
            mine = slice(r * pp, (r + 1) * pp)
            subs.append(
                cls.from_records(
                    recs,
                    bounds=bounds,
                    ranks=ranks,
                    microbatches=0 if r in dropped else int(shares[r]),
                    schedule=schedule,
                    layers=None if replica_layers is None else replica_layers[r],
                    telemetry=None if telemetry is None else telemetry[mine],
                    memory_bytes=None if memory_bytes is None else memory_bytes[mine],
                )
            )
        first = subs[0]
        return dataclasses.replace(
            first,
            step_ms=np.array([rec["step_ms"] for rec in records], float),
            replicas=tuple(subs),
            shares=tuple(int(x) for x in shares),
            dropped=tuple(int(x) for x in dropped),
            reduce_ms=np.array(
                [[rec["replicas"][r]["reduce_ms"] for r in range(dp)] for rec in records], float
            ),
        )


def _readings(values: Sequence[float]) -> np.ndarray:
    """Logged per-layer times as observations: a reading below zero (timer order on a
    layer that did no work) is 0, one that is not finite is NaN (no reading). A
    measurement never stops training; the estimates treat NaN as a layer not timed."""
    a = np.array(values, float)
    a[~np.isfinite(a)] = np.nan
    return np.where(a < 0, 0.0, a)
