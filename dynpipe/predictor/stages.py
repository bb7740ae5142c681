"""Stages for evaluation: contiguous layer ranges and their summed times.

A pipeline stage is a contiguous range of layers; its time is the sum of its layers' forward
and backward times. To score stage-level predictions we form, for every run (one model at one
batch size on one device under one condition), the split a planner would make without
interference: ``n_stages`` contiguous ranges with about equal alone time (cuts at the
quantiles of cumulative alone time, each stage at least one layer). The split depends only on
alone times, so every condition of a model shares it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pandas as pd

__all__ = [
    "RUN_KEYS",
    "assign_stages",
    "balanced_ranges",
    "measured_stage_slowdown",
    "run_ids",
    "run_keys",
    "stage_sums",
]

# One run: everything about a measurement except which layer and phase.
RUN_KEYS: tuple[str, ...] = ("device_name", "model", "batch_size", "dtype", "condition")


def run_keys(df: pd.DataFrame, *, with_condition: bool = True) -> list[str]:
    """The ``RUN_KEYS`` present in ``df`` (without ``condition``: a model's family of runs)."""
    keys = [k for k in RUN_KEYS if k in df.columns]
    return keys if with_condition else [k for k in keys if k != "condition"]


def run_ids(df: pd.DataFrame) -> np.ndarray:
    """One id per row, equal for the rows of one run (one telemetry window of the profiler)."""
    return df.groupby(run_keys(df), sort=False).ngroup().to_numpy()


def balanced_ranges(weights: Sequence[float], *, n_stages: int) -> list[tuple[int, int]]:
    """``n_stages`` contiguous ``[start, stop)`` ranges with about equal summed weight.

    Cut ``k`` sits where the running sum is closest to ``k / n_stages`` of the total, moved
    as little as needed to keep every stage non-empty.
    """
    w = np.asarray(weights, dtype=np.float64)
    n = len(w)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} layers into {n_stages} non-empty stages")
    csum = np.cumsum(w)
    total = csum[-1]
    bounds = [0]
    for k in range(1, n_stages):
        # prefix of b layers has sum csum[b-1]; choose b in [prev+1, n-(n_stages-k)].
        lo, hi = bounds[-1] + 1, n - (n_stages - k)
        cand = np.arange(lo, hi + 1)
        b = int(cand[np.argmin(np.abs(csum[cand - 1] - total * k / n_stages))])
        bounds.append(b)
    bounds.append(n)
    return list(itertools.pairwise(bounds))


def assign_stages(df: pd.DataFrame, *, n_stages: int) -> np.ndarray:
    """Stage index of each row under the balanced ``n_stages`` split of its model (-1 if the
    model has fewer layers than stages)."""
    out = np.full(len(df), -1, dtype=np.int64)
    family_keys = run_keys(df, with_condition=False)
    positions = np.arange(len(df))
    for _, fam in df.assign(_pos=positions).groupby(family_keys, sort=False):
        per_layer = (
            fam.drop_duplicates(["layer_index", "phase"])
            .groupby("layer_index")["time_alone_ms"]
            .sum()
            .sort_index()
        )
        if len(per_layer) < n_stages:
            continue
        ranges = balanced_ranges(per_layer.to_numpy(), n_stages=n_stages)
        stage_of_layer = np.empty(len(per_layer), dtype=np.int64)
        for s, (a, b) in enumerate(ranges):
            stage_of_layer[a:b] = s
        order = pd.Series(np.arange(len(per_layer)), index=per_layer.index)
        out[fam["_pos"].to_numpy()] = stage_of_layer[order.loc[fam["layer_index"]].to_numpy()]
    return out


def stage_sums(df: pd.DataFrame, *, stage: np.ndarray, predicted_ms: np.ndarray) -> pd.DataFrame:
    """Measured and predicted time per (run, stage): sums over the stage's layers and phases.

    Rows with ``stage < 0`` or a NaN prediction are left out; a stage is kept only if all
    its rows are present, since a partial sum is not a stage time.
    """
    keys = run_keys(df)
    work = df[[*keys, "interferer", "time_ms", "time_alone_ms"]].copy()
    work["stage"] = stage
    work["predicted_ms"] = predicted_ms
    work["_ok"] = np.isfinite(predicted_ms)
    work = work[work["stage"] >= 0]
    g = work.groupby([*keys, "interferer", "stage"], sort=False)
    out = g.agg(
        measured_ms=("time_ms", "sum"),
        predicted_ms=("predicted_ms", "sum"),
        alone_ms=("time_alone_ms", "sum"),
        n_rows=("time_ms", "size"),
        complete=("_ok", "all"),
    ).reset_index()
    return out[out["complete"]].drop(columns="complete").reset_index(drop=True)


def measured_stage_slowdown(
    df: pd.DataFrame,
    *,
    stage: np.ndarray,
    current: int,
    reference_ms: np.ndarray | None = None,
) -> np.ndarray:
    """Per row: measured / reference time of stage ``current`` of the row's run.

    With the default reference (``time_alone_ms``) this is the stage's measured slowdown,
    what a device running that stage observes. With a predictor's times as reference it is
    the correction that makes the prediction of the current stage match its measurement.
    Sums run over the stage's layers and both phases. NaN for runs without such a stage.
    """
    keys = run_keys(df)
    ref = df["time_alone_ms"].to_numpy() if reference_ms is None else np.asarray(reference_ms)
    mask = stage == current
    sub = df.loc[mask, keys].assign(_meas=df["time_ms"].to_numpy()[mask], _ref=ref[mask])
    agg = sub.groupby(keys, sort=False)[["_meas", "_ref"]].sum(min_count=1)
    factor = agg["_meas"] / agg["_ref"]
    idx = pd.MultiIndex.from_frame(df[keys]) if len(keys) > 1 else pd.Index(df[keys[0]])
    return factor.reindex(idx).to_numpy(dtype=np.float64)
