"""Feature extraction: profile rows -> the predictor's input matrix.

Two groups of features, and nothing else:

- static, per (layer, phase): log FLOPs, log parameter / input / output bytes, log arithmetic
  intensity, log batch size, log alone time, the rates the layer achieves alone (FLOPs and
  bytes per ms of its alone time), one-hot layer kind and phase;
- telemetry of the device, ``tel_*`` columns as the profiler records them (NaN where the
  platform has no such reading).

The interference labels (``interferer``, ``intensity``, ``n_jobs``, ``condition``) are never
features: at run time only telemetry is observable.

``extract_features`` is pure: the same rows and schema give the same matrix. Fitting derives a
``FeatureSchema`` from the training rows; prediction passes that schema back so the columns come
out in the trained order, and input that does not match it is refused with the names that differ.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dynpipe.devices.columns import TELEMETRY_COLUMNS
from dynpipe.errors import UserError
from dynpipe.profiler.schema import EXTRA_COLUMNS

__all__ = [
    "ALONE_DEPENDENT",
    "NUMERIC_STATIC",
    "NUMERIC_STATIC_V1",
    "PHASES",
    "STATIC_INPUTS",
    "FeatureSchema",
    "alone_dependent",
    "check_same_names",
    "extract_features",
    "log_alone",
    "static_block",
    "telemetry_columns",
]

# Columns of a profile row that static features are computed from.
STATIC_INPUTS: tuple[str, ...] = (
    "kind",
    "phase",
    "batch_size",
    "flops",
    "param_bytes",
    "in_bytes",
    "out_bytes",
    "time_alone_ms",
)
# Schema version 1 (predictors fitted before the achieved rates were features).
NUMERIC_STATIC_V1: tuple[str, ...] = (
    "log_flops",
    "log_param_bytes",
    "log_in_bytes",
    "log_out_bytes",
    "log_arith_intensity",
    "log_batch_size",
    "log_time_alone_ms",
)
# The rates a layer achieves alone tell a launch- or latency-bound layer (far below the
# device's peak FLOP rate and bandwidth: a co-located job slows it little, or not at all)
# from a compute- or bandwidth-bound one of the same size.
NUMERIC_STATIC: tuple[str, ...] = (*NUMERIC_STATIC_V1, "log_flops_per_ms", "log_bytes_per_ms")
# Features computed from the alone time: the run-time path refills them per device.
ALONE_DEPENDENT: tuple[str, ...] = ("log_time_alone_ms", "log_flops_per_ms", "log_bytes_per_ms")
PHASES: tuple[str, ...] = ("fwd", "bwd")
SCHEMA_VERSION = 2


@dataclass(frozen=True)
class FeatureSchema:
    """The exact feature columns a predictor was trained on, in order.

    ``kinds`` is the one-hot vocabulary of layer kinds seen in training; ``telemetry`` the
    ``tel_*`` columns. A layer kind outside the vocabulary gets an all-zero one-hot (the
    model then predicts from its size and intensity alone) and a warning. ``version`` fixes
    the numeric static features: 1 for predictors saved before the achieved rates were added
    (``NUMERIC_STATIC_V1``), 2 for ``NUMERIC_STATIC``.
    """

    kinds: tuple[str, ...]
    telemetry: tuple[str, ...]
    version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.version not in (1, SCHEMA_VERSION):
            raise UserError(
                f"feature schema version {self.version} is not one this dynpipe reads (1 or "
                f"{SCHEMA_VERSION}); refit the predictor with `dynpipe predictor fit`"
            )

    @property
    def numeric(self) -> tuple[str, ...]:
        return NUMERIC_STATIC_V1 if self.version == 1 else NUMERIC_STATIC

    @property
    def names(self) -> list[str]:
        return [
            *self.numeric,
            *(f"kind_{k}" for k in self.kinds),
            *(f"phase_{p}" for p in PHASES),
            *self.telemetry,
        ]

    @property
    def n_static(self) -> int:
        return len(self.numeric) + len(self.kinds) + len(PHASES)

    def to_dict(self) -> dict:
        return {
            "kinds": list(self.kinds),
            "telemetry": list(self.telemetry),
            "version": self.version,
        }

    @classmethod
    def from_dict(cls, d: dict) -> FeatureSchema:
        return cls(
            kinds=tuple(d["kinds"]), telemetry=tuple(d["telemetry"]), version=int(d["version"])
        )

    def check_names(self, names: Iterable[str], *, what: str = "input") -> None:
        """Refuse feature columns that differ from the trained ones, naming the differences."""
        check_same_names(self.names, list(names), what=what)

    def check_telemetry(self, keys: Iterable[str], *, what: str = "telemetry") -> None:
        check_same_names(list(self.telemetry), telemetry_columns(keys), what=what)


def telemetry_columns(names: Iterable[str]) -> list[str]:
    """The telemetry readings among ``names``: ``tel_*`` less bookkeeping such as
    ``tel_samples``, in the telemetry columns' order (unknown readings after, by name)."""
    order = {c: i for i, c in enumerate(TELEMETRY_COLUMNS)}
    found = [n for n in names if n.startswith("tel_") and n not in EXTRA_COLUMNS]
    return sorted(found, key=lambda c: (order.get(c, len(order)), c))


def check_same_names(expected: Sequence[str], got: Sequence[str], *, what: str) -> None:
    """One-line ``UserError`` naming missing and extra features (order is not checked here)."""
    missing = [n for n in expected if n not in set(got)]
    extra = [n for n in got if n not in set(expected)]
    if not missing and not extra:
        return
    parts = []
    if missing:
        parts.append(f"missing {', '.join(missing)}")
    if extra:
        parts.append(f"extra {', '.join(extra)}")
    raise UserError(
        f"{what} does not match the predictor's feature schema: {'; '.join(parts)}; "
        "refit the predictor on profiles with these columns (`dynpipe predictor fit`) "
        "or give the features it was trained on"
    )


def _log10(values: np.ndarray) -> np.ndarray:
    # log10(1 + x): defined at 0 (pooling layers have no parameters) and ~log10(x) when large.
    return np.log10(1.0 + np.maximum(values, 0.0))


def log_alone(time_alone_ms: np.ndarray) -> np.ndarray:
    """The alone-time feature (a zero time, e.g. no backward, maps to the floor 1 ns)."""
    return np.log10(np.maximum(time_alone_ms, 1e-6))


def alone_dependent(
    *, flops: np.ndarray, nbytes: np.ndarray, time_alone_ms: np.ndarray
) -> dict[str, np.ndarray]:
    """The ``ALONE_DEPENDENT`` features (arrays broadcast: ``[n]`` layers against ``[d, n]``
    alone times gives ``[d, n]``). A layer without FLOPs (an embedding lookup) has rate 0."""
    alone = np.maximum(np.asarray(time_alone_ms, dtype=np.float64), 1e-6)
    flops = np.asarray(flops, dtype=np.float64)
    nbytes = np.asarray(nbytes, dtype=np.float64)
    return {
        "log_time_alone_ms": log_alone(alone),
        "log_flops_per_ms": _log10(flops / alone),
        "log_bytes_per_ms": _log10(nbytes / alone),
    }


def static_block(
    *,
    kind: Sequence[str] | np.ndarray,
    phase: Sequence[str] | np.ndarray,
    batch_size: np.ndarray,
    flops: np.ndarray,
    param_bytes: np.ndarray,
    in_bytes: np.ndarray,
    out_bytes: np.ndarray,
    time_alone_ms: np.ndarray,
    kinds: Sequence[str],
    numeric: Sequence[str] = NUMERIC_STATIC,
) -> np.ndarray:
    """Static feature matrix ``[n, n_static]`` in schema order (``numeric`` features, kind
    one-hot, phase)."""
    flops = np.asarray(flops, dtype=np.float64)
    nbytes = (
        np.asarray(param_bytes, dtype=np.float64)
        + np.asarray(in_bytes, dtype=np.float64)
        + np.asarray(out_bytes, dtype=np.float64)
    )
    columns = {
        "log_flops": _log10(flops),
        "log_param_bytes": _log10(np.asarray(param_bytes, dtype=np.float64)),
        "log_in_bytes": _log10(np.asarray(in_bytes, dtype=np.float64)),
        "log_out_bytes": _log10(np.asarray(out_bytes, dtype=np.float64)),
        "log_arith_intensity": np.log10(np.maximum(flops, 1.0) / np.maximum(nbytes, 1.0)),
        "log_batch_size": np.log2(np.maximum(np.asarray(batch_size, dtype=np.float64), 1.0)),
        **alone_dependent(flops=flops, nbytes=nbytes, time_alone_ms=time_alone_ms),
    }
    numeric = np.column_stack([columns[name] for name in numeric])
    kind_arr = np.asarray(kind, dtype=object)
    phase_arr = np.asarray(phase, dtype=object)
    one_hot_kind = (
        np.column_stack([kind_arr == k for k in kinds]) if kinds else np.empty((len(kind_arr), 0))
    )
    one_hot_phase = np.column_stack([phase_arr == p for p in PHASES])
    return np.hstack([numeric, one_hot_kind.astype(np.float64), one_hot_phase.astype(np.float64)])


def extract_features(
    df: pd.DataFrame, *, schema: FeatureSchema | None = None
) -> tuple[pd.DataFrame, FeatureSchema]:
    """Feature matrix for profile rows, and the schema it follows.

    Without ``schema`` (fitting) the schema is derived from ``df``: its layer kinds and its
    ``tel_*`` columns. With ``schema`` (prediction) the output has exactly the schema's
    columns in its order; ``tel_*`` columns that differ are refused with their names.
    The result keeps ``df``'s index.
    """
    missing = [c for c in STATIC_INPUTS if c not in df.columns]
    if missing:
        raise UserError(
            f"profile rows lack static column(s) {', '.join(missing)}; the predictor needs "
            f"{', '.join(STATIC_INPUTS)} (see profiles/README.md for the schema)"
        )
    bad_phase = sorted(set(df["phase"].unique()) - set(PHASES))
    if bad_phase:
        raise UserError(
            f"phase must be one of {', '.join(PHASES)}, got {', '.join(map(str, bad_phase))}"
        )
    alone = df["time_alone_ms"].to_numpy(dtype=np.float64)
    n_bad = int((~np.isfinite(alone) | (alone <= 0)).sum())
    if n_bad:
        raise UserError(
            f"{n_bad} of {len(df)} rows have time_alone_ms <= 0 or NaN; every (layer, phase) "
            "needs its alone time measured under condition 'none' (re-run the profile sweep)"
        )
    tel_cols = telemetry_columns(map(str, df.columns))
    if schema is None:
        if not tel_cols:
            raise UserError("profile rows have no tel_* columns; the predictor needs telemetry")
        schema = FeatureSchema(
            kinds=tuple(sorted(map(str, df["kind"].unique()))), telemetry=tuple(tel_cols)
        )
    else:
        schema.check_telemetry(tel_cols, what="profile telemetry columns")
        unknown = sorted(set(map(str, df["kind"].unique())) - set(schema.kinds))
        if unknown:
            warnings.warn(
                f"layer kind(s) {', '.join(unknown)} were not in the predictor's training data "
                f"(it knows {', '.join(schema.kinds)}); predicting them from size and intensity",
                stacklevel=2,
            )
    static = static_block(
        kind=df["kind"].astype(str).to_numpy(),
        phase=df["phase"].to_numpy(),
        batch_size=df["batch_size"].to_numpy(),
        flops=df["flops"].to_numpy(),
        param_bytes=df["param_bytes"].to_numpy(),
        in_bytes=df["in_bytes"].to_numpy(),
        out_bytes=df["out_bytes"].to_numpy(),
        time_alone_ms=alone,
        kinds=schema.kinds,
        numeric=schema.numeric,
    )
    tel = df[list(schema.telemetry)].to_numpy(dtype=np.float64)
    X = pd.DataFrame(np.hstack([static, tel]), columns=schema.names, index=df.index)
    return X, schema
