"""Fit a predictor on profile rows: features, estimator, provenance."""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Mapping

import numpy as np
import pandas as pd

from dynpipe.errors import UserError
from dynpipe.predictor.crossval import TUNE_GRID, fit_extras
from dynpipe.predictor.estimator import make_estimator
from dynpipe.predictor.features import extract_features
from dynpipe.predictor.io import Predictor, dataset_fingerprint, library_versions

__all__ = ["LEARNED", "fit_predictor"]

# Estimators that can be shipped: they predict from features alone.
LEARNED: tuple[str, ...] = ("xgb", "rf", "ridge")


def _training_info(df: pd.DataFrame) -> dict:
    info = {
        "rows": len(df),
        "devices": sorted(map(str, df["device_name"].unique())) if "device_name" in df else [],
        "device_types": sorted(map(str, df["device_type"].unique())) if "device_type" in df else [],
        "models": sorted(map(str, df["model"].unique())) if "model" in df else [],
        "conditions": sorted(map(str, df["condition"].unique())) if "condition" in df else [],
        "batch_sizes": sorted(int(b) for b in df["batch_size"].unique())
        if "batch_size" in df
        else [],
        "dtypes": sorted(map(str, df["dtype"].unique())) if "dtype" in df else [],
    }
    # Dataset-level metadata, when the loader keeps it in DataFrame.attrs.
    meta = {}
    for key, value in df.attrs.items():
        try:
            json.dumps(value)
        except TypeError:
            continue
        meta[str(key)] = value
    if meta:
        info["metadata"] = meta
    return info


def fit_predictor(
    df: pd.DataFrame,
    *,
    estimator: str = "xgb",
    params: Mapping[str, object] | None = None,
    tune: bool = False,
) -> Predictor:
    """Fit estimator ``estimator`` (``xgb``, ``rf``, ``ridge``) on all of ``df``.

    With ``tune``, hyper-parameters (xgb only) are chosen by grouped CV over interference
    conditions first; report accuracy with ``evaluate``, which never tunes on its test folds.
    """
    if estimator not in LEARNED:
        raise UserError(
            f"can only ship a learned estimator ({', '.join(LEARNED)}), got {estimator!r}"
        )
    est = make_estimator(estimator, **dict(params or {}))
    X, schema = extract_features(df)
    y = df["slowdown"].to_numpy(dtype=np.float64)
    extra = fit_extras(est, df)
    if tune:
        if estimator != "xgb":
            raise UserError(f"--tune is for the xgb estimator only, not {estimator!r}")
        from sklearn.model_selection import GridSearchCV, GroupKFold

        groups = (df["device_name"].astype(str) + "/" + df["condition"].astype(str)).to_numpy()
        n = min(3, len(np.unique(groups)))
        if n < 2:
            raise UserError("--tune needs at least two interference conditions in the profiles")
        search = GridSearchCV(
            est,
            TUNE_GRID,
            cv=GroupKFold(n_splits=n),
            scoring="neg_mean_absolute_percentage_error",
        )
        # ``groups`` here are the search's folds; the spread then falls back to windows.
        extra.pop("groups", None)
        search.fit(X, y, groups=groups, **extra)
        est = search.best_estimator_
    else:
        est.fit(X, y, **extra)
    return Predictor(
        estimator=est,
        schema=schema,
        estimator_name=estimator,
        data_fingerprint=dataset_fingerprint(df),
        versions=library_versions(),
        training=_training_info(df),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )
