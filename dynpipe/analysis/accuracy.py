"""Predictor accuracy: predicted vs measured layer times, and the CDF of the error.

Two sources of (predicted, measured) pairs, both raw:

- an evaluation report folder (``dynpipe predictor eval … -o DIR`` or ``fit --report DIR``):
  the out-of-fold predictions it saved (``predictions_layers.parquet``) for every estimator;
- a saved predictor and profile datasets: the predictor's time for every interfered row,
  ``time_alone_ms`` × predicted slowdown, against the row's measured ``time_ms``. If the
  profiles trained it (same dataset fingerprint, or a file its training metadata lists), the
  figure says so: in-sample error flatters it.

Rows of condition ``none`` are left out: their slowdown is 1 by construction.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from dynpipe.analysis.style import new_figure, save_figure
from dynpipe.errors import UserError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Predictions", "plot_predictor", "predictions_from_predictor", "predictions_from_report"]


@dataclass
class Predictions:
    """Pairs ``estimator, interferer, measured_ms, predicted_ms`` (interfered rows only).

    primary: the estimator drawn in the scatter; source: where the pairs come from, in words.
    """

    frame: pd.DataFrame = field(repr=False)
    primary: str
    source: str
    devices: tuple[str, ...] = ()


def predictions_from_report(path: str | Path) -> Predictions:
    """Out-of-fold pairs saved by a predictor evaluation (folder or its ``report.json``)."""
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    layers = folder / "predictions_layers.parquet"
    if not layers.is_file():
        raise UserError(
            f"{folder} holds no predictions_layers.parquet; write an evaluation report with "
            "`dynpipe predictor eval PREDICTOR PROFILES -o DIR`"
        )
    df = pd.read_parquet(layers)
    summary = (
        json.loads((folder / "report.json").read_text())
        if (folder / "report.json").is_file()
        else {}
    )
    split = "condition" if "condition" in set(df["split"]) else str(df["split"].iloc[0])
    df = df[(df["split"] == split) & (df["interferer"] != "none")]
    df = df[np.isfinite(df["predicted_ms"]) & (df["measured_ms"] > 0)]
    # The report lists its primary estimator first.
    names = list(summary.get("estimators", {})) or list(dict.fromkeys(df["estimator"]))
    primary = next((n for n in names if n in set(df["estimator"])), str(df["estimator"].iloc[0]))
    devices = tuple(summary.get("data", {}).get("devices", ()))
    held = {
        "condition": "held-out interference conditions",
        "model": "held-out models",
        "interferer": "held-out interferer kinds",
    }.get(split, f"held-out {split}")
    return Predictions(
        frame=df[["estimator", "interferer", "measured_ms", "predicted_ms"]].reset_index(drop=True),
        primary=primary,
        source=f"out-of-fold, {held} ({folder.name})",
        devices=devices,
    )


def predictions_from_predictor(
    predictor: str | Path, *, profiles: Sequence[str | Path]
) -> Predictions:
    """Pairs from running a saved predictor on profile datasets (no refit)."""
    from dynpipe.predictor import load_predictor
    from dynpipe.predictor.io import dataset_fingerprint
    from dynpipe.profiler.schema import load_profiles

    if not profiles:
        raise UserError(
            f"predictor {predictor} needs profile datasets to be scored on; add --profiles "
            "profiles/NAME.parquet (or give an evaluation report folder instead)"
        )
    pred = load_predictor(predictor)
    df = load_profiles(list(profiles))
    in_sample = dataset_fingerprint(df) == pred.data_fingerprint
    rows = df[df["interferer"] != "none"].reset_index(drop=True)
    if rows.empty:
        raise UserError(
            f"profiles {', '.join(map(str, profiles))} have no interfered rows to score the "
            "predictor on; profile under interference (`dynpipe profile sweep`)"
        )
    frame = pd.DataFrame(
        {
            "estimator": pred.estimator_name,
            "interferer": rows["interferer"].astype(str),
            "measured_ms": rows["time_ms"].to_numpy(dtype=float),
            "predicted_ms": pred.predict_time_ms(rows),
        }
    )
    trained_on = {
        Path(str(m.get("path", ""))).name
        for m in pred.training.get("metadata", {}).get("dynpipe", [])
        if isinstance(m, dict)
    }
    shared = sorted(Path(p).name for p in profiles if Path(p).name in trained_on)
    name = Path(predictor).name
    if in_sample:
        source = f"{name} scored on its own training profiles (in-sample)"
    elif shared:
        source = f"{name} scored on {', '.join(shared)} (in-sample: in its training data)"
    else:
        source = f"{name} scored on profiles it was not fit on"
    return Predictions(
        frame=frame,
        primary=pred.estimator_name,
        source=source,
        devices=tuple(sorted(map(str, df["device_name"].unique()))),
    )


def _ape(g: pd.DataFrame) -> np.ndarray:
    return (
        100.0
        * np.abs(g["predicted_ms"] - g["measured_ms"]).to_numpy()
        / g["measured_ms"].to_numpy()
    )


def plot_predictor(
    preds: Predictions, *, out: str | Path | None = None, name: str = "predictor"
) -> Figure:
    """Left: predicted vs measured layer time of the primary estimator (log-log, by
    interferer). Right: CDF of the absolute percentage error of every estimator."""
    df = preds.frame
    if df.empty:
        raise UserError("no interfered (predicted, measured) pairs to draw")
    fig = new_figure(width=12, height=5)
    sc, cdf = fig.subplots(1, 2)
    main = df[df["estimator"] == preds.primary]
    kinds = sorted(set(main["interferer"]))
    palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#17becf")
    for i, k in enumerate(kinds):
        g = main[main["interferer"] == k]
        sc.scatter(
            g["measured_ms"],
            g["predicted_ms"],
            s=7,
            alpha=0.5,
            color=palette[i % len(palette)],
            label=f"{k} ({len(g)})",
            lw=0,
        )
    lo = float(min(main["measured_ms"].min(), main["predicted_ms"].min()))
    hi = float(max(main["measured_ms"].max(), main["predicted_ms"].max()))
    xs = np.geomspace(max(lo, 1e-6), hi, 50)
    sc.plot(xs, xs, "k-", lw=0.8, label="predicted = measured")
    sc.fill_between(xs, xs * 0.9, xs * 1.1, color="k", alpha=0.1, lw=0, label="±10%")
    sc.set_xscale("log")
    sc.set_yscale("log")
    ape = _ape(main)
    sc.set_title(
        f"{preds.primary}: {len(main)} layer times (MAPE {ape.mean():.1f}%, "
        f"p90 {np.percentile(ape, 90):.1f}%)",
        fontsize=10,
    )
    sc.set_xlabel("measured layer time (ms)")
    sc.set_ylabel("predicted layer time (ms)")
    sc.legend(fontsize=8, markerscale=2, loc="upper left", title="interferer (n)", title_fontsize=8)
    sc.grid(alpha=0.3, which="both", lw=0.4)
    worst = 0.0
    for est, g in df.groupby("estimator", sort=False):
        e = np.sort(_ape(g))
        worst = max(worst, float(np.percentile(e, 95)))
        cdf.step(
            e,
            np.arange(1, len(e) + 1) / len(e),
            where="post",
            lw=2.2 if est == preds.primary else 1.2,
            label=f"{est} (p50 {np.median(e):.1f}%, p90 {np.percentile(e, 90):.1f}%)",
        )
    cdf.set_xlim(0, worst * 1.1 if worst > 0 else 1)
    cdf.set_ylim(0, 1.01)
    cdf.set_xlabel("absolute error of predicted layer time (%)")
    cdf.set_ylabel("fraction of layer times (CDF)")
    cdf.set_title("error CDF per estimator (x axis up to the worst p95)", fontsize=10)
    cdf.legend(fontsize=8, loc="lower right")
    cdf.grid(alpha=0.3)
    where = ", ".join(preds.devices) if preds.devices else "?"
    fig.suptitle(f"Slowdown predictor on {where}: {preds.source}", fontsize=11)
    save_figure(fig, out, name)
    return fig
