"""Feature extraction: profile rows -> the predictor's input matrix.

Two groups of features, and nothing else:

- static, per (layer, phase). Schema 3 (``NUMERIC_WORK``): what the layer's operators do,
  counted by ``dynpipe.profiler.work`` — FLOPs, bytes moved, arithmetic intensity, kernel
  launches, bytes per launch, the largest operator, the kernel mix (share of bytes moved by
  matmul / convolution / grouped convolution / attention / normalisation / elementwise /
  other operators, share of FLOPs by the compute kinds), parameter and activation bytes, the
  batch size, and the layer's alone time with the rates it achieves alone (FLOPs, bytes and
  launches per ms). Nothing names a model or a layer: the layer-kind label is not a feature.
  Schemas 1 and 2 (``NUMERIC_STATIC_V1``, ``NUMERIC_STATIC``; predictors fitted before the
  work counts) add a one-hot of the layer-kind label;
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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dynpipe.devices.columns import TELEMETRY_COLUMNS
from dynpipe.errors import UserError
from dynpipe.profiler.schema import EXTRA_COLUMNS
from dynpipe.profiler.work import FLOP_KINDS, OP_KINDS, WORK_COLUMNS

__all__ = [
    "ALONE_DEPENDENT",
    "NUMERIC_STATIC",
    "NUMERIC_STATIC_V1",
    "NUMERIC_WORK",
    "PHASES",
    "STATIC_INPUTS",
    "FeatureSchema",
    "alone_dependent",
    "check_same_names",
    "extract_features",
    "log_alone",
    "static_block",
    "telemetry_columns",
    "work_block",
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
# Schema 3: the work a layer's operators do (``dynpipe.profiler.work``), no kind label.
NUMERIC_WORK: tuple[str, ...] = (
    "log_flops",
    "log_bytes",
    "log_arith_intensity",
    "log_launches",
    "log_bytes_per_launch",
    "log_max_op_bytes",
    "log_param_bytes",
    "log_in_bytes",
    "log_out_bytes",
    "log_batch_size",
    *(f"bytes_share_{k}" for k in OP_KINDS),
    *(f"flops_share_{k}" for k in FLOP_KINDS),
    "log_time_alone_ms",
    "log_flops_per_ms",
    "log_bytes_per_ms",
    # Milliseconds per kernel alone: a layer whose kernels are short is bound by launches
    # and host overhead, which a co-located job on the device hardly touches.
    "log_ms_per_launch",
)
# Features computed from the alone time: the run-time path refills them per device.
ALONE_DEPENDENT: tuple[str, ...] = (
    "log_time_alone_ms",
    "log_flops_per_ms",
    "log_bytes_per_ms",
    "log_ms_per_launch",
)
PHASES: tuple[str, ...] = ("fwd", "bwd")
SCHEMA_VERSION = 3


@dataclass(frozen=True)
class FeatureSchema:
    """The exact feature columns a predictor was trained on, in order.

    ``telemetry`` holds the ``tel_*`` columns. ``version`` fixes the static features: 3
    (``NUMERIC_WORK``, what the layer's operators do; ``kinds`` is empty) for predictors
    fitted now; 1 (``NUMERIC_STATIC_V1``) and 2 (``NUMERIC_STATIC``) for older files, whose
    ``kinds`` is a one-hot vocabulary of layer-kind labels (a label outside it gets an
    all-zero one-hot and a warning).
    """

    kinds: tuple[str, ...]
    telemetry: tuple[str, ...]
    version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.version not in (1, 2, SCHEMA_VERSION):
            raise UserError(
                f"feature schema version {self.version} is not one this dynpipe reads (1 to "
                f"{SCHEMA_VERSION}); refit the predictor with `dynpipe predictor fit`"
            )

    @property
    def numeric(self) -> tuple[str, ...]:
        return {1: NUMERIC_STATIC_V1, 2: NUMERIC_STATIC}.get(self.version, NUMERIC_WORK)

    @property
    def uses_work(self) -> bool:
        """Whether the static features are the work counts (schema 3) rather than sizes and
        a layer-kind label."""
        return self.version >= 3

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
    *,
    flops: np.ndarray,
    nbytes: np.ndarray,
    time_alone_ms: np.ndarray,
    launches: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The ``ALONE_DEPENDENT`` features (arrays broadcast: ``[n]`` layers against ``[d, n]``
    alone times gives ``[d, n]``). A layer without FLOPs (an embedding lookup) has rate 0."""
    alone = np.maximum(np.asarray(time_alone_ms, dtype=np.float64), 1e-6)
    flops = np.asarray(flops, dtype=np.float64)
    nbytes = np.asarray(nbytes, dtype=np.float64)
    out = {
        "log_time_alone_ms": log_alone(alone),
        "log_flops_per_ms": _log10(flops / alone),
        "log_bytes_per_ms": _log10(nbytes / alone),
    }
    if launches is not None:
        n = np.maximum(np.asarray(launches, dtype=np.float64), 1.0)
        out["log_ms_per_launch"] = np.log10(alone / n)
    return out


def work_block(
    work: Mapping[str, np.ndarray],
    *,
    phase: Sequence[str] | np.ndarray,
    batch_size: np.ndarray,
    param_bytes: np.ndarray,
    in_bytes: np.ndarray,
    out_bytes: np.ndarray,
    time_alone_ms: np.ndarray,
) -> np.ndarray:
    """Schema-3 static matrix ``[n, len(NUMERIC_WORK) + 2]``: ``NUMERIC_WORK`` then the phase
    one-hot. ``work`` maps each of ``WORK_COLUMNS`` to one value per row."""
    missing = [c for c in WORK_COLUMNS if c not in work]
    if missing:
        raise UserError(
            f"layers lack work count(s) {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''};"
            " profile them with this dynpipe (`dynpipe profile` records them) or add them with "
            "dynpipe.profiler.work.add_work"
        )

    def col(name: str) -> np.ndarray:
        return np.asarray(work[name], dtype=np.float64)

    flops, nbytes, launches = col("work_flops"), col("work_bytes"), col("work_launches")
    columns = {
        "log_flops": _log10(flops),
        "log_bytes": _log10(nbytes),
        "log_arith_intensity": np.log10(np.maximum(flops, 1.0) / np.maximum(nbytes, 1.0)),
        "log_launches": _log10(launches),
        "log_bytes_per_launch": _log10(nbytes / np.maximum(launches, 1.0)),
        "log_max_op_bytes": _log10(col("work_max_op_bytes")),
        "log_param_bytes": _log10(np.asarray(param_bytes, dtype=np.float64)),
        "log_in_bytes": _log10(np.asarray(in_bytes, dtype=np.float64)),
        "log_out_bytes": _log10(np.asarray(out_bytes, dtype=np.float64)),
        "log_batch_size": np.log2(np.maximum(np.asarray(batch_size, dtype=np.float64), 1.0)),
        **{f"bytes_share_{k}": col(f"work_bytes_{k}") for k in OP_KINDS},
        **{f"flops_share_{k}": col(f"work_flops_{k}") for k in FLOP_KINDS},
        **alone_dependent(
            flops=flops, nbytes=nbytes, time_alone_ms=time_alone_ms, launches=launches
        ),
    }
    numeric = np.column_stack([columns[name] for name in NUMERIC_WORK])
    phase_arr = np.asarray(phase, dtype=object)
    one_hot_phase = np.column_stack([phase_arr == p for p in PHASES]).astype(np.float64)
    return np.hstack([numeric, one_hot_phase])


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

    Without ``schema`` (fitting) the schema is schema 3 over ``df``'s ``tel_*`` columns; rows
    without work counts get them from ``dynpipe.profiler.work.add_work`` (call it once
    beforehand to avoid recounting). With ``schema`` (prediction) the output has exactly the schema's
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
        schema = FeatureSchema(kinds=(), telemetry=tuple(tel_cols))
    else:
        schema.check_telemetry(tel_cols, what="profile telemetry columns")
    if schema.uses_work:
        if not all(c in df.columns for c in WORK_COLUMNS):
            from dynpipe.profiler.work import add_work

            df = add_work(df)
        static = work_block(
            {c: df[c].to_numpy() for c in WORK_COLUMNS},
            phase=df["phase"].to_numpy(),
            batch_size=df["batch_size"].to_numpy(),
            param_bytes=df["param_bytes"].to_numpy(),
            in_bytes=df["in_bytes"].to_numpy(),
            out_bytes=df["out_bytes"].to_numpy(),
            time_alone_ms=alone,
        )
        tel = df[list(schema.telemetry)].to_numpy(dtype=np.float64)
        X = pd.DataFrame(np.hstack([static, tel]), columns=schema.names, index=df.index)
        return X, schema
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
