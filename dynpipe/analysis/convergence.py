"""Time to accuracy: held-out accuracy (or eval loss) against wall time, and the time each
run needs to reach a target, with its ratio to the static run of the same model and
interference.

Drawn from the ``eval`` records of the run logs (``dynpipe train --eval-every N``): each
point is one evaluation, at the wall time its record was written (since the run's first
header, so start-up, pauses, relaunches and the evaluations themselves all count).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from dynpipe.analysis.logs import Run
from dynpipe.analysis.metrics import EvalTarget, choose_eval_target, time_to_eval_target
from dynpipe.analysis.style import (
    color_of,
    describe,
    line_styles,
    new_figure,
    save_figure,
    system_order,
)
from dynpipe.errors import UserError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_time_to_accuracy", "time_to_accuracy_table"]


def time_to_accuracy_table(
    runs: Sequence[Run],
    *,
    target_accuracy: float | None = None,
    target_loss: float | None = None,
) -> tuple[pd.DataFrame, EvalTarget]:
    """Per run: time and steps to the target, the final evaluation, and ``vs_static``: the
    static run's time to the target over this run's (> 1: this run got there sooner), for
    runs with a static run of the same model, interference and world size that reached it
    (a static run on more GPUs is not the baseline of an adaptive run on fewer)."""
    target = choose_eval_target(runs, target_accuracy=target_accuracy, target_loss=target_loss)
    rows = []
    for r in runs:
        hit = time_to_eval_target(r, target)
        last = r.evals.iloc[-1]
        rows.append(
            {
                "run": r.name,
                "system": r.system,
                "model": r.model,
                "device": r.device,
                "condition": r.condition,
                "world_size": r.world_size,
                "time_s": hit[0] if hit else np.nan,
                "step": hit[1] if hit else None,
                "final": float(last[target.metric]),
                "final_step": int(last["step"]),
                "total_s": float(r.steps["elapsed_s"].max()),
            }
        )
    df = pd.DataFrame(rows)
    key = ["model", "condition", "world_size"]
    static = df[df["system"] == "static"].groupby(key)["time_s"].mean()
    df["vs_static"] = [
        static[(row.model, row.condition, row.world_size)] / row.time_s
        if (row.model, row.condition, row.world_size) in static.index and row.time_s > 0
        else np.nan
        for row in df.itertuples()
    ]
    return df, target


def plot_time_to_accuracy(
    runs: Sequence[Run],
    *,
    out: str | Path | None = None,
    target_accuracy: float | None = None,
    target_loss: float | None = None,
    name: str = "time_to_accuracy",
) -> Figure:
    """Left: eval accuracy (or loss) against wall time per run, the target dashed and each
    run's first evaluation at or past it dotted. Right: time to the target per run, with
    its ratio to the static run."""
    if not runs:
        raise UserError("no run logs given; pass JSONL files written by `dynpipe train --log`")
    order = system_order([r.system for r in runs])
    runs = sorted(runs, key=lambda r: order.index(r.system))
    table, target = time_to_accuracy_table(
        runs, target_accuracy=target_accuracy, target_loss=target_loss
    )
    systems = [r.system for r in runs]
    fig = new_figure(width=12, height=4.8)
    curve, bars = fig.subplots(1, 2, width_ratios=(1.6, 1))
    styles = line_styles(runs)
    metric = target.metric
    scale = 100.0 if metric == "accuracy" else 1.0
    for i, run in enumerate(runs):
        c = color_of(run.system, systems)
        ev = run.evals
        curve.plot(
            ev["elapsed_s"],
            ev[metric] * scale,
            color=c,
            lw=1.8,
            ls=styles[run.name],
            marker="o",
            ms=3.5,
            label=run.name,
        )
        hit = time_to_eval_target(run, target)
        if hit is not None:
            curve.plot([hit[0]], [target.value * scale], "o", color=c, ms=9, mec="k", zorder=5)
            curve.annotate(
                f"{hit[0]:.1f} s",
                (hit[0], target.value * scale),
                xytext=(4, (-14 if target.higher_is_better else 8) - 11 * i),
                textcoords="offset points",
                color=c,
                fontsize=9,
                fontweight="bold",
            )
        for w in run.windows:
            end = w.t_stop if w.t_stop is not None else float(run.steps["elapsed_s"].max())
            curve.axvspan(
                w.t_start, end, ymin=0.025 * i, ymax=0.02 + 0.025 * i, color=c, alpha=0.8, lw=0
            )
    curve.axhline(target.value * scale, color="k", ls="--", lw=1, label="target")
    curve.set_xlabel("wall time since start (s)")
    curve.set_ylabel("held-out accuracy (%)" if metric == "accuracy" else "held-out loss")
    curve.grid(alpha=0.3)
    curve.legend(fontsize=8, loc="lower right" if target.higher_is_better else "upper right")
    notes = "strips at the bottom: interference on, per run" if any(r.windows for r in runs) else ""
    curve.set_title(f"target: {target}" + (f"\n{notes}" if notes else ""), fontsize=9)

    y = np.arange(len(table))
    for k, row in enumerate(table.itertuples()):
        c = color_of(row.system, systems)
        if np.isfinite(row.time_s):
            bars.barh(k, row.time_s, color=c, height=0.6)
            ratio = f"  ×{row.vs_static:.2f} vs static" if np.isfinite(row.vs_static) else ""
            bars.text(row.time_s, k, f" {row.time_s:.1f} s{ratio}", va="center", fontsize=8)
        else:
            bars.text(0, k, " not reached", va="center", fontsize=8, color=c)
    bars.set_yticks(y, list(table["run"]))
    bars.invert_yaxis()
    finite = table["time_s"].to_numpy(dtype=float)
    top = float(np.nanmax(finite)) if np.isfinite(finite).any() else 1.0
    bars.set_xlim(0, top * 1.6)
    bars.set_xlabel("wall time to target (s)")
    bars.set_title("time to target (×: static's time / this run's)", fontsize=9)
    bars.grid(axis="x", alpha=0.3)
    fig.suptitle(f"Time to accuracy: {describe(runs)}", fontsize=11)
    save_figure(fig, out, name)
    return fig
