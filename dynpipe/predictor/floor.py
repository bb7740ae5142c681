"""What a profile's own measurement noise leaves to predict: identical layers in one window.

Layers of one model with the same kind, FLOPs and parameter / input / output bytes (a
transformer's blocks, a ResNet stage's repeated bottlenecks) are the same computation: nothing
a per-layer predictor knows of them tells them apart. Measured in one telemetry window (same
run, same phase), their times differ only by timing noise and by what the device and the host
did while each was timed. Predicting each one from the geometric mean of its identical
siblings' measured times is therefore about as well as any predictor can do on those rows;
its error is the floor the per-layer accuracy of a predictor is read against.

Only classes of at least ``min_class`` layers count (default 3: each row is then predicted
from two or more siblings, so the siblings' own noise is averaged down); the floor is
slightly pessimistic for the smallest classes for the same reason.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dynpipe.predictor.stages import run_keys

__all__ = ["IDENTITY", "identical_classes", "sibling_floor"]

# What makes two layers of one model the same computation.
IDENTITY: tuple[str, ...] = ("kind", "flops", "param_bytes", "in_bytes", "out_bytes")


def identical_classes(df: pd.DataFrame) -> np.ndarray:
    """Per row, an id shared by the identical layers of the same run and phase."""
    keys = [*run_keys(df), "phase", *IDENTITY]
    return df.groupby(keys, sort=False, dropna=False).ngroup().to_numpy()


def sibling_floor(df: pd.DataFrame, *, min_class: int = 3) -> pd.DataFrame:
    """Interfered rows of identical-layer classes of ``min_class`` or more, each with
    ``predicted_ms``: the geometric mean of the measured times of its siblings (the class's
    other rows). Columns: the run keys, ``layer_index``, ``kind``, ``phase``,
    ``interferer``, ``measured_ms``, ``predicted_ms``."""
    cls = identical_classes(df)
    size = pd.Series(cls).map(pd.Series(cls).value_counts()).to_numpy()
    keep = (size >= min_class) & (df["interferer"].to_numpy() != "none")
    sub = df.loc[keep]
    cls = cls[keep]
    log_t = np.log(sub["time_ms"].to_numpy(dtype=np.float64))
    total = pd.Series(log_t).groupby(cls).transform("sum").to_numpy()
    count = size[keep]
    # Leave the row itself out: the mean of the others' log times.
    predicted = np.exp((total - log_t) / (count - 1))
    out = sub[[*run_keys(df), "layer_index", "kind", "phase", "interferer"]].copy()
    out["measured_ms"] = sub["time_ms"].to_numpy(dtype=np.float64)
    out["predicted_ms"] = predicted
    return out.reset_index(drop=True)
