"""Run-time API: per-layer times on every device from its current telemetry.

The controller calls ``predict_layer_times`` every few steps with one telemetry window per
device; it gets, for every device, the forward and backward time of *every* layer, including
layers that device does not hold now. One batched predict call covers all devices and layers;
the static half of the feature matrix is computed once by ``prepare_layers`` and reused.

    prepared = prepare_layers(predictor, model, batch_size=8)   # schema 3: the model itself
    fwd, bwd = predict_layer_times(
        predictor, layers=prepared, alone_fwd_ms=a_f, alone_bwd_ms=a_b, telemetry=windows
    )  # fwd[d, i]: predicted forward time of layer i on device d

``predict_layer_distribution`` returns the same times with their spread (``LayerTimes``): the
standard deviation of each prediction's error in ``log(time)``, learned on architectures the
predictor was not fitted on, from which ``LayerTimes.variance_ms2`` gives the model-error
variance of each layer time and ``LayerTimes.interval`` a calibrated central interval.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dynpipe.errors import UserError
from dynpipe.predictor.features import ALONE_DEPENDENT, alone_dependent, static_block, work_block
from dynpipe.predictor.io import Predictor
from dynpipe.profiler.work import WORK_COLUMNS

__all__ = [
    "LayerTimes",
    "PreparedLayers",
    "predict_layer_distribution",
    "predict_layer_times",
    "prepare_layers",
    "rescale_to_measured",
]

_LAYER_COLUMNS = ("kind", "param_bytes", "in_bytes", "out_bytes", "fwd_flops", "bwd_flops")


@dataclass(frozen=True)
class PreparedLayers:
    """Static features of a model's layers for one predictor: rows ``0..L-1`` are the
    forward of each layer, rows ``L..2L-1`` its backward. ``flops`` and ``nbytes`` (per row)
    are what the features that depend on the alone time are recomputed from on every call."""

    n_layers: int
    static: np.ndarray
    feature_names: tuple[str, ...]
    flops: np.ndarray
    nbytes: np.ndarray
    launches: np.ndarray | None = None  # schema 3: kernels per row

    def __repr__(self) -> str:
        return f"PreparedLayers({self.n_layers} layers, {len(self.feature_names)} features)"


def _model_frame(model: object, *, batch_size: int, dtype: object) -> pd.DataFrame:
    """Profile-like rows (one per layer and phase) of a ``LayeredModel``, with its work
    counts: what a schema-3 predictor needs, counted on the ``meta`` device."""
    import torch

    from dynpipe.models.stats import layer_stats
    from dynpipe.profiler.work import layer_work

    dt = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))
    stats = {s.index: s for s in layer_stats(model, batch_size=batch_size, dtype=dt)}
    rows = []
    for w in layer_work(model, batch_size=batch_size, dtype=dt):
        st = stats[w["layer_index"]]
        rows.append(
            {
                **w,
                "kind": st.kind,
                "flops": float(st.fwd_flops if w["phase"] == "fwd" else st.bwd_flops),
                "param_bytes": st.param_bytes,
                "in_bytes": st.in_bytes,
                "out_bytes": st.out_bytes,
                "batch_size": batch_size,
            }
        )
    return pd.DataFrame(rows)


def _layer_frame(layers: object) -> pd.DataFrame:
    """One row per layer with ``_LAYER_COLUMNS`` (and ``batch_size`` if known); for profile
    rows also ``fwd_<work>`` / ``bwd_<work>`` where they carry work counts."""
    if isinstance(layers, pd.DataFrame):
        df = layers
    else:
        rows = []
        for item in layers:  # LayerStats, other dataclasses, or dicts
            if dataclasses.is_dataclass(item):
                rows.append({f.name: getattr(item, f.name) for f in dataclasses.fields(item)})
            elif isinstance(item, Mapping):
                rows.append(dict(item))
            else:
                raise UserError(
                    f"layers must be a DataFrame, or LayerStats / dicts, got {type(item).__name__}"
                )
        df = pd.DataFrame(rows)
    if "phase" in df.columns:
        # Profile rows: one per (layer, phase, condition); static columns repeat per condition.
        one = df.drop_duplicates(["layer_index", "phase"]).set_index(["layer_index", "phase"])
        fwd = one.xs("fwd", level="phase").sort_index()
        bwd = one.xs("bwd", level="phase").reindex(fwd.index)
        if bwd["flops"].isna().any() or len(bwd) != len(one) - len(fwd):
            raise UserError(
                "profile rows for prepare_layers need both fwd and bwd rows of every layer"
            )
        df = fwd.reset_index().assign(
            fwd_flops=fwd["flops"].to_numpy(), bwd_flops=bwd["flops"].to_numpy()
        )
        if all(c in one.columns for c in WORK_COLUMNS):
            df = df.assign(
                **{f"fwd_{c}": fwd[c].to_numpy() for c in WORK_COLUMNS},
                **{f"bwd_{c}": bwd[c].to_numpy() for c in WORK_COLUMNS},
            )
    missing = [c for c in _LAYER_COLUMNS if c not in df.columns]
    if missing:
        raise UserError(
            f"layers lack {', '.join(missing)}; pass dynpipe.models.stats.layer_stats(...) or a "
            "profile's rows"
        )
    return df


def prepare_layers(
    predictor: Predictor,
    layers: object,
    *,
    batch_size: int | None = None,
    dtype: object = "float32",
) -> PreparedLayers:
    """Static features of ``layers``: a ``LayeredModel`` (any predictor), a profile's rows of
    one model, or ``layer_stats`` output (predictors of feature schema 1 and 2 only: schema 3
    describes a layer by the work its operators do, which is counted from the model).

    ``batch_size`` is the microbatch size the times are for; required unless the layers carry
    a ``batch_size`` column (profile rows do). ``dtype``: the parameters' dtype, for a model.
    """
    from dynpipe.models.base import LayeredModel

    if isinstance(layers, LayeredModel):
        if batch_size is None:
            raise UserError("prepare_layers(model) needs batch_size= (the microbatch size)")
        layers = _model_frame(layers, batch_size=int(batch_size), dtype=dtype)
    if predictor.schema.uses_work:
        return _prepare_work(predictor, layers, batch_size=batch_size)
    df = _layer_frame(layers)
    if batch_size is None:
        if "batch_size" not in df.columns:
            raise UserError("layers carry no batch_size; pass batch_size= (the microbatch size)")
        batch = df["batch_size"].to_numpy()
    else:
        batch = np.full(len(df), int(batch_size))
    n = len(df)
    kinds = df["kind"].astype(str).to_numpy()
    unknown = sorted(set(kinds) - set(predictor.schema.kinds))
    if unknown:
        import warnings

        warnings.warn(
            f"layer kind(s) {', '.join(unknown)} were not in the predictor's training data "
            f"(it knows {', '.join(predictor.schema.kinds)}); predicting them from size and intensity",
            stacklevel=2,
        )

    def both(col: str) -> np.ndarray:
        return np.concatenate([df[col].to_numpy(), df[col].to_numpy()]).astype(np.float64)

    flops = np.concatenate([df["fwd_flops"].to_numpy(), df["bwd_flops"].to_numpy()])
    flops = flops.astype(np.float64)
    static = static_block(
        kind=np.concatenate([kinds, kinds]),
        phase=np.array(["fwd"] * n + ["bwd"] * n, dtype=object),
        batch_size=np.concatenate([batch, batch]),
        flops=flops,
        param_bytes=both("param_bytes"),
        in_bytes=both("in_bytes"),
        out_bytes=both("out_bytes"),
        time_alone_ms=np.ones(2 * n),  # refilled per call from the alone times given then
        kinds=predictor.schema.kinds,
        numeric=predictor.schema.numeric,
    )
    return PreparedLayers(
        n_layers=n,
        static=np.ascontiguousarray(static),
        feature_names=tuple(predictor.schema.names),
        flops=flops,
        nbytes=both("param_bytes") + both("in_bytes") + both("out_bytes"),
    )


def _prepare_work(
    predictor: Predictor, layers: object, *, batch_size: int | None
) -> PreparedLayers:
    """``prepare_layers`` for a schema-3 predictor (work counts, no layer-kind label)."""
    if (
        isinstance(layers, pd.DataFrame)
        and "phase" in layers.columns
        and not all(c in layers.columns for c in WORK_COLUMNS)
    ):
        from dynpipe.profiler.work import add_work

        layers = add_work(layers)
    df = _layer_frame(layers)
    if not all(f"fwd_{c}" in df.columns for c in WORK_COLUMNS):
        raise UserError(
            "this predictor (feature schema 3) describes layers by the work their operators "
            "do: pass the model itself, prepare_layers(predictor, model, batch_size=...), or "
            "profile rows that carry work counts, not layer_stats output"
        )
    if batch_size is None:
        if "batch_size" not in df.columns:
            raise UserError("layers carry no batch_size; pass batch_size= (the microbatch size)")
        batch = df["batch_size"].to_numpy()
    else:
        batch = np.full(len(df), int(batch_size))
    n = len(df)

    def both(col: str) -> np.ndarray:
        return np.concatenate([df[col].to_numpy(), df[col].to_numpy()]).astype(np.float64)

    work = {
        c: np.concatenate([df[f"fwd_{c}"].to_numpy(), df[f"bwd_{c}"].to_numpy()]).astype(np.float64)
        for c in WORK_COLUMNS
    }
    static = work_block(
        work,
        phase=np.array(["fwd"] * n + ["bwd"] * n, dtype=object),
        batch_size=np.concatenate([batch, batch]),
        param_bytes=both("param_bytes"),
        in_bytes=both("in_bytes"),
        out_bytes=both("out_bytes"),
        time_alone_ms=np.ones(2 * n),  # refilled per call from the alone times given then
    )
    return PreparedLayers(
        n_layers=n,
        static=np.ascontiguousarray(static),
        feature_names=tuple(predictor.schema.names),
        flops=work["work_flops"],
        nbytes=work["work_bytes"],
        launches=work["work_launches"],
    )


def _alone(fwd: object, bwd: object, n_layers: int) -> np.ndarray:
    out = []
    for name, arr in (("alone_fwd_ms", fwd), ("alone_bwd_ms", bwd)):
        a = np.asarray(arr, dtype=np.float64)
        if a.shape[-1:] != (n_layers,) or a.ndim > 2:
            raise UserError(
                f"{name} has shape {a.shape}; want [{n_layers}] or [devices, {n_layers}]"
            )
        if not np.isfinite(a).all() or (a < 0).any():
            raise UserError(
                f"{name} has negative or non-finite entries; give measured alone times in ms"
            )
        out.append(np.atleast_2d(a))
    return np.concatenate(np.broadcast_arrays(*out), axis=1)  # [1 or D, 2L]


def _telemetry(predictor: Predictor, telemetry: Sequence[Mapping[str, object]]) -> np.ndarray:
    names = predictor.schema.telemetry
    out = np.empty((len(telemetry), len(names)))
    for d, window in enumerate(telemetry):
        predictor.schema.check_telemetry(window.keys(), what=f"telemetry of device {d}")
        for j, name in enumerate(names):
            v = window[name]
            out[d, j] = np.nan if v is None else float(v)
    return out


def predict_layer_times(
    predictor: Predictor,
    *,
    layers: PreparedLayers | object,
    alone_fwd_ms: Sequence[float] | np.ndarray,
    alone_bwd_ms: Sequence[float] | np.ndarray,
    telemetry: Sequence[Mapping[str, object]],
    batch_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Predicted forward and backward time of every layer on every device, ``[D, L]`` each.

    ``layers``: a ``PreparedLayers`` (fast; from ``prepare_layers``) or anything
    ``prepare_layers`` accepts (prepared on every call). ``alone_*_ms``: each layer's time
    without interference, ``[L]`` (same devices) or ``[D, L]``. ``telemetry``: one window of
    ``tel_*`` readings per device, exactly the predictor's telemetry features (``None``/NaN
    where the platform lacks a reading); other ``tel_*`` keys are refused by name.
    """
    flat, alone, n_dev, prep = _design(
        predictor, layers, alone_fwd_ms, alone_bwd_ms, telemetry, batch_size
    )
    est = predictor.estimator
    if hasattr(est, "predict_array"):
        slow = est.predict_array(flat)
    else:
        slow = est.predict(pd.DataFrame(flat, columns=list(prep.feature_names)))
    n = prep.n_layers
    times = alone * np.asarray(slow).reshape(n_dev, 2 * n)
    return times[:, :n], times[:, n:]


def _design(
    predictor: Predictor,
    layers: object,
    alone_fwd_ms: object,
    alone_bwd_ms: object,
    telemetry: Sequence[Mapping[str, object]],
    batch_size: int | None,
) -> tuple[np.ndarray, np.ndarray, int, PreparedLayers]:
    """The flat ``[D * 2L, features]`` matrix of one call, the ``[1 or D, 2L]`` alone times,
    the device count and the prepared layers."""
    prep = (
        layers
        if isinstance(layers, PreparedLayers)
        else prepare_layers(predictor, layers, batch_size=batch_size)
    )
    if prep.feature_names != tuple(predictor.schema.names):
        raise UserError(
            "layers were prepared for another predictor's features; call prepare_layers "
            "again with this predictor"
        )
    if not len(telemetry):
        raise UserError("telemetry is empty; pass one tel_* window per device")
    n, n_dev = prep.n_layers, len(telemetry)
    alone = _alone(alone_fwd_ms, alone_bwd_ms, n)
    if alone.shape[0] not in (1, n_dev):
        raise UserError(
            f"alone times are given for {alone.shape[0]} devices but telemetry for {n_dev}"
        )
    tel = _telemetry(predictor, telemetry)
    n_static = prep.static.shape[1]
    X = np.empty((n_dev, 2 * n, n_static + tel.shape[1]))
    X[:, :, :n_static] = prep.static
    refill = alone_dependent(
        flops=prep.flops, nbytes=prep.nbytes, time_alone_ms=alone, launches=prep.launches
    )
    numeric = predictor.schema.numeric
    for name in ALONE_DEPENDENT:
        if name in numeric:
            X[:, :, numeric.index(name)] = refill[name]
    X[:, :, n_static:] = tel[:, None, :]
    return X.reshape(n_dev * 2 * n, -1), alone, n_dev, prep


@dataclass(frozen=True)
class LayerTimes:
    """Predicted per-layer times ``[D, L]`` with the spread of their error.

    ``fwd_log_sd`` / ``bwd_log_sd``: standard deviation of the error of ``log(time)``,
    learned on held-out architectures; for a calibrated prediction (``rescale_to_measured``
    applied, as the runtime does) unless ``calibrated`` is False. A rescale multiplies a
    device's times by one factor, which leaves these unchanged.
    """

    fwd_ms: np.ndarray
    bwd_ms: np.ndarray
    fwd_log_sd: np.ndarray
    bwd_log_sd: np.ndarray
    calibrated: bool = True

    def variance_ms2(self) -> tuple[np.ndarray, np.ndarray]:
        """Model-error variance of each time in ms^2, ``[D, L]`` each (the time as the median
        of a log-normal with the predicted spread: ``t^2 exp(sd^2) (exp(sd^2) - 1)``)."""
        out = []
        for t, sd in ((self.fwd_ms, self.fwd_log_sd), (self.bwd_ms, self.bwd_log_sd)):
            v = np.exp(sd**2)
            out.append(t**2 * v * (v - 1.0))
        return out[0], out[1]

    def interval(self, coverage: float = 0.8) -> tuple[np.ndarray, ...]:
        """Central interval holding ``coverage`` of the times: ``(fwd_lo, fwd_hi, bwd_lo,
        bwd_hi)``, each ``[D, L]`` (calibrated at the predictor's coverage, 0.8 by default)."""
        from dynpipe.predictor.spread import z_of

        z = z_of(coverage)
        return (
            self.fwd_ms * np.exp(-z * self.fwd_log_sd),
            self.fwd_ms * np.exp(z * self.fwd_log_sd),
            self.bwd_ms * np.exp(-z * self.bwd_log_sd),
            self.bwd_ms * np.exp(z * self.bwd_log_sd),
        )

    def rescaled(self, fwd_ms: np.ndarray, bwd_ms: np.ndarray) -> LayerTimes:
        """The same spread around new times (e.g. after ``rescale_to_measured``)."""
        return dataclasses.replace(self, fwd_ms=np.asarray(fwd_ms), bwd_ms=np.asarray(bwd_ms))


def predict_layer_distribution(
    predictor: Predictor,
    *,
    layers: PreparedLayers | object,
    alone_fwd_ms: Sequence[float] | np.ndarray,
    alone_bwd_ms: Sequence[float] | np.ndarray,
    telemetry: Sequence[Mapping[str, object]],
    batch_size: int | None = None,
    calibrated: bool = True,
) -> LayerTimes:
    """``predict_layer_times`` with the spread of each prediction (``LayerTimes``), in one
    batched call. ``calibrated``: the spread of predictions the caller rescales to each
    device's measured layers (the runtime's use); False: of the absolute predictions.
    Predictors fitted without a spread (feature schema 1 and 2 files) are refused in one
    line."""
    est = predictor.estimator
    if getattr(est, "spread_booster_", None) is None:
        raise UserError(
            f"predictor {predictor!r} has no spread (fitted before predictors learned one, or "
            "with coverage=None); refit it with `dynpipe predictor fit` on profiles of two or "
            "more architectures"
        )
    flat, alone, n_dev, prep = _design(
        predictor, layers, alone_fwd_ms, alone_bwd_ms, telemetry, batch_size
    )
    n = prep.n_layers
    times = alone * np.asarray(est.predict_array(flat)).reshape(n_dev, 2 * n)
    from dynpipe.predictor.spread import log_sd

    sd = np.asarray(log_sd(est, arr=flat, calibrated=calibrated)).reshape(n_dev, 2 * n)
    return LayerTimes(
        fwd_ms=times[:, :n],
        bwd_ms=times[:, n:],
        fwd_log_sd=sd[:, :n],
        bwd_log_sd=sd[:, n:],
        calibrated=calibrated,
    )


def rescale_to_measured(
    fwd_ms: np.ndarray,
    bwd_ms: np.ndarray,
    *,
    ranges: Sequence[tuple[int, int] | None],
    measured_ms: Sequence[float | None],
) -> tuple[np.ndarray, np.ndarray]:
    """Per device, scale predicted times so the stage it runs now matches its measurement.

    ``ranges[d]`` is the ``[start, stop)`` layer range device ``d`` runs now and
    ``measured_ms[d]`` its measured compute time for one microbatch (forward + backward).
    Each device's row is multiplied by measured / predicted time of that range: the learned
    model supplies how layers differ from each other, the measurement how slow the device is
    right now. Devices with no range or no measurement (``None``/NaN) are left as predicted.
    """
    fwd = np.array(fwd_ms, dtype=np.float64)
    bwd = np.array(bwd_ms, dtype=np.float64)
    if fwd.shape != bwd.shape or fwd.ndim != 2:
        raise UserError(f"fwd_ms {fwd.shape} and bwd_ms {bwd.shape} must both be [devices, layers]")
    n_dev, n_layers = fwd.shape
    if len(ranges) != n_dev or len(measured_ms) != n_dev:
        raise UserError(
            f"ranges ({len(ranges)}) and measured_ms ({len(measured_ms)}) need one entry per "
            f"device ({n_dev})"
        )
    for d, (rng, meas) in enumerate(zip(ranges, measured_ms, strict=True)):
        if rng is None or meas is None or not np.isfinite(meas):
            continue
        a, b = rng
        if not 0 <= a < b <= n_layers:
            raise UserError(f"device {d} range [{a}, {b}) is not inside the {n_layers} layers")
        predicted = fwd[d, a:b].sum() + bwd[d, a:b].sum()
        if predicted > 0 and meas > 0:
            fwd[d] *= meas / predicted
            bwd[d] *= meas / predicted
    return fwd, bwd
