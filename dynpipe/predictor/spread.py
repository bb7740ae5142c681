"""How sure a prediction is: the spread of a slowdown model's error on architectures it did
not see, calibrated so that its central interval holds the stated share of measurements.

``fit_spread`` refits the point model ``spread_folds`` times, each time holding out whole
groups (architectures, when ``groups`` is given; else whole telemetry windows), and keeps the
held-out errors of ``log(time)``. Two kinds of error are kept apart, because the runtime uses
the prediction calibrated: it rescales each device's predicted times so the layers the device
holds come out as measured, which removes the part of the error shared by a window's layers.

- *calibrated* error of a row: its error minus the mean error of the other half of its
  window's layers (a device holding one half, predicting the other);
- *level* error of a window: the mean error of its layers (what calibration removes).

A small xgboost quantile model learns the ``coverage`` quantile of the calibrated error's
magnitude from the features (kernels that a co-located job slows unevenly get wider
intervals). Its scale is then set by split-conformal calibration across the same folds: the
factor that makes the central interval hold ``coverage`` of the held-out errors, each scored
by a quantile model that did not see its fold. The result is reported as a standard deviation
of ``log(time)`` (``log_sd``): ``exp(+- z * sd)`` with the normal ``z`` of a coverage is the
interval (exactly calibrated at ``coverage``, by the normal shape elsewhere).
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import NormalDist
from typing import Any

import numpy as np
import pandas as pd

from dynpipe.errors import UserError

__all__ = ["SPREAD_PARAMS", "calibrated_errors", "fit_spread", "log_sd", "z_of"]

# The quantile model is small: it runs beside the point model on every run-time call, and
# a tree costs about as much to evaluate whatever its depth (200 layers x 8 devices: 40
# trees took 1.5 ms of one core, the point model's 150 trees 7.8 ms), so few, deeper trees.
SPREAD_PARAMS: dict[str, Any] = {
    "n_estimators": 12,
    "max_depth": 4,
    "learning_rate": 0.3,
    "objective": "reg:quantileerror",
}
_FLOOR = 1e-3  # smallest log-spread a row may get (0.1 %): a quantile model can predict <= 0


def z_of(coverage: float) -> float:
    """Normal quantile of a central interval holding ``coverage`` (0.8 -> 1.2816)."""
    if not 0.0 < coverage < 1.0:
        raise UserError(f"coverage must be between 0 and 1 (e.g. 0.8), got {coverage}")
    return NormalDist().inv_cdf(0.5 + coverage / 2.0)


def calibrated_errors(err: np.ndarray, *, runs: np.ndarray) -> tuple[np.ndarray, pd.Series]:
    """Per row, ``err`` minus the mean of the other half of its window (rows in order); and
    per window, the mean error (the level error)."""
    err = np.asarray(err, dtype=np.float64)
    frame = pd.DataFrame({"err": err, "run": np.asarray(runs)})
    pos = frame.groupby("run", sort=False).cumcount().to_numpy()
    size = frame.groupby("run", sort=False)["err"].transform("size").to_numpy()
    half = (2 * pos >= size).astype(np.int64)  # 0: first half of the window, 1: second
    key = pd.Series(list(zip(frame["run"], half, strict=True)))
    half_mean = frame["err"].groupby(key.to_numpy()).transform("mean").to_numpy()
    other = pd.Series(list(zip(frame["run"], 1 - half, strict=True)))
    means = dict(zip(key, half_mean, strict=True))
    other_mean = np.array([means.get(k, np.nan) for k in other])
    # A window of one row has no other half: the row is its own reference.
    other_mean = np.where(np.isnan(other_mean), half_mean, other_mean)
    level = frame.groupby("run", sort=False)["err"].mean()
    return err - other_mean, level


def _folds(groups: np.ndarray, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    from sklearn.model_selection import GroupKFold

    n = min(k, len(np.unique(groups)))
    if n < 2:
        return []
    return list(GroupKFold(n_splits=n).split(np.zeros(len(groups)), groups=groups))


def fit_spread(
    est: Any,
    *,
    arr: np.ndarray,
    log_y: np.ndarray,
    names: Sequence[str] | None,
    runs: np.ndarray,
    groups: np.ndarray | None,
) -> None:
    """Learn ``est``'s spread (module docstring): sets ``spread_booster_``, ``spread_scale_``
    (calibrated ``log_sd`` per unit of the quantile model's output) and ``level_log_sd_``.
    Leaves them unset when the data has fewer than two groups to hold out."""
    from sklearn.base import clone

    by = np.asarray(groups) if groups is not None else np.asarray(runs)
    folds = _folds(by, est.spread_folds)
    if not folds:
        return
    pred = np.full(len(arr), np.nan)
    for train, test in folds:
        sub = clone(est).set_params(coverage=None)
        X_train = pd.DataFrame(arr[train], columns=list(names)) if names else arr[train]
        sub.fit(X_train, np.exp(log_y[train]), runs=np.asarray(runs)[train])
        pred[test] = sub._predict_log(arr[test])
    err = log_y - pred
    cal, level = calibrated_errors(err, runs=runs)
    coverage = float(est.coverage)
    z = z_of(coverage)
    target = np.abs(cal)
    params = {**SPREAD_PARAMS, "quantile_alpha": coverage}
    # Split-conformal: each fold's rows scored by a quantile model fitted without that fold.
    scored = np.full(len(arr), np.nan)
    for train, test in folds:
        booster = est._boost(arr[train], target[train], None, None, **params)
        scored[test] = np.maximum(booster.inplace_predict(arr[test]), _FLOOR)
    ratio = target / scored
    factor = float(np.quantile(ratio[np.isfinite(ratio)], coverage))
    est.spread_booster_ = est._boost(arr, target, None, None, **params)
    est.spread_scale_ = factor / z
    est.level_log_sd_ = float(np.quantile(np.abs(level.to_numpy()), coverage)) / z


def log_sd(est: Any, *, arr: np.ndarray, calibrated: bool = True) -> np.ndarray | None:
    """Per-row standard deviation of the error of ``log(predicted time)`` (``None`` if
    ``est`` was fitted without a spread)."""
    booster = getattr(est, "spread_booster_", None)
    if booster is None:
        return None
    sd = est.spread_scale_ * np.maximum(booster.inplace_predict(arr), _FLOOR)
    if not calibrated:
        sd = np.sqrt(sd**2 + est.level_log_sd_**2)
    return sd
