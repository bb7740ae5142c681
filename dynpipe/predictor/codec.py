"""Fitted estimators as plain JSON: hyper-parameters, learned arrays, no pickled objects.

``encode_estimator`` turns a fitted ``SlowdownRegressor`` (its boosters in xgboost's own JSON
model format), ``ForestSlowdown`` (every tree's node arrays and the imputer's medians),
``RidgeSlowdown`` (medians, scaling and coefficients) or ``NoInterference`` into a dict of
numbers, strings and lists; ``decode_estimator`` rebuilds an estimator that predicts the same
values. Reading such a document can only make numbers, which is the point: a predictor file
from anywhere is safe to load.

Decoded forests and ridge models predict with small numpy twins of the scikit-learn objects
they were fitted with (the same arithmetic: float32 feature values against float64
thresholds, median imputation, standardisation), so they need no scikit-learn internals.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from dynpipe.errors import UserError

__all__ = ["decode_estimator", "encode_estimator"]


class _Imputed:
    """Median imputation as ``SimpleImputer(strategy="median")`` applies it."""

    def __init__(self, medians: np.ndarray) -> None:
        self.medians = np.asarray(medians, dtype=np.float64)

    def __call__(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X, dtype=np.float64)
        return np.where(np.isnan(X), self.medians, X)


class LinearArrays:
    """Imputer + standard scaler + ridge, as arrays (what ``RidgeSlowdown.model_`` does)."""

    def __init__(self, *, medians, mean, scale, coef, intercept) -> None:
        self.impute = _Imputed(medians)
        self.mean = np.asarray(mean, dtype=np.float64)
        self.scale = np.asarray(scale, dtype=np.float64)
        self.coef = np.asarray(coef, dtype=np.float64)
        self.intercept = float(intercept)

    def predict(self, X: np.ndarray) -> np.ndarray:
        Z = (self.impute(X) - self.mean) / self.scale
        return Z @ self.coef + self.intercept

    def set_params(self, **_: Any) -> LinearArrays:
        return self  # nothing to tune at predict time

    def to_json(self) -> dict[str, Any]:
        return {
            "medians": self.impute.medians.tolist(),
            "mean": self.mean.tolist(),
            "scale": self.scale.tolist(),
            "coef": self.coef.tolist(),
            "intercept": self.intercept,
        }


class ForestArrays:
    """Imputer + a regression forest, as node arrays (what ``ForestSlowdown.model_`` does).

    Each tree is ``(left, right, feature, threshold, value)`` per node; a leaf has
    ``left == -1``. Like scikit-learn, features are compared as float32 values.
    """

    def __init__(self, *, medians, trees: list[dict[str, list]]) -> None:
        self.impute = _Imputed(medians)
        self.trees = [
            (
                np.asarray(t["left"], dtype=np.int64),
                np.asarray(t["right"], dtype=np.int64),
                np.asarray(t["feature"], dtype=np.int64),
                np.asarray(t["threshold"], dtype=np.float64),
                np.asarray(t["value"], dtype=np.float64),
            )
            for t in trees
        ]

    def predict(self, X: np.ndarray) -> np.ndarray:
        x = self.impute(X).astype(np.float32).astype(np.float64)
        rows = np.arange(x.shape[0])
        total = np.zeros(x.shape[0])
        for left, right, feature, threshold, value in self.trees:
            node = np.zeros(x.shape[0], dtype=np.int64)
            inner = left[node] != -1
            while inner.any():
                go_left = x[rows, np.maximum(feature[node], 0)] <= threshold[node]
                node = np.where(inner, np.where(go_left, left[node], right[node]), node)
                inner = left[node] != -1
            total += value[node]
        return total / len(self.trees)

    def set_params(self, **_: Any) -> ForestArrays:
        return self  # one numpy pass per tree: no thread pool to size

    def to_json(self) -> dict[str, Any]:
        return {
            "medians": self.impute.medians.tolist(),
            "trees": [
                {
                    "left": left.tolist(),
                    "right": right.tolist(),
                    "feature": feature.tolist(),
                    "threshold": threshold.tolist(),
                    "value": value.tolist(),
                }
                for left, right, feature, threshold, value in self.trees
            ],
        }


def _fitted_common(est: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"n_features_in_": int(est.n_features_in_)}
    names = getattr(est, "feature_names_in_", None)
    if names is not None:
        out["feature_names_in_"] = [str(n) for n in names]
    return out


def _forest_arrays(model: Any) -> ForestArrays:
    if isinstance(model, ForestArrays):
        return model
    imputer, forest = model.steps[0][1], model.steps[-1][1]
    trees = []
    for tree in forest.estimators_:
        t = tree.tree_
        trees.append(
            {
                "left": t.children_left.tolist(),
                "right": t.children_right.tolist(),
                "feature": t.feature.tolist(),
                "threshold": t.threshold.tolist(),
                "value": t.value[:, 0, 0].tolist(),
            }
        )
    return ForestArrays(medians=imputer.statistics_, trees=trees)


def _linear_arrays(model: Any) -> LinearArrays:
    if isinstance(model, LinearArrays):
        return model
    imputer, scaler, ridge = (step for _, step in model.steps)
    return LinearArrays(
        medians=imputer.statistics_,
        mean=scaler.mean_,
        scale=scaler.scale_,
        coef=np.ravel(ridge.coef_),
        intercept=float(np.ravel(ridge.intercept_)[0])
        if np.ndim(ridge.intercept_)
        else float(ridge.intercept_),
    )


def _booster_json(booster: Any) -> dict[str, Any]:
    return json.loads(bytes(booster.save_raw(raw_format="json")))


def _booster(doc: dict[str, Any]) -> Any:
    import xgboost as xgb

    booster = xgb.Booster()
    booster.load_model(bytearray(json.dumps(doc).encode()))
    return booster


def encode_estimator(est: Any) -> dict[str, Any]:
    """A fitted estimator of ``dynpipe.predictor.estimator`` as a JSON-ready dict."""
    from dynpipe.predictor.estimator import (
        ForestSlowdown,
        NoInterference,
        RidgeSlowdown,
        SlowdownRegressor,
    )

    doc: dict[str, Any] = {"class": type(est).__name__, "params": est.get_params()}
    if isinstance(est, SlowdownRegressor):
        fitted = _fitted_common(est)
        fitted["monotone_constraints_"] = dict(getattr(est, "monotone_constraints_", {}))
        # xgboost's own JSON model format: plain numbers, portable across xgboost versions.
        fitted["booster"] = _booster_json(est.booster_)
        if getattr(est, "level_booster_", None) is not None:
            fitted["level_booster"] = _booster_json(est.level_booster_)
            fitted["level_columns_"] = [int(i) for i in est.level_columns_]
        if getattr(est, "spread_booster_", None) is not None:
            fitted["spread_booster"] = _booster_json(est.spread_booster_)
            fitted["spread_scale_"] = float(est.spread_scale_)
            fitted["level_log_sd_"] = float(est.level_log_sd_)
    elif isinstance(est, ForestSlowdown):
        fitted = {**_fitted_common(est), **_forest_arrays(est.model_).to_json()}
    elif isinstance(est, RidgeSlowdown):
        fitted = {**_fitted_common(est), **_linear_arrays(est.model_).to_json()}
    elif isinstance(est, NoInterference):
        fitted = _fitted_common(est)
    else:
        raise UserError(
            f"cannot store a {type(est).__name__} predictor; fit one of xgb, rf or ridge"
        )
    doc["fitted"] = fitted
    return doc


def decode_estimator(doc: dict[str, Any]) -> Any:
    """The estimator ``encode_estimator`` described, ready to predict."""
    from dynpipe.predictor.estimator import (
        ForestSlowdown,
        NoInterference,
        RidgeSlowdown,
        SlowdownRegressor,
    )

    classes = {
        c.__name__: c for c in (SlowdownRegressor, ForestSlowdown, RidgeSlowdown, NoInterference)
    }
    try:
        cls = classes[doc["class"]]
        params = dict(doc["params"])
        if cls is SlowdownRegressor:
            # Files written before the shape target hold one booster on the slowdown itself,
            # and files written before the spread have none.
            params.setdefault("target", "slowdown")
            params.setdefault("coverage", None)
        est = cls(**params)
        fitted = doc["fitted"]
        est.n_features_in_ = int(fitted["n_features_in_"])
        if "feature_names_in_" in fitted:
            est.feature_names_in_ = np.asarray(fitted["feature_names_in_"], dtype=object)
        if cls is SlowdownRegressor:
            est.booster_ = _booster(fitted["booster"])
            if est.target == "shape":
                est.level_booster_ = _booster(fitted["level_booster"])
                est.level_columns_ = np.asarray(fitted["level_columns_"], dtype=np.int64)
            if "spread_booster" in fitted:
                est.spread_booster_ = _booster(fitted["spread_booster"])
                est.spread_scale_ = float(fitted["spread_scale_"])
                est.level_log_sd_ = float(fitted["level_log_sd_"])
            est.monotone_constraints_ = {
                str(k): int(v) for k, v in fitted["monotone_constraints_"].items()
            }
        elif cls is ForestSlowdown:
            est.model_ = ForestArrays(medians=fitted["medians"], trees=fitted["trees"])
        elif cls is RidgeSlowdown:
            est.model_ = LinearArrays(
                medians=fitted["medians"],
                mean=fitted["mean"],
                scale=fitted["scale"],
                coef=fitted["coef"],
                intercept=fitted["intercept"],
            )
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(
            f"the predictor's estimator entry is malformed ({type(exc).__name__}: "
            f"{str(exc)[:80]}); refit it with `dynpipe predictor fit`"
        ) from None
    except Exception as exc:  # xgboost refusing the booster text
        raise UserError(
            f"the predictor's xgboost model does not load ({str(exc).splitlines()[0][:100]}); "
            "refit it with `dynpipe predictor fit`"
        ) from None
    return est
