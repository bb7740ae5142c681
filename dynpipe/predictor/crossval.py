"""Grouped cross-validation of slowdown estimators, at layer and at stage level.

Splits hold out whole groups, so a score says how the predictor does on something it has
never seen:

- ``condition``: whole interference conditions (device + condition id): leave one condition
  out by default, ``GroupKFold`` with ``n_folds > 0`` (several held out at once, harsher);
- ``model``: whole models, ``LeaveOneGroupOut`` (needs two or more models);
- ``interferer``: whole interferer kinds (every intensity and job count of, say, ``copy``);
  extrapolation to a new kind of co-located job, the hardest case;
- ``device``: whole devices (``LeaveOneGroupOut`` over ``device_name``; needs two or more),
  e.g. trained on H100 profiles, scored on H200 ones.

Every estimator is scored on the same folds from out-of-fold predictions. Hyper-parameters are
fixed, or with ``tune`` chosen by an inner ``GroupKFold`` on the training folds only (nested
cross-validation): test folds never choose anything.

Scores are absolute percentage errors of predicted time (``time_alone_ms`` x predicted
slowdown) against measured ``time_ms``, on interfered rows only (condition ``none`` is 1 by
construction and would flatter every model). Per layer: one error per (layer, phase, run).
Per stage: one error per stage of the balanced 2- and 4-stage splits (``stages``), fwd + bwd
summed. ``StageMean`` learns nothing; it is scored, for every split and every stage ``k`` the
device might run now, on the layers and stages *other than* ``k`` (on ``k`` itself it is exact
by construction): that is what a measurement-only system must guess when it moves layers.
``<name>+measured`` combines both, as the run time can: the learned per-layer times rescaled so
the current stage matches its measurement, scored the same way as ``StageMean``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, clone
from sklearn.model_selection import GridSearchCV, GroupKFold, LeaveOneGroupOut

from dynpipe.errors import UserError
from dynpipe.predictor.estimator import StageMean
from dynpipe.predictor.features import FeatureSchema, extract_features
from dynpipe.predictor.floor import sibling_floor
from dynpipe.predictor.stages import (
    assign_stages,
    measured_stage_slowdown,
    run_ids,
    run_keys,
    stage_sums,
)

__all__ = [
    "SPLITS",
    "TUNE_GRID",
    "Evaluation",
    "ape_summary",
    "cv_folds",
    "evaluate",
    "score",
    "takes_runs",
]

SPLITS: tuple[str, ...] = ("condition", "model", "interferer", "device")
# The central interval whose coverage reports give (the estimators' default ``coverage``).
COVERAGE = 0.8
# Grid for nested tuning of the xgboost model (--tune); small on purpose: each point is a
# full inner cross-validation.
TUNE_GRID: dict[str, list] = {
    "max_depth": [4, 6, 8],
    "learning_rate": [0.03, 0.1],
    "n_estimators": [200, 500],
}


@dataclass
class Evaluation:
    """Result of ``evaluate``: a JSON-able summary and the raw out-of-fold predictions."""

    summary: dict
    layers: pd.DataFrame = field(repr=False)
    stages: pd.DataFrame = field(repr=False)


def ape_summary(measured: np.ndarray, predicted: np.ndarray) -> dict:
    """MAPE, median and p90 absolute percentage error (percent) and the count."""
    m = np.asarray(measured, dtype=np.float64)
    p = np.asarray(predicted, dtype=np.float64)
    ape = 100.0 * np.abs(p - m) / m
    if len(ape) == 0:
        return {"mape": None, "p50": None, "p90": None, "n": 0}
    return {
        "mape": round(float(np.mean(ape)), 3),
        "p50": round(float(np.percentile(ape, 50)), 3),
        "p90": round(float(np.percentile(ape, 90)), 3),
        "n": len(ape),
    }


def cv_folds(
    df: pd.DataFrame, *, split: str, n_folds: int = 0
) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """Train/test row positions for a split, or ``None`` if the data cannot support it.

    ``n_folds`` applies to the condition split: 0 leaves one condition out per fold,
    ``k > 0`` uses ``GroupKFold(k)``.
    """
    if split == "condition":
        groups = (df["device_name"].astype(str) + "/" + df["condition"].astype(str)).to_numpy()
        n_groups = len(np.unique(groups))
        if n_groups < 2:
            return None
        if n_folds <= 0 or n_folds >= n_groups:
            return list(LeaveOneGroupOut().split(df, groups=groups))
        return list(GroupKFold(n_splits=n_folds).split(df, groups=groups))
    if split == "model":
        groups = df["model"].astype(str).to_numpy()
        if len(np.unique(groups)) < 2:
            return None
        return list(LeaveOneGroupOut().split(df, groups=groups))
    if split == "device":
        groups = df["device_name"].astype(str).to_numpy()
        if len(np.unique(groups)) < 2:
            return None
        return list(LeaveOneGroupOut().split(df, groups=groups))
    if split == "interferer":
        kinds = df["interferer"].astype(str).to_numpy()
        held = [k for k in pd.unique(kinds) if k != "none"]
        if len(held) < 2:
            return None
        pos = np.arange(len(df))
        # 'none' rows always train: the alone behaviour is known for every kind.
        return [(pos[kinds != k], pos[kinds == k]) for k in held]
    raise UserError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")


def _held_out(df: pd.DataFrame, split: str) -> np.ndarray:
    """The group label each row has under ``split`` (what a fold holds out)."""
    if split == "condition":
        return (df["device_name"].astype(str) + "/" + df["condition"].astype(str)).to_numpy()
    return df["device_name" if split == "device" else split].astype(str).to_numpy()


def _inner_groups(df: pd.DataFrame, split: str) -> np.ndarray:
    if split in ("model", "device"):
        return df["model" if split == "model" else "device_name"].astype(str).to_numpy()
    return (df["device_name"].astype(str) + "/" + df["condition"].astype(str)).to_numpy()


def takes_runs(est: BaseEstimator) -> bool:
    """Whether ``est.fit`` takes ``runs=`` (which rows share one telemetry window)."""
    return "runs" in inspect.signature(type(est).fit).parameters


def takes_groups(est: BaseEstimator) -> bool:
    """Whether ``est.fit`` takes ``groups=`` (the architecture of each row, which its spread
    is calibrated across)."""
    return "groups" in inspect.signature(type(est).fit).parameters


def fit_extras(est: BaseEstimator, df: pd.DataFrame, rows: np.ndarray | None = None) -> dict:
    """The ``runs=`` / ``groups=`` fit arguments ``est`` takes, for ``df``'s rows ``rows``."""
    pos = np.arange(len(df)) if rows is None else rows
    extra: dict = {}
    if takes_runs(est):
        extra["runs"] = run_ids(df)[pos]
    if takes_groups(est) and "model" in df.columns:
        extra["groups"] = df["model"].astype(str).to_numpy()[pos]
    return extra


def _log_sd(model: BaseEstimator, X: pd.DataFrame) -> np.ndarray | None:
    """``[2, n]``: the calibrated and the absolute spread of ``model``'s predictions."""
    fitted = getattr(model, "best_estimator_", model)
    if not hasattr(fitted, "predict_log_sd"):
        return None
    cal = fitted.predict_log_sd(X, calibrated=True)
    if cal is None:
        return None
    return np.stack([cal, fitted.predict_log_sd(X, calibrated=False)])


def _fit_predict(
    est: BaseEstimator,
    X: pd.DataFrame,
    y: np.ndarray,
    folds: list[tuple[np.ndarray, np.ndarray]],
    *,
    tune_groups: np.ndarray | None,
    df: pd.DataFrame,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Out-of-fold slowdowns and, for estimators with a spread, out-of-fold ``log_sd``
    (``[2, n]``: of the calibrated prediction, of the absolute one)."""
    oof = np.full(len(X), np.nan)
    oof_sd: np.ndarray | None = None
    for train, test in folds:
        model = clone(est)
        extra = fit_extras(est, df, train)
        if tune_groups is not None:
            n_inner = min(3, len(np.unique(tune_groups[train])))
            model = GridSearchCV(
                model,
                TUNE_GRID,
                cv=GroupKFold(n_splits=n_inner),
                scoring="neg_mean_absolute_percentage_error",
                n_jobs=1,
            )
            extra.pop("groups", None)  # the search's own folds take ``groups``
            model.fit(X.iloc[train], y[train], groups=tune_groups[train], **extra)
        else:
            model.fit(X.iloc[train], y[train], **extra)
        oof[test] = model.predict(X.iloc[test])
        sd = _log_sd(model, X.iloc[test])
        if sd is not None:
            if oof_sd is None:
                oof_sd = np.full((2, len(X)), np.nan)
            oof_sd[:, test] = sd
    return oof, oof_sd


def _layer_frame(
    df: pd.DataFrame, pred_ms: np.ndarray, log_sd: np.ndarray | None = None, **labels
) -> pd.DataFrame:
    keys = run_keys(df)
    out = df[[*keys, "layer_index", "kind", "phase", "interferer", "time_ms"]].copy()
    out = out.rename(columns={"time_ms": "measured_ms"})
    out["predicted_ms"] = pred_ms
    if log_sd is not None:
        out["log_sd"] = log_sd
    for k, v in labels.items():
        out[k] = v
    return out


def _breakdown(frame: pd.DataFrame, by: str) -> dict:
    return {str(k): _frame_summary(g) for k, g in frame.groupby(by, sort=True)}


def _frame_summary(frame: pd.DataFrame) -> dict:
    """``ape_summary`` of a frame, with the share of measurements inside the predicted
    ``COVERAGE`` interval where the frame carries a spread (``log_sd``)."""
    out = ape_summary(frame["measured_ms"].to_numpy(), frame["predicted_ms"].to_numpy())
    if "log_sd" in frame and frame["log_sd"].notna().any():
        out["coverage"] = interval_coverage(frame, coverage=COVERAGE)
    return out


def interval_coverage(frame: pd.DataFrame, *, coverage: float) -> float:
    """Share of rows whose measured time lies in the central ``coverage`` interval of the
    prediction, ``predicted * exp(+- z * log_sd)``."""
    from dynpipe.predictor.spread import z_of

    sub = frame.dropna(subset=["log_sd"])
    err = np.abs(np.log(sub["measured_ms"].to_numpy() / sub["predicted_ms"].to_numpy()))
    return round(float(np.mean(err <= z_of(coverage) * sub["log_sd"].to_numpy())), 4)


def data_summary(df: pd.DataFrame, schema: FeatureSchema) -> dict[str, object]:
    """What a report's ``data`` block says of the profiles it scored: rows, devices, models,
    conditions, and the feature schema's layer kinds and features."""
    return {
        "rows": len(df),
        "interfered_rows": int((df["interferer"] != "none").sum()),
        "devices": sorted(map(str, df["device_name"].unique())),
        "models": sorted(map(str, df["model"].unique())),
        "conditions": sorted(map(str, df["condition"].unique())),
        "layer_kinds": list(schema.kinds),
        "features": schema.names,
    }


def _summarise(layers: pd.DataFrame, stages: pd.DataFrame) -> dict:
    lay = layers[layers["interferer"] != "none"].dropna(subset=["predicted_ms"])
    stg = stages[stages["interferer"] != "none"]
    return {
        "layer": {
            "all": _frame_summary(lay),
            "by_kind": _breakdown(lay, "kind"),
            "by_interferer": _breakdown(lay, "interferer"),
            "by_phase": _breakdown(lay, "phase"),
            **{f"by_{c}": _breakdown(lay, c) for c in ("condition", "model") if c in lay},
        },
        "stage": {
            "all": ape_summary(stg["measured_ms"].to_numpy(), stg["predicted_ms"].to_numpy()),
            "by_n_stages": _breakdown(stg, "n_stages"),
            "by_interferer": _breakdown(stg, "interferer"),
            **({"by_model": _breakdown(stg, "model")} if "model" in stg else {}),
        },
    }


def _stage_ids(df: pd.DataFrame, n_stages: Sequence[int]) -> dict[int, np.ndarray]:
    """Per stage count, each row's stage in the balanced split of its run (counts no run can
    be split into are left out)."""
    ids = {s: assign_stages(df, n_stages=s) for s in n_stages}
    return {s: sid for s, sid in ids.items() if (sid >= 0).any()}


def score(df: pd.DataFrame, predicted_ms: np.ndarray, *, n_stages: Sequence[int] = (2, 4)) -> dict:
    """Layer and stage errors of given per-row predicted times (e.g. a shipped predictor on
    new data, no refit)."""
    df = df.reset_index(drop=True)
    pred = np.asarray(predicted_ms, dtype=np.float64)
    return _summarise(*_scored_frames(df, pred, _stage_ids(df, n_stages)))


def _scored_frames(
    df: pd.DataFrame,
    pred_ms: np.ndarray,
    stage_ids: Mapping[int, np.ndarray],
    log_sd: np.ndarray | None = None,
    **labels,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Layer and stage frames of per-row predicted times, every frame row labelled."""
    lay = _layer_frame(df, pred_ms, log_sd, **labels)
    parts = [
        stage_sums(df, stage=sid, predicted_ms=pred_ms).assign(n_stages=s)
        for s, sid in stage_ids.items()
    ]
    stg = pd.concat(parts, ignore_index=True) if parts else _empty_stages()
    return lay, stg.assign(**labels)


def evaluate_shipped(
    df: pd.DataFrame,
    predicted_ms: np.ndarray,
    *,
    schema: FeatureSchema,
    name: str,
    n_stages: Sequence[int] = (2, 4),
) -> Evaluation:
    """A saved predictor's times on profiles it was not fitted on, scored like ``evaluate``
    scores its held-out folds: as predicted (``name``), calibrated to the measured current
    stage (``<name>+measured``), beside ``stage-mean`` and ``none``, with the
    identical-layer floor. Nothing is fitted, so every interference condition is held out
    and the split is ``condition`` with one fold."""
    df = df.reset_index(drop=True)
    pred = np.asarray(predicted_ms, dtype=np.float64)
    stage_ids = _stage_ids(df, n_stages)
    label = {"split": "condition"}
    alone = df["time_alone_ms"].to_numpy(dtype=np.float64)
    frames = {
        name: _scored_frames(df, pred, stage_ids, **label, estimator=name),
        f"{name}+measured": tuple(
            f.assign(**label, estimator=f"{name}+measured")
            for f in _measured_frames(df, stage_ids, base_ms=pred)
        ),
        "stage-mean": tuple(
            f.assign(**label, estimator="stage-mean") for f in _measured_frames(df, stage_ids)
        ),
        "none": _scored_frames(df, alone, stage_ids, **label, estimator="none"),
    }
    layers = pd.concat([f[0] for f in frames.values()], ignore_index=True)
    stages = pd.concat([f[1] for f in frames.values()], ignore_index=True)
    data = data_summary(df, schema)
    summary = {
        "data": data,
        "splits": {
            "condition": {
                "n_folds": 1,
                "scheme": "shipped predictor, no refit",
                "held_out": [c for c in data["conditions"] if c != "none"],
            }
        },
        "n_stages": sorted(stage_ids),
        "estimators": {},
        "tuned": [],
        "calibrated": [f"{name}+measured"],
        "results": {"condition": {k: _summarise(lay, stg) for k, (lay, stg) in frames.items()}},
        "floor": _floor(df, layers),
    }
    return Evaluation(summary=summary, layers=layers, stages=stages)


def _empty_stages() -> pd.DataFrame:
    return pd.DataFrame({"interferer": [], "measured_ms": [], "predicted_ms": [], "n_stages": []})


def _measured_frames(
    df: pd.DataFrame,
    stage_ids: Mapping[int, np.ndarray],
    *,
    base_ms: np.ndarray | None = None,
    log_sd: np.ndarray | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Frames for a device that measures the stage it runs now, for every stage it might run.

    ``base_ms`` None: ``StageMean`` (alone times scaled by the measured stage slowdown).
    Otherwise a predictor's times, rescaled per run so its current stage matches the
    measurement. Scored only off the current stage.
    """
    est = StageMean()
    layer_parts, stage_parts = [], []
    alone = df["time_alone_ms"].to_numpy()
    for n_st, sid in stage_ids.items():
        for k in range(n_st):
            if base_ms is None:
                col = measured_stage_slowdown(df, stage=sid, current=k)
                Xk = pd.DataFrame({est.stage_column: col}, index=df.index)
                pred = est.fit(Xk).predict(Xk) * alone
            else:
                pred = base_ms * measured_stage_slowdown(
                    df, stage=sid, current=k, reference_ms=base_ms
                )
            other = (sid >= 0) & (sid != k)
            sd = None if log_sd is None else log_sd[other]
            layer_parts.append(
                _layer_frame(df[other], pred[other], sd, n_stages=n_st, current_stage=k)
            )
            st = stage_sums(df, stage=sid, predicted_ms=pred)
            st = st[st["stage"] != k].assign(n_stages=n_st, current_stage=k)
            stage_parts.append(st)
    if not layer_parts:
        return _layer_frame(df.iloc[:0], np.empty(0)), _empty_stages()
    return pd.concat(layer_parts, ignore_index=True), pd.concat(stage_parts, ignore_index=True)


def evaluate(
    df: pd.DataFrame,
    *,
    estimators: Mapping[str, BaseEstimator],
    splits: Sequence[str] = SPLITS,
    n_stages: Sequence[int] = (2, 4),
    n_folds: int = 0,
    tune: Sequence[str] = (),
    calibrate: Sequence[str] = (),
) -> Evaluation:
    """Score every estimator on every split that the data supports.

    ``estimators`` maps a display name to an estimator; ``StageMean`` instances are scored
    as described in the module docstring. ``tune`` lists the names whose hyper-parameters are
    chosen by nested grouped CV over ``TUNE_GRID``. ``calibrate`` lists learned estimators to
    score also as ``<name>+measured``: their out-of-fold times rescaled per run so that the
    stage the device runs now matches its measured time (``runtime.rescale_to_measured``),
    scored like ``StageMean`` off that stage.
    """
    df = df.reset_index(drop=True)
    X, schema = extract_features(df)
    y = df["slowdown"].to_numpy(dtype=np.float64)
    alone = df["time_alone_ms"].to_numpy(dtype=np.float64)
    stage_ids = _stage_ids(df, n_stages)

    layer_frames, stage_frames = [], []
    results: dict[str, dict] = {}
    split_info: dict[str, dict] = {}
    sm_frames = None
    for split in splits:
        folds = cv_folds(df, split=split, n_folds=n_folds)
        if folds is None:
            split_info[split] = {"skipped": "fewer than two groups in the data"}
            continue
        held = [sorted(map(str, pd.unique(_held_out(df, split)[test]))) for _, test in folds]
        split_info[split] = {
            "n_folds": len(folds),
            "scheme": "leave one out" if all(len(h) == 1 for h in held) else "group k-fold",
            "held_out": held,
            "test_sizes": [len(t) for _, t in folds],
        }
        results[split] = {}
        for name, est in estimators.items():
            if isinstance(est, StageMean):
                # Learns nothing, so its predictions are the same under every split.
                if sm_frames is None:
                    sm_frames = _measured_frames(df, stage_ids)
                lay, stg = (f.assign(split=split, estimator=name) for f in sm_frames)
            else:
                groups = _inner_groups(df, split) if name in tune else None
                oof, oof_sd = _fit_predict(est, X, y, folds, tune_groups=groups, df=df)
                oof = oof * alone
                sd_cal = None if oof_sd is None else oof_sd[0]
                sd_abs = None if oof_sd is None else oof_sd[1]
                lay, stg = _scored_frames(
                    df, oof, stage_ids, log_sd=sd_abs, split=split, estimator=name
                )
            layer_frames.append(lay)
            stage_frames.append(stg)
            results[split][name] = _summarise(lay, stg)
            if name in calibrate and not isinstance(est, StageMean):
                both = f"{name}+measured"
                cal = _measured_frames(
                    df, stage_ids, base_ms=lay["predicted_ms"].to_numpy(), log_sd=sd_cal
                )
                cal_lay, cal_stg = (f.assign(split=split, estimator=both) for f in cal)
                layer_frames.append(cal_lay)
                stage_frames.append(cal_stg)
                results[split][both] = _summarise(cal_lay, cal_stg)
    if not results:
        raise UserError(
            "no cross-validation split is possible: the profiles need at least two interference "
            "conditions or two models"
        )
    layers_all = pd.concat(layer_frames, ignore_index=True)
    summary = {
        "data": data_summary(df, schema),
        "splits": split_info,
        "n_stages": sorted(stage_ids),
        "estimators": {
            name: {"class": type(est).__name__, "params": _jsonable(est.get_params())}
            for name, est in estimators.items()
        },
        "tuned": list(tune),
        "calibrated": [f"{n}+measured" for n in calibrate if n in estimators],
        "results": results,
        "floor": _floor(df, layers_all),
    }
    return Evaluation(
        summary=summary, layers=layers_all, stages=pd.concat(stage_frames, ignore_index=True)
    )


def _floor(df: pd.DataFrame, layers: pd.DataFrame) -> dict:
    """The identical-layer floor (``floor.sibling_floor``) and every estimator's error on the
    same rows, per split: what of its error measurement noise alone explains."""
    floor = sibling_floor(df)
    if floor.empty:
        return {"rows": 0}
    keys = [*run_keys(df), "layer_index", "phase"]
    on = floor[keys].drop_duplicates()
    lay = layers[layers["interferer"] != "none"].dropna(subset=["predicted_ms"])
    same = lay.merge(on, on=keys, how="inner")
    return {
        "rows": len(floor),
        "sibling": ape_summary(floor["measured_ms"].to_numpy(), floor["predicted_ms"].to_numpy()),
        "by_model": _breakdown(floor, "model"),
        "by_kind": _breakdown(floor, "kind"),
        "estimators": {
            str(split): {
                str(name): {
                    "all": ape_summary(g["measured_ms"].to_numpy(), g["predicted_ms"].to_numpy()),
                    "by_model": _breakdown(g, "model"),
                }
                for name, g in part.groupby("estimator", sort=False)
            }
            for split, part in same.groupby("split", sort=False)
        },
    }


def _jsonable(params: dict) -> dict:
    out = {}
    for k, v in params.items():
        if isinstance(v, (str, int, float, bool)) or v is None:
            out[k] = v
        elif isinstance(v, Mapping):
            out[k] = {str(a): b for a, b in v.items()}
        else:
            out[k] = repr(v)
    return out
