"""Slowdown estimators: the xgboost model and the baselines it is compared with.

All follow scikit-learn conventions (``__init__`` only stores hyper-parameters, ``fit``
returns ``self``, learned attributes end in ``_``, ``predict`` checks it is fitted), so
``sklearn.base.clone``, ``GridSearchCV`` and grouped cross-validation just work. ``X`` is the
output of ``features.extract_features``; ``y`` and predictions are slowdown factors
(time under interference / time alone).

The learned models regress ``log(slowdown)``: errors are relative, a slowdown of 2 and of 0.5
are equally far from 1, and the prediction ``exp(.)`` is always positive. The baselines clip
predictions at ``min_slowdown`` (1 by default); the xgboost model does not by default: on the
H200 profiles 7 % of the interfered rows measure below 0.9, nearly all of them launch-bound
layers (VGG's last two linear layers run at a median 0.69 of their alone time beside a
full-duty GEMM, at both batch sizes), so a floor at 1 is a bias there, not a guard.

- ``SlowdownRegressor``: gradient-boosted trees (xgboost), monotone in the telemetry that
  physics orders (more utilisation by other processes, all else equal, never makes a layer
  faster; a higher clock never makes it slower). By default (``target="shape"``) two
  boosters: one for the *level*, the mean log slowdown of the layers measured in one
  telemetry window, from the window's telemetry and batch size only (one row per window);
  one for the *shape*, each layer's log slowdown relative to that level. Their sum is the
  prediction, so absolute predictions stay meaningful, while the runtime, which scales each
  device's predictions to what its held layers measure, uses only the shape: the level
  cancels there exactly.
- ``ForestSlowdown``, ``RidgeSlowdown``: a random forest (what the original DynPipe used, there
  per stage over GPU counters) and a linear model, on the same features.
- ``NoInterference``: slowdown 1 everywhere (a planner that ignores interference).
- ``StageMean``: what a measurement-only system knows; every layer on a device is assumed
  to slow down by the factor measured for the stage that device runs now. It reads that
  measured factor from column ``stage_column`` of ``X`` (see ``stages.measured_stage_slowdown``).

The xgboost model pickles its boosters in xgboost's own JSON format (see ``__getstate__``),
never as pickled xgboost objects, so a saved predictor does not depend on xgboost's pickle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_is_fitted

from dynpipe.errors import UserError
from dynpipe.predictor.features import check_same_names

__all__ = [
    "ESTIMATORS",
    "LEVEL_FEATURES",
    "PHYSICS_MONOTONE",
    "TARGETS",
    "ForestSlowdown",
    "NoInterference",
    "RidgeSlowdown",
    "SlowdownRegressor",
    "StageMean",
    "level_columns",
    "make_estimator",
    "window_ids",
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


TARGETS: tuple[str, ...] = ("shape", "slowdown")
# Features constant over the layers of one telemetry window: what the level may depend on.
LEVEL_FEATURES: tuple[str, ...] = ("log_batch_size",)


def level_columns(names: Sequence[str]) -> list[int]:
    """Positions of the features a window's level is learned from: its telemetry and the
    batch size, which every layer measured in the window shares."""
    return [i for i, n in enumerate(names) if n.startswith("tel_") or n in LEVEL_FEATURES]


def window_ids(X: np.ndarray, columns: Sequence[int]) -> np.ndarray:
    """Rows measured in one telemetry window: equal values (NaN equal to NaN) in ``columns``.

    The profiler writes one window's telemetry means into every row it measured then, so
    rows of one (model, batch size, condition) share them and rows of others do not.
    """
    frame = pd.DataFrame(X[:, list(columns)])
    return frame.groupby(list(frame.columns), dropna=False, sort=False).ngroup().to_numpy()


class SlowdownRegressor(_SlowdownBase):
    """Gradient-boosted trees (xgboost) on log-slowdown, monotone where physics says so.

    The default size (150 trees of depth 6) is set by the run-time budget: prediction cost
    grows with trees x rows, and 200 layers x 8 devices x 2 phases is 3200 rows per call.

    ``target``: ``"shape"`` fits a level booster (per telemetry window, from the telemetry
    and batch size) and a shape booster (each layer relative to its window's level; see the
    module docstring); ``"slowdown"`` one booster on the log slowdown itself (how predictors
    were fitted before the shape target, and how their files load).
    ``monotone``: ``"physics"`` applies ``PHYSICS_MONOTONE`` to the columns present, a dict
    gives ``{feature: +1|-1}`` explicitly, ``None`` turns constraints off. Constraints bind by
    feature name, so they need a DataFrame ``X`` (as ``extract_features`` returns); with the
    shape target they bind both boosters, so their sum keeps them too.
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
        target: str = "shape",
        monotone: str | Mapping[str, int] | None = "physics",
        min_slowdown: float | None = None,
        coverage: float | None = 0.8,
        spread_folds: int = 5,
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
        self.target = target
        self.monotone = monotone
        self.min_slowdown = min_slowdown
        self.coverage = coverage
        self.spread_folds = spread_folds
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

    def _boost(
        self,
        X: np.ndarray,
        y: np.ndarray,
        names: list[str] | None,
        sample_weight,
        **override,
    ):
        import xgboost as xgb

        cons = self.monotone_constraints_ if not override else {}
        params = dict(
            n_estimators=self.n_estimators,
            max_depth=self.max_depth,
            learning_rate=self.learning_rate,
            subsample=self.subsample,
            colsample_bytree=self.colsample_bytree,
            min_child_weight=self.min_child_weight,
            reg_lambda=self.reg_lambda,
            monotone_constraints=tuple(cons.get(n, 0) for n in names) if cons and names else None,
            tree_method="hist",
            n_jobs=self.n_jobs,
            random_state=self.random_state,
        )
        params.update(override)
        model = xgb.XGBRegressor(**params)
        model.fit(X, y, sample_weight=sample_weight)
        return model.get_booster()

    def fit(self, X, y, sample_weight=None, runs=None, groups=None) -> SlowdownRegressor:
        """Fit on features ``X`` and slowdowns ``y``. ``runs``: one id per row, equal for the
        rows measured in one telemetry window; by default, rows with equal telemetry and batch
        size (``window_ids``). ``groups``: one label per row (the architecture) that the
        spread is calibrated across: with ``coverage`` set, the model is refitted
        ``spread_folds`` times each holding out whole groups, and the spread is learned from
        those held-out errors (``spread``)."""
        if self.target not in TARGETS:
            raise UserError(f"target must be one of {', '.join(TARGETS)}, got {self.target!r}")
        arr, y = self._check_fit_input(X, y)
        names = list(self.feature_names_in_) if hasattr(self, "feature_names_in_") else None
        if runs is not None:
            ids = np.asarray(runs)
        elif level_columns(names or []):
            ids = window_ids(arr, level_columns(names or []))
        else:
            ids = np.zeros(len(arr), dtype=np.int64)
        if ids.shape != (len(arr),):
            raise UserError(f"runs has {ids.shape} entries; give one per row ({len(arr)})")
        self._fit_point(arr, y, names, sample_weight, ids)
        for attr in ("spread_booster_", "spread_scale_", "level_log_sd_"):
            if hasattr(self, attr):
                delattr(self, attr)
        if self.coverage is not None:
            from dynpipe.predictor.spread import fit_spread

            fit_spread(self, arr=arr, log_y=np.log(y), names=names, runs=ids, groups=groups)
        return self

    def _fit_point(self, arr, y, names, sample_weight, ids) -> None:
        self.monotone_constraints_ = self._constraints(names)
        log_y = np.log(y)
        for attr in ("level_booster_", "level_columns_"):
            if hasattr(self, attr):
                delattr(self, attr)
        if self.target == "slowdown":
            self.booster_ = self._boost(arr, log_y, names, sample_weight)
            return
        if names is None:
            raise UserError(
                "target='shape' needs X as a DataFrame with the feature names (from "
                "dynpipe.predictor.extract_features) to find the telemetry columns"
            )
        cols = level_columns(names)
        if not cols:
            raise UserError(
                "target='shape' needs tel_* or log_batch_size features for the level; "
                "fit with target='slowdown' or give the telemetry"
            )
        by_window = pd.Series(log_y).groupby(ids, sort=False)
        level = by_window.transform("mean").to_numpy()
        # The level is one number per window: learn it from one row per window (repeating it
        # once per layer would weigh windows by their layer count and blunt min_child_weight).
        first = by_window.head(1).index.to_numpy()
        weight = None
        if sample_weight is not None:
            sw = np.asarray(sample_weight, dtype=np.float64)
            weight = pd.Series(sw).groupby(ids, sort=False).transform("mean").to_numpy()[first]
        self.level_columns_ = np.asarray(cols, dtype=np.int64)
        self.level_booster_ = self._boost(
            arr[first][:, cols], level[first], [names[i] for i in cols], weight
        )
        self.booster_ = self._boost(arr, log_y - level, names, sample_weight)

    def _predict_log(self, X: np.ndarray) -> np.ndarray:
        out = self.booster_.inplace_predict(X)
        if getattr(self, "level_booster_", None) is not None:
            # A device's (or a window's) rows come together and share their level inputs:
            # predict the level once per run of equal rows (np.unique over rows cost more
            # than the shape booster itself on 3200 rows).
            sub = X[:, self.level_columns_]
            same = (sub[1:] == sub[:-1]) | (np.isnan(sub[1:]) & np.isnan(sub[:-1]))
            start = np.concatenate([[True], ~same.all(axis=1)])
            level = self.level_booster_.inplace_predict(np.ascontiguousarray(sub[start]))
            out = out + level[np.cumsum(start) - 1]
        return out

    def predict_shape_log(self, X: np.ndarray) -> np.ndarray:
        """The shape part of the log slowdown alone (what survives per-device calibration);
        the whole prediction for ``target="slowdown"``."""
        return self.booster_.inplace_predict(X)

    def predict_log_sd(self, X, *, calibrated: bool = True) -> np.ndarray:
        """Standard deviation of the error of ``log(predicted time)`` per row, learned on
        held-out architectures (``spread``). ``calibrated``: of a prediction rescaled to its
        device's measured layers (what the runtime does), else of the absolute prediction
        (the level's error added). ``None`` rows: the estimator was fitted without a spread."""
        from dynpipe.predictor.spread import log_sd

        names, arr = _as_matrix(X)
        if names is not None:
            arr = self._check_predict_input(X)
        return log_sd(self, arr=arr, calibrated=calibrated)

    def set_predict_threads(self, n: int) -> None:
        """Threads for prediction. The runtime predicts a few hundred rows between steps:
        one thread does that in well under a millisecond, while a pool of them wakes up to
        contend with the training process's own threads (measured: 3 ms vs 5-30 ms)."""
        self.n_jobs = n
        for attr in ("booster_", "level_booster_", "spread_booster_"):
            if getattr(self, attr, None) is not None:
                getattr(self, attr).set_param({"nthread": n})

    def __getstate__(self) -> dict:
        # A copy: object.__getstate__ may hand back the live __dict__.
        state = dict(super().__getstate__())
        for attr in ("booster_", "level_booster_", "spread_booster_"):
            booster = state.pop(attr, None)
            if booster is not None:
                # xgboost's own JSON model format: portable across xgboost versions and
                # readable, unlike a pickled Booster.
                state[f"{attr}json_"] = bytes(booster.save_raw(raw_format="json"))
        return state

    def __setstate__(self, state: dict) -> None:
        raws = {
            attr: state.pop(f"{attr}json_", None)
            for attr in ("booster_", "level_booster_", "spread_booster_")
        }
        state.setdefault("target", "slowdown")  # pickled before the shape target existed
        state.setdefault("coverage", None)  # and before the spread
        state.setdefault("spread_folds", 5)
        super().__setstate__(state)
        for attr, raw in raws.items():
            if raw is not None:
                import xgboost as xgb

                booster = xgb.Booster()
                booster.load_model(bytearray(raw))
                setattr(self, attr, booster)


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
