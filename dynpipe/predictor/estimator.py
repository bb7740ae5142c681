"""Slowdown estimators: the xgboost model and the baselines it is compared with.

All follow scikit-learn conventions (``__init__`` only stores hyper-parameters, ``fit``
returns ``self``, learned attributes end in ``_``, ``predict`` checks it is fitted), so
``sklearn.base.clone``, ``GridSearchCV`` and grouped cross-validation just work. ``X`` is the
output of ``features.extract_features``; ``y`` and predictions are slowdown factors
(time under interference / time alone).

The learned models regress ``log(slowdown)``: errors are relative, a slowdown of 2 and of 0.5
are equally far from 1, and the prediction ``exp(.)`` is always positive. Predictions are
clipped at ``min_slowdown`` (1 by default): other processes on a device do not make a layer
faster, and the small dips below 1 in measured data are timing noise.

- ``SlowdownRegressor``: gradient-boosted trees (xgboost), monotone in the telemetry that
  physics orders (more utilisation by other processes never makes a layer faster; a higher
  clock never makes it slower).
- ``ForestSlowdown``, ``RidgeSlowdown``: a random forest (what the original DynPipe used, there
  per stage over GPU counters) and a linear model, on the same features.
- ``NoInterference``: slowdown 1 everywhere (a planner that ignores interference).
- ``StageMean``: what a measurement-only system knows; every layer on a device is assumed
  to slow down by the factor measured for the stage that device runs now. It reads that
  measured factor from column ``stage_column`` of ``X`` (see ``stages.measured_stage_slowdown``).

The xgboost model pickles its booster in xgboost's own JSON format (see ``__getstate__``),
never as a pickled xgboost object, so a saved predictor does not depend on xgboost's pickle.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_is_fitted

from dynpipe.errors import UserError
from dynpipe.predictor.features import check_same_names

__all__ = [
    "ESTIMATORS",
    "PHYSICS_MONOTONE",
    "ForestSlowdown",
    "NoInterference",
    "RidgeSlowdown",
    "SlowdownRegressor",
    "StageMean",
    "make_estimator",
]

# +1: slowdown never decreases as the feature grows; -1: never increases.
PHYSICS_MONOTONE: dict[str, int] = {
    "tel_other_util": 1,
    "tel_other_mem_util": 1,
    "tel_other_procs": 1,
    "tel_throttle": 1,
    "tel_clock_mhz": -1,
}


def _as_matrix(X) -> tuple[list[str] | None, np.ndarray]:
    if isinstance(X, pd.DataFrame):
        return [str(c) for c in X.columns], X.to_numpy(dtype=np.float64)
    arr = np.asarray(X, dtype=np.float64)
    if arr.ndim != 2:
        raise UserError(f"features must be a 2-D matrix, got shape {arr.shape}")
    return None, arr


class _SlowdownBase(RegressorMixin, BaseEstimator):
    """Shared fit/predict plumbing: input checks, log target, clipping."""

    min_slowdown: float | None = 1.0

    def set_predict_threads(self, n: int) -> None:
        """Threads used by ``predict`` (estimators without a thread pool ignore it)."""
        if hasattr(self, "n_jobs"):
            self.n_jobs = n

    def _check_fit_input(self, X, y) -> tuple[np.ndarray, np.ndarray]:
        names, arr = _as_matrix(X)
        y = np.asarray(y, dtype=np.float64).ravel()
        if y.shape[0] != arr.shape[0]:
            raise UserError(f"X has {arr.shape[0]} rows but y has {y.shape[0]}")
        bad = int((~np.isfinite(y) | (y <= 0)).sum())
        if bad:
            raise UserError(
                f"{bad} of {len(y)} slowdown targets are <= 0 or not finite; slowdown is "
                "time_ms / time_alone_ms and must be positive (check the profile for empty timings)"
            )
        if arr.shape[0] == 0:
            raise UserError("cannot fit a slowdown predictor on 0 rows")
        self.n_features_in_ = arr.shape[1]
        if names is not None:
            self.feature_names_in_ = np.asarray(names, dtype=object)
        elif hasattr(self, "feature_names_in_"):
            del self.feature_names_in_
        return arr, y

    def _check_predict_input(self, X) -> np.ndarray:
        check_is_fitted(self)
        names, arr = _as_matrix(X)
        known = getattr(self, "feature_names_in_", None)
        if names is not None and known is not None:
            if names != list(known):
                check_same_names(list(known), names, what="feature matrix")
                raise UserError(
                    "feature matrix has the predictor's columns in a different order; build it "
                    "with dynpipe.predictor.extract_features(df, schema=predictor.schema)"
                )
        elif arr.shape[1] != self.n_features_in_:
            raise UserError(
                f"feature matrix has {arr.shape[1]} columns but the predictor was fitted on "
                f"{self.n_features_in_}"
            )
        return arr

    def _finish(self, log_slowdown: np.ndarray) -> np.ndarray:
        out = np.exp(np.asarray(log_slowdown, dtype=np.float64))
        if self.min_slowdown is not None:
            out = np.maximum(out, self.min_slowdown)
        return out

    def predict(self, X) -> np.ndarray:
        """Predicted slowdown factor per row."""
        return self._finish(self._predict_log(self._check_predict_input(X)))

    def predict_array(self, X: np.ndarray) -> np.ndarray:
        """``predict`` for a float matrix already in ``feature_names_in_`` order (no checks).

        The run-time path: it skips pandas and name checks, so only pass matrices built by
        this package against the same schema.
        """
        return self._finish(self._predict_log(X))

    def _predict_log(self, X: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class SlowdownRegressor(_SlowdownBase):
    """Gradient-boosted trees (xgboost) on log-slowdown, monotone where physics says so.

    The default size (150 trees of depth 6) is set by the run-time budget: prediction cost
    grows with trees x rows, and 200 layers x 8 devices x 2 phases is 3200 rows per call.

    ``monotone``: ``"physics"`` applies ``PHYSICS_MONOTONE`` to the columns present, a dict
    gives ``{feature: +1|-1}`` explicitly, ``None`` turns constraints off. Constraints bind by
    feature name, so they need a DataFrame ``X`` (as ``extract_features`` returns).
    """

    def __init__(
        self,
        *,
        n_estimators: int = 150,
        max_depth: int = 6,
        learning_rate: float = 0.1,
        subsample: float = 0.8,
        colsample_bytree: float = 0.8,
        min_child_weight: float = 1.0,
        reg_lambda: float = 1.0,
        monotone: str | Mapping[str, int] | None = "physics",
        min_slowdown: float | None = 1.0,
        n_jobs: int | None = None,
        random_state: int = 0,
    ) -> None:
        self.n_estimators = n_estimators
        self.max_depth = max_depth
        self.learning_rate = learning_rate
        self.subsample = subsample
        self.colsample_bytree = colsample_bytree
        self.min_child_weight = min_child_weight
        self.reg_lambda = reg_lambda
        self.monotone = monotone
        self.min_slowdown = min_slowdown
        self.n_jobs = n_jobs
        self.random_state = random_state

    def _constraints(self, names: list[str] | None) -> dict[str, int]:
        if self.monotone is None:
            return {}
        if self.monotone == "physics":
            table: Mapping[str, int] = PHYSICS_MONOTONE
        elif isinstance(self.monotone, Mapping):
            table = self.monotone
        else:
            raise UserError(f"monotone must be 'physics', a dict or None, got {self.monotone!r}")
        if names is None:
            return {}
        return {n: int(table[n]) for n in names if n in table and int(table[n]) != 0}

    def fit(self, X, y, sample_weight=None) -> SlowdownRegressor:
        import xgboost as xgb

        arr, y = self._check_fit_input(X, y)
        names = list(self.feature_names_in_) if hasattr(self, "feature_names_in_") else None
        self.monotone_constraints_ = self._constraints(names)
        cons = tuple(self.monotone_constraints_.get(n, 0) for n in names) if names else None
        model = xgb.XGBRegressor(
            n_estimators=self.n_estimators,
            max_depth=self.max_depth,
            learning_rate=self.learning_rate,
            subsample=self.subsample,
            colsample_bytree=self.colsample_bytree,
            min_child_weight=self.min_child_weight,
            reg_lambda=self.reg_lambda,
            monotone_constraints=cons if self.monotone_constraints_ else None,
            tree_method="hist",
            n_jobs=self.n_jobs,
            random_state=self.random_state,
        )
        model.fit(arr, np.log(y), sample_weight=sample_weight)
        self.booster_ = model.get_booster()
        return self

    def _predict_log(self, X: np.ndarray) -> np.ndarray:
        return self.booster_.inplace_predict(X)

    def set_predict_threads(self, n: int) -> None:
        """Threads for prediction. The runtime predicts a few hundred rows between steps:
        one thread does that in well under a millisecond, while a pool of them wakes up to
        contend with the training process's own threads (measured: 3 ms vs 5-30 ms)."""
        self.n_jobs = n
        if hasattr(self, "booster_"):
            self.booster_.set_param({"nthread": n})

    def __getstate__(self) -> dict:
        # A copy: object.__getstate__ may hand back the live __dict__.
        state = dict(super().__getstate__())
        booster = state.pop("booster_", None)
        if booster is not None:
            # xgboost's own JSON model format: portable across xgboost versions and readable,
            # unlike a pickled Booster.
            state["booster_json_"] = bytes(booster.save_raw(raw_format="json"))
        return state

    def __setstate__(self, state: dict) -> None:
        raw = state.pop("booster_json_", None)
        super().__setstate__(state)
        if raw is not None:
            import xgboost as xgb

            booster = xgb.Booster()
            booster.load_model(bytearray(raw))
            self.booster_ = booster


class ForestSlowdown(_SlowdownBase):
    """Random forest on log-slowdown (missing telemetry imputed by the training median)."""

    def __init__(
        self,
        *,
        n_estimators: int = 300,
        min_samples_leaf: int = 2,
        max_features: float = 0.5,
        min_slowdown: float | None = 1.0,
        n_jobs: int | None = None,
        random_state: int = 0,
    ) -> None:
        self.n_estimators = n_estimators
        self.min_samples_leaf = min_samples_leaf
        self.max_features = max_features
        self.min_slowdown = min_slowdown
        self.n_jobs = n_jobs
        self.random_state = random_state

    def fit(self, X, y, sample_weight=None) -> ForestSlowdown:
        from sklearn.ensemble import RandomForestRegressor
        from sklearn.impute import SimpleImputer
        from sklearn.pipeline import make_pipeline

        arr, y = self._check_fit_input(X, y)
        self.model_ = make_pipeline(
            SimpleImputer(strategy="median", keep_empty_features=True),
            RandomForestRegressor(
                n_estimators=self.n_estimators,
                min_samples_leaf=self.min_samples_leaf,
                max_features=self.max_features,
                n_jobs=self.n_jobs,
                random_state=self.random_state,
            ),
        )
        self.model_.fit(arr, np.log(y), randomforestregressor__sample_weight=sample_weight)
        return self

    def set_predict_threads(self, n: int) -> None:
        self.n_jobs = n
        if hasattr(self, "model_"):
            self.model_.set_params(randomforestregressor__n_jobs=n)

    def _predict_log(self, X: np.ndarray) -> np.ndarray:
        return self.model_.predict(X)


class RidgeSlowdown(_SlowdownBase):
    """Ridge regression on standardised features, log-slowdown target."""

    def __init__(self, *, alpha: float = 1.0, min_slowdown: float | None = 1.0) -> None:
        self.alpha = alpha
        self.min_slowdown = min_slowdown

    def fit(self, X, y, sample_weight=None) -> RidgeSlowdown:
        from sklearn.impute import SimpleImputer
        from sklearn.linear_model import Ridge
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        arr, y = self._check_fit_input(X, y)
        self.model_ = make_pipeline(
            SimpleImputer(strategy="median", keep_empty_features=True),
            StandardScaler(),
            Ridge(alpha=self.alpha),
        )
        self.model_.fit(arr, np.log(y), ridge__sample_weight=sample_weight)
        return self

    def _predict_log(self, X: np.ndarray) -> np.ndarray:
        return self.model_.predict(X)


class NoInterference(_SlowdownBase):
    """Slowdown 1 for every layer: a plan made as if the devices were not shared."""

    def fit(self, X, y=None, sample_weight=None) -> NoInterference:
        _names, arr = _as_matrix(X)
        self.n_features_in_ = arr.shape[1]
        if _names is not None:
            self.feature_names_in_ = np.asarray(_names, dtype=object)
        return self

    def _predict_log(self, X: np.ndarray) -> np.ndarray:
        return np.zeros(X.shape[0])


class StageMean(RegressorMixin, BaseEstimator):
    """Measurement only: each layer slows down by its device's measured current-stage factor.

    ``X[stage_column]`` holds, per row, the slowdown measured for the stage that the row's
    device runs now (sum of measured stage time / sum of alone time). Nothing is learned; the
    estimator exists so the baseline runs through the same evaluation code as the others.
    """

    def __init__(self, *, stage_column: str = "measured_stage_slowdown") -> None:
        self.stage_column = stage_column

    def fit(self, X, y=None, sample_weight=None) -> StageMean:
        self._column(X)
        self.n_features_in_ = X.shape[1]
        return self

    def _column(self, X) -> np.ndarray:
        if not isinstance(X, pd.DataFrame) or self.stage_column not in X.columns:
            raise UserError(
                f"StageMean needs column {self.stage_column!r} (the measured slowdown of each "
                "row's current stage); add it with dynpipe.predictor.stages.measured_stage_slowdown"
            )
        return X[self.stage_column].to_numpy(dtype=np.float64)

    def predict(self, X) -> np.ndarray:
        check_is_fitted(self)
        return self._column(X)


ESTIMATORS: dict[str, type[BaseEstimator]] = {
    "xgb": SlowdownRegressor,
    "rf": ForestSlowdown,
    "ridge": RidgeSlowdown,
    "stage-mean": StageMean,
    "none": NoInterference,
}


def make_estimator(name: str, **params) -> BaseEstimator:
    """An estimator by its short name (``xgb``, ``rf``, ``ridge``, ``stage-mean``, ``none``)."""
    if name not in ESTIMATORS:
        raise UserError(f"unknown estimator {name!r}; choose one of {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name](**params)
