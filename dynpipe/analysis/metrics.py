"""Numbers the figures and the summary table show, computed from ``Run`` frames only.

- ``phase_stats``: per run and phase, mean step time, compute throughput, repartitions,
  bytes moved and pause; the first ``warmup`` steps of a run (allocator and first-touch
  effects, not part of any phase's steady state) are left out of the step statistics.
- ``throughput``: end to end, samples of the steps kept over the wall time from the first
  step's start to the last step's end, so pauses (migration, relaunch) count against it.
- ``time_to_target``: wall time until the trailing mean loss first reaches a target.
- ``eval_metric`` / ``choose_eval_target`` / ``time_to_eval_target``: the same for the
  held-out evaluations (``eval`` records): accuracy where every run has it, else eval loss.
- ``migration_costs``: one row per live repartition or restart, with its pause broken down.
- ``sweep_split_ms``: a sweep run's (``--adapt sweep``) mean step time of every split it
  held, per pass: the oracle of the benchmarks.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dynpipe.analysis.logs import Run
from dynpipe.analysis.phases import PHASES
from dynpipe.errors import UserError

__all__ = [
    "EvalTarget",
    "choose_eval_target",
    "choose_target",
    "eval_metric",
    "migration_costs",
    "oracle_phases",
    "phase_stats",
    "smoothed_loss",
    "sweep_split_ms",
    "throughput",
    "time_to_eval_target",
    "time_to_target",
]


def _in_phase(run: Run, phase: str, condition: str | None) -> pd.Series:
    s = run.steps
    mask = s["phase"] == phase
    if condition is not None and phase != "clean":
        mask &= s["condition"] == condition
    return mask


def phase_stats(run: Run, *, warmup: int = 2) -> pd.DataFrame:
    """One row per (phase, condition) the run went through, in phase order.

    Columns: ``run, system, model, phase, condition, steps, mean_ms, std_ms, median_ms,
    samples_per_s`` (batch × steps / summed step time), ``repartitions, bytes, pause_ms``
    (live repartitions and restarts decided in the phase, their bytes and pauses).
    """
    s = run.steps
    first = int(s["step"].min())
    rows = []
    keys = (
        s[["phase", "condition"]]
        .drop_duplicates()
        .assign(order=lambda d: d["phase"].map(PHASES.index))
        .sort_values("order", kind="stable")
    )
    moves = migration_costs([run])
    for phase, cond in keys[["phase", "condition"]].itertuples(index=False):
        cond = None if pd.isna(cond) else cond
        mask = _in_phase(run, phase, cond)
        steps_here = s.loc[mask, "step"]
        ms = s.loc[mask & (s["step"] >= first + warmup), "step_ms"].to_numpy()
        m = moves[moves["step"].isin(steps_here)] if len(moves) else moves
        rows.append(
            {
                "run": run.name,
                "system": run.system,
                "model": run.model,
                "phase": phase,
                "condition": cond,
                "steps": len(ms),
                "mean_ms": float(ms.mean()) if len(ms) else np.nan,
                "std_ms": float(ms.std()) if len(ms) else np.nan,
                "median_ms": float(np.median(ms)) if len(ms) else np.nan,
                "samples_per_s": run.batch_size * len(ms) / (ms.sum() / 1e3) if len(ms) else np.nan,
                "repartitions": int((m["kind"] == "repartition").sum()) if len(m) else 0,
                "restarts": int((m["kind"] == "restart").sum()) if len(m) else 0,
                "bytes": int(m["bytes"].fillna(0).sum()) if len(m) else 0,
                "pause_ms": float(m["pause_ms"].fillna(0).sum()) if len(m) else 0.0,
            }
        )
    return pd.DataFrame(rows)


def throughput(run: Run) -> float:
    """Samples per second, end to end: pauses between steps count against the run."""
    s = run.steps
    if len(s) < 2:
        raise UserError(f"run {run.name} ({run.path}) has {len(s)} step(s); need two or more")
    # From the earliest step's start to the latest step's end: a log whose relaunches
    # started over (nothing saved to resume from) holds steps out of time order.
    span = float(s["t_end"].max() - (s["t_end"] - s["step_ms"] / 1e3).min())
    return run.batch_size * len(s) / span


def smoothed_loss(run: Run, *, smooth: int = 5) -> pd.Series:
    """Trailing mean of the loss over ``smooth`` steps (uses no future steps)."""
    return run.steps["loss"].rolling(max(1, smooth), min_periods=1).mean()


def choose_target(runs: Sequence[Run], *, quantile: float = 0.1, smooth: int = 5) -> float:
    """A loss every run reaches: the largest over runs of each one's ``quantile`` of its
    smoothed loss."""
    if not 0 <= quantile <= 1:
        raise UserError(f"loss quantile must be in [0, 1], got {quantile}")
    vals = [float(smoothed_loss(r, smooth=smooth).quantile(quantile)) for r in runs]
    vals = [v for v in vals if np.isfinite(v)]
    if not vals:
        raise UserError("no run has a finite loss; time to target cannot be computed")
    return max(vals)


def time_to_target(run: Run, target: float, *, smooth: int = 5) -> float | None:
    """Seconds since the run's start until its smoothed loss is first <= ``target``."""
    loss = smoothed_loss(run, smooth=smooth).to_numpy()
    hit = np.flatnonzero(loss <= target)
    return float(run.steps["elapsed_s"].iloc[hit[0]]) if len(hit) else None


@dataclass(frozen=True)
class EvalTarget:
    """What time-to-target measures on the eval records: ``metric`` (``accuracy``, higher
    is better, or ``loss``, lower is better) reaching ``value``; ``how`` says where the
    value came from, in words, for titles and tables."""

    metric: str
    value: float
    how: str

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "accuracy"

    def reached(self, values: np.ndarray) -> np.ndarray:
        return values >= self.value if self.higher_is_better else values <= self.value

    def __str__(self) -> str:
        shown = f"{self.value:.1%}" if self.metric == "accuracy" else f"{self.value:.4g}"
        return f"eval {self.metric} {shown} ({self.how})"


def _need_evals(runs: Sequence[Run]) -> None:
    missing = [r.name for r in runs if r.evals.empty]
    if not runs or missing:
        raise UserError(
            f"runs {', '.join(missing) or '(none)'} have no eval records; train with "
            "--eval-every N to evaluate on the held-out split"
        )


def eval_metric(runs: Sequence[Run]) -> str:
    """``accuracy`` when every run's evaluations have one, else ``loss``."""
    _need_evals(runs)
    have = all(r.evals["accuracy"].notna().any() for r in runs)
    return "accuracy" if have else "loss"


def choose_eval_target(
    runs: Sequence[Run],
    *,
    target_accuracy: float | None = None,
    target_loss: float | None = None,
) -> EvalTarget:
    """The target given, else the best value every run reaches: the lowest of the runs'
    best accuracies (or the highest of their lowest eval losses)."""
    metric = eval_metric(runs)
    if target_accuracy is not None:
        if metric != "accuracy":
            raise UserError(
                "--target-accuracy needs runs that log accuracy (classification, gpt or bert); "
                "these have eval loss only: use --target-loss"
            )
        if not 0 < target_accuracy <= 1:
            raise UserError(f"--target-accuracy is a fraction in (0, 1], got {target_accuracy}")
        return EvalTarget("accuracy", float(target_accuracy), "given")
    if target_loss is not None:
        return EvalTarget("loss", float(target_loss), "given")
    if metric == "accuracy":
        value = min(float(r.evals["accuracy"].max()) for r in runs)
        return EvalTarget("accuracy", value, "the best accuracy every run reaches")
    value = max(float(r.evals["loss"].min()) for r in runs)
    return EvalTarget("loss", value, "the lowest eval loss every run reaches")


def time_to_eval_target(run: Run, target: EvalTarget) -> tuple[float, int] | None:
    """Wall seconds since the run's start, and steps trained, at its first evaluation that
    reaches ``target``; None if none does."""
    ev = run.evals
    hit = np.flatnonzero(target.reached(ev[target.metric].to_numpy(dtype=float)))
    if not len(hit):
        return None
    row = ev.iloc[hit[0]]
    return float(row["elapsed_s"]), int(row["step"])


def migration_costs(runs: Sequence[Run]) -> pd.DataFrame:
    """One row per live repartition and per restart of the runs.

    Columns: ``run, system, kind`` (``repartition`` or ``restart``), ``step, bytes,
    decide_ms, transfer_ms, rebuild_ms, relaunch_ms, pause_ms, gap_ms``. A restart's relaunch
    time is the ``pause_ms`` of its ``resumed`` event (from the decision to the relaunched
    process being ready); its pause adds the decision time to that. ``gap_ms`` is checked
    independently: the wall-clock time between the end of the step before and the start of
    the step at which the move took effect (the pause plus the timing gather around it).
    """
    rows = []
    for run in runs:
        gaps = _step_gaps_ms(run)
        for ev in run.events_of("repartition"):
            rows.append(
                {
                    "run": run.name,
                    "system": run.system,
                    "kind": "repartition",
                    "step": int(ev.step),
                    "bytes": ev.get("bytes"),
                    "decide_ms": ev.get("decide_ms"),
                    "transfer_ms": ev.get("transfer_ms"),
                    "rebuild_ms": ev.get("rebuild_ms"),
                    "relaunch_ms": None,
                    "pause_ms": ev.get("pause_ms"),
                    "gap_ms": gaps.get(int(ev.step)),
                }
            )
        resumed = {int(ev.step): ev for ev in run.events_of("resumed")}
        for ev in run.events_of("restart"):
            res = resumed.get(int(ev.step))
            relaunch = None if res is None else res.get("pause_ms")
            decide = ev.get("decide_ms")
            pause = None if relaunch is None else float(relaunch) + float(decide or 0.0)
            rows.append(
                {
                    "run": run.name,
                    "system": run.system,
                    "kind": "restart",
                    "step": int(ev.step),
                    "bytes": None,
                    "decide_ms": decide,
                    "transfer_ms": None,
                    "rebuild_ms": None,
                    "relaunch_ms": relaunch,
                    "pause_ms": pause,
                    "gap_ms": gaps.get(int(ev.step)),
                }
            )
    cols = [
        "run",
        "system",
        "kind",
        "step",
        "bytes",
        "decide_ms",
        "transfer_ms",
        "rebuild_ms",
        "relaunch_ms",
        "pause_ms",
        "gap_ms",
    ]
    out = pd.DataFrame(rows, columns=cols)
    num = cols[4:]
    out[num] = out[num].astype(float)
    return out


def _step_gaps_ms(run: Run) -> dict[int, float]:
    """Wall-clock ms between the end of step ``k - 1`` and the start of step ``k``."""
    s = run.steps
    k = s["step"].to_numpy()
    start = s["t_end"].to_numpy() - s["step_ms"].to_numpy() / 1e3
    gap = (start[1:] - s["t_end"].to_numpy()[:-1]) * 1e3
    return {int(b): float(g) for a, b, g in zip(k[:-1], k[1:], gap, strict=True) if b == a + 1}


def oracle_phases(meta: dict) -> dict[str, tuple[int, int]]:
    """Steps ``[a, b)`` of each phase of an oracle benchmark run (``bench/oracle.py``'s
    ``oracle.json``) that has any: clean from the warm-up to the onset, interference from
    the onset (or the warm-up's end, for an interferer from the run's start, as the sweep's
    timings do) to the end, and after."""
    spans = {
        "clean": (meta["warmup"], meta["onset"]),
        "interference": (max(meta["onset"], meta["warmup"]), meta["end"]),
        "after": (meta["end"], meta["steps"]),
    }
    return {p: (a, b) for p, (a, b) in spans.items() if b > a}


def sweep_split_ms(
    steps: Sequence[tuple[int, float, str]],
    moved: Collection[int],
    *,
    onset: int,
    warmup: int,
    every: int,
) -> dict[str, dict[str, float]]:
    """A sweep's mean wall-clock time per step of every split it held, in its clean pass
    (steps before ``onset``) and its interference pass: ``{"clean" | "interference":
    {split: ms}}``. ``steps``: ``(step, end time in seconds, split)`` in step order;
    ``moved``: the steps a repartition started.

    Measured as the benchmarked systems are, from one step's end to the next (the
    per-window gather counts for the oracle as for them); each visit's first window (the
    split settles: a new kernel's tuning, the moved layers' allocations) and the launch's
    first ``warmup`` steps left out, and so are the steps of a clean visit past ``onset``.
    A split held again later in the same pass (the sweep ends every pass on the split it
    started from) is measured by its later visits alone: the launch's first visit runs while
    the launch warms up (a 4-stage gpt sweep read its first split 191 ms a step after one
    window, where the static launch of that split ran 115). A sweep without such a visit
    (older logs) keeps the first one."""
    out: dict[str, dict[str, dict[int, list[float]]]] = {"clean": {}, "interference": {}}
    since, visit, start, prev = 0, 0, 0, None
    for s, t_end, split in steps:
        if s in moved:
            since, visit, start = 0, visit + 1, s
        else:
            since += 1
        dt = (t_end - prev[1]) * 1e3 if prev is not None and prev[0] == s - 1 else None
        prev = (s, t_end)
        # A visit counts in the pass it started in: the steps of a clean visit that the
        # interferer's start reached are neither pass's.
        if s < warmup or since < every or dt is None or (start < onset <= s):
            continue
        phase = "clean" if s < onset else "interference"
        out[phase].setdefault(split, {}).setdefault(visit, []).append(dt)
    means: dict[str, dict[str, float]] = {}
    for phase, by_split in out.items():
        means[phase] = {}
        for split, visits in by_split.items():
            if 0 in visits and len(visits) > 1:
                del visits[0]
            means[phase][split] = float(np.mean([x for v in visits.values() for x in v]))
    return means
