"""Per-layer times from a profile dataset: the rows ``CostModel.from_profile`` needs.

Kept apart from ``costs`` because it is the only planner code that touches pandas.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dynpipe.errors import UserError

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["ProfileTimes", "check_profile_model", "profile_times"]

_NEEDED = (
    "model",
    "layer",
    "layer_index",
    "phase",
    "batch_size",
    "condition",
    "time_ms",
    "param_bytes",
    "in_bytes",
    "out_bytes",
)


@dataclass(frozen=True, eq=False)
class ProfileTimes:
    """Times ``[D, L]`` (one row per requested condition) and static bytes ``[L]``."""

    layer_names: tuple[str, ...]
    fwd_ms: np.ndarray
    bwd_ms: np.ndarray
    param_bytes: np.ndarray
    in_bytes: np.ndarray
    out_bytes: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)


def _load(profile: pd.DataFrame | str | os.PathLike[str] | Sequence[str]) -> pd.DataFrame:
    import pandas as pd

    if isinstance(profile, pd.DataFrame):
        df = profile
    else:
        from dynpipe.profiler.schema import load_profiles

        df = load_profiles(profile)
    missing = [c for c in _NEEDED if c not in df.columns]
    if missing:
        raise UserError(
            f"profile lacks column(s) {', '.join(missing)}; regenerate it with `dynpipe profile`"
        )
    return df


def _one(df: pd.DataFrame, col: str, what: str) -> Any:
    if col not in df.columns:
        return None
    vals = sorted(map(str, df[col].dropna().unique()))
    if len(vals) > 1:
        raise UserError(
            f"profile mixes {what} {', '.join(vals)}; pass a dataset with one {what} (filter it "
            "or profile each separately)"
        )
    return vals[0] if vals else None


def profile_times(
    profile: pd.DataFrame | str | os.PathLike[str] | Sequence[str],
    *,
    model: str,
    microbatch_size: int,
    conditions: Sequence[str],
) -> ProfileTimes:
    """Median layer times of ``model`` per condition, scaled to ``microbatch_size`` samples."""
    df = _load(profile)
    rows = df[df["model"] == model]
    if rows.empty:
        have = ", ".join(sorted(map(str, df["model"].unique())))
        raise UserError(
            f"profile has no rows for model {model!r} (it has: {have}); profile it with "
            f"`dynpipe profile --model {model}`"
        )
    device = _one(rows, "device_name", "devices")
    dtype = _one(rows, "dtype", "dtypes")
    sizes = np.array(sorted(int(b) for b in rows["batch_size"].unique()))
    # Nearest profiled batch size (ties to the larger); layer time is close to linear in batch
    # well above the launch-overhead regime, which is where pipelines run.
    bs = int(sizes[np.argmin(np.abs(sizes - microbatch_size) - 1e-9 * sizes)])
    scale = microbatch_size / bs
    rows = rows[rows["batch_size"] == bs]
    names_by_index = rows.groupby("layer_index")["layer"].first().sort_index()
    n = int(names_by_index.index.max()) + 1
    absent = sorted(set(range(n)) - set(int(i) for i in names_by_index.index))
    if absent:
        raise UserError(
            f"profile of {model} at batch {bs} lacks layer(s) {absent[:8]}; re-run "
            f"`dynpipe profile --model {model}` to completion"
        )
    fwd = np.zeros((len(conditions), n))
    bwd = np.zeros((len(conditions), n))
    have_conds = sorted(map(str, rows["condition"].unique()))
    for d, cond in enumerate(conditions):
        sub = rows[rows["condition"] == cond]
        if sub.empty:
            raise UserError(
                f"profile of {model} at batch {bs} has no condition {cond!r} (it has: "
                f"{', '.join(have_conds)}); pick one of those"
            )
        table = sub.pivot_table(
            index="layer_index", columns="phase", values="time_ms", aggfunc="median"
        )
        for phase, out in (("fwd", fwd), ("bwd", bwd)):
            col = table[phase] if phase in table.columns else None
            got = set() if col is None else set(int(i) for i in col.dropna().index)
            lack = sorted(set(range(n)) - got)
            if lack:
                raise UserError(
                    f"profile of {model} under {cond!r} lacks {phase} times for layer(s) "
                    f"{lack[:8]}; re-run `dynpipe profile --model {model}` to completion"
                )
            out[d] = col.reindex(range(n)).to_numpy(dtype=float) * scale
    static = rows.groupby("layer_index")[["param_bytes", "in_bytes", "out_bytes"]].first()
    static = static.reindex(range(n))
    meta: dict[str, Any] = {"profile_batch_size": bs, "device_name": device, "dtype": dtype}
    if scale != 1.0:
        meta["scaled_from_batch"] = bs
    files = df.attrs.get("dynpipe")
    if files:
        meta["profile_files"] = [f.get("path") for f in files]
    return ProfileTimes(
        layer_names=tuple(str(x) for x in names_by_index.to_numpy()),
        fwd_ms=fwd,
        bwd_ms=bwd,
        param_bytes=static["param_bytes"].to_numpy(dtype=float),
        in_bytes=static["in_bytes"].to_numpy(dtype=float) * scale,
        out_bytes=static["out_bytes"].to_numpy(dtype=float) * scale,
        meta=meta,
    )


def check_profile_model(
    profile: pd.DataFrame | str | os.PathLike[str] | Sequence[str],
    *,
    model: str,
    layer_names: Sequence[str],
    param_counts: Sequence[int],
) -> None:
    """Refuse a profile of another configuration of ``model`` (depth, width, classes): its
    layers must carry the model's names and parameter counts, else the planner would price
    the model's layers by another model's times. One line saying what differs."""
    df = _load(profile)
    rows = df[df["model"] == model]
    if rows.empty:
        return  # ``profile_times`` names the missing model
    names = [str(x) for x in rows.groupby("layer_index")["layer"].first().sort_index()]
    fix = f"profile this configuration (`dynpipe profile --model {model} --set ...`)"
    if names != list(layer_names):
        raise UserError(
            f"profile's {model} has {len(names)} layers ({names[0]}..{names[-1]}), the model "
            f"{len(layer_names)} ({layer_names[0]}..{layer_names[-1]}): another configuration; "
            f"{fix}"
        )
    if "param_count" not in rows.columns:  # profiles of an older schema carry no counts
        return
    counts = rows.groupby("layer_index")["param_count"].first().sort_index()
    for i, (want, got) in enumerate(zip(param_counts, counts, strict=True)):
        if not np.isnan(float(got)) and int(got) != int(want):
            raise UserError(
                f"profile's {model} layer {names[i]} has {int(got)} parameters, the model's "
                f"{int(want)}: another configuration (width, classes, vocabulary); {fix}"
            )
