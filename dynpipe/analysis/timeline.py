"""Figures over the course of a run: step time, per-stage busy fraction, loss vs wall time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dynpipe.analysis.logs import Run
from dynpipe.analysis.metrics import choose_target, smoothed_loss, time_to_target
from dynpipe.analysis.style import (
    color_of,
    describe,
    line_styles,
    new_figure,
    save_figure,
    shade_windows,
    system_order,
)
from dynpipe.errors import UserError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["plot_busy_fraction", "plot_loss", "plot_step_time"]


def _need(runs: Sequence[Run]) -> list[Run]:
    if not runs:
        raise UserError("no run logs given; pass JSONL files written by `dynpipe train --log`")
    order = system_order([r.system for r in runs])
    return sorted(runs, key=lambda r: order.index(r.system))


def _mark_moves(ax: Axes, run: Run, color: str) -> list[str]:
    """Dashed lines at repartitions, dotted at restarts (before the step they precede);
    returns the kinds drawn."""
    drawn = []
    for name, style in (("repartition", "--"), ("restart", ":")):
        evs = run.events_of(name)
        for ev in evs:
            ax.axvline(int(ev.step) - 0.5, color=color, ls=style, lw=1.3, alpha=0.9, zorder=3)
        if evs:
            drawn.append(name)
    return drawn


def _move_legend(ax: Axes, kinds: set[str], *, note: str = "") -> None:
    """Legend outside the axes on the right, with entries for the move markers drawn."""
    from matplotlib.lines import Line2D

    handles, labels = ax.get_legend_handles_labels()
    for name, style in (("repartition", "--"), ("restart", ":")):
        if name in kinds:
            handles.append(Line2D([], [], color="k", ls=style, lw=1.3))
            labels.append(f"{name}{note}")
    ax.legend(
        handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.9
    )


def plot_step_time(
    runs: Sequence[Run], *, out: str | Path | None = None, smooth: int = 5, name: str = "step_time"
) -> Figure:
    """Step time over steps, one line per run: raw steps faint, a centred rolling median of
    ``smooth`` steps bold; interference shaded, repartitions and restarts marked."""
    runs = _need(runs)
    systems = [r.system for r in runs]
    fig = new_figure(width=10.5, height=4.6)
    ax = fig.add_subplot()
    shade_windows(ax, runs)
    kinds: set[str] = set()
    styles = line_styles(runs)
    for run in runs:
        c = color_of(run.system, systems)
        s = run.steps
        ax.plot(s["step"], s["step_ms"], color=c, lw=0.6, alpha=0.3)
        med = s["step_ms"].rolling(max(1, smooth), center=True, min_periods=1).median()
        ax.plot(s["step"], med, color=c, lw=2, ls=styles[run.name], label=run.name)
        kinds.update(_mark_moves(ax, run, c))
    # Scaled to the steps after start-up: the first steps (allocator, kernel selection) can
    # be 20x slower and would flatten everything else; rarer spikes run off the top.
    top = max(
        float(r.steps["step_ms"].iloc[2:].quantile(0.98))
        if len(r.steps) > 2
        else float(r.steps["step_ms"].max())
        for r in runs
    )
    ax.set_ylim(0, top * 1.25)
    ax.set_xlabel("training step")
    ax.set_ylabel("step time (ms)")
    ax.set_title(
        f"Step time: {describe(runs)} (faint: every step; bold: rolling median of {smooth})"
    )
    ax.grid(alpha=0.3)
    _move_legend(ax, kinds, note=" (in the run's colour)")
    save_figure(fig, out, name)
    return fig


def plot_busy_fraction(
    runs: Sequence[Run],
    *,
    out: str | Path | None = None,
    smooth: int = 5,
    name: str = "busy_fraction",
) -> Figure:
    """Per run, each stage's compute share of the step, (fwd + bwd) / step time, over steps
    (rolling mean of ``smooth``); the rest is waiting on neighbours and pipeline bubbles."""
    runs = [r for r in _need(runs) if not r.stages.empty]
    if not runs:
        raise UserError("the run logs have no per-stage timings (rerun without --no-timing)")
    fig = new_figure(width=10.5, height=1.0 + 2.4 * len(runs))
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False)[:, 0]
    cmap = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf")
    for ax, run in zip(axes, runs, strict=True):
        shade_windows(ax, [run])
        kinds = set(_mark_moves(ax, run, "k"))
        for stage, g in run.stages.groupby("stage"):
            busy = g["busy"].rolling(max(1, smooth), center=True, min_periods=1).mean()
            ranks = "/".join(str(r) for r in dict.fromkeys(g["rank"]))
            ax.plot(
                g["step"],
                busy,
                color=cmap[int(stage) % len(cmap)],
                lw=1.6,
                label=f"stage {stage} (rank {ranks})",
            )
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("busy fraction")
        ax.set_title(f"{run.name}: {run.model} on {run.device}", fontsize=10)
        ax.grid(alpha=0.3)
        _move_legend(ax, kinds)
    axes[-1].set_xlabel("training step")
    fig.suptitle(
        f"Per-stage busy fraction (fwd + bwd) / step time: {describe(runs)} "
        f"(rolling mean of {smooth})",
        fontsize=11,
    )
    save_figure(fig, out, name)
    return fig


def plot_loss(
    runs: Sequence[Run],
    *,
    out: str | Path | None = None,
    target: float | None = None,
    quantile: float = 0.1,
    smooth: int = 5,
    name: str = "loss_time",
) -> Figure:
    """Loss against wall time since each run's start, with time to ``target`` marked.

    Without ``target``, it is the loss every run reaches (``choose_target``). The curve is
    the trailing mean of ``smooth`` steps, the same one time-to-target reads.
    """
    runs = _need(runs)
    systems = [r.system for r in runs]
    chosen = target is None
    if target is None:
        target = choose_target(runs, quantile=quantile, smooth=smooth)
    fig = new_figure(width=9, height=4.8)
    ax = fig.add_subplot()
    tmax = max(float(r.steps["elapsed_s"].max()) for r in runs)
    styles = line_styles(runs)
    for i, run in enumerate(runs):
        c = color_of(run.system, systems)
        s = run.steps
        # A relaunch (new segment) leaves a gap in the curve instead of a line across it.
        smoothed = smoothed_loss(run, smooth=smooth)
        for k, (_seg, g) in enumerate(s.groupby("segment", sort=True)):
            ax.plot(g["elapsed_s"], g["loss"], color=c, lw=0.5, alpha=0.25)
            ax.plot(
                g["elapsed_s"],
                smoothed[g.index],
                color=c,
                lw=2,
                ls=styles[run.name],
                label=run.name if k == 0 else None,
            )
            if k:
                ax.axvline(float(g["elapsed_s"].iloc[0]), color=c, ls=":", lw=1)
        tt = time_to_target(run, target, smooth=smooth)
        if tt is not None:
            ax.plot([tt], [target], "o", color=c, ms=8, mec="k", zorder=5)
            ax.annotate(
                f"{tt:.1f} s",
                (tt, target),
                xytext=(4, -14 - 11 * i),
                textcoords="offset points",
                color=c,
                fontsize=9,
                fontweight="bold",
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8},
            )
        # Interference of this run: a strip under the curves in the run's colour.
        for w in run.windows:
            end = w.t_stop if w.t_stop is not None else float(s["elapsed_s"].max())
            ax.axvspan(
                w.t_start,
                end,
                ymin=0.0 + 0.025 * i,
                ymax=0.02 + 0.025 * i,
                color=c,
                alpha=0.8,
                lw=0,
            )
    ax.axhline(target, color="k", ls="--", lw=1, label=f"target loss {target:.4g}")
    ax.set_xlim(0, tmax * 1.02)
    ax.set_xlabel("wall time since start (s)")
    ax.set_ylabel(f"training loss (trailing mean of {smooth} steps)")
    how = f"the {quantile:.0%} quantile every run reaches" if chosen else "given"
    notes = []
    if any(r.windows for r in runs):
        notes.append("strips at the bottom: interference on, per run")
    if any(r.steps["segment"].max() > 0 for r in runs):
        notes.append("dotted: first step after a relaunch")
    lines = [f"Loss vs wall time: {describe(runs)}", f"target loss {how}; dots: time to target"]
    if notes:
        lines.append("; ".join(notes))
    ax.set_title("\n".join(lines), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    lo = min(float(np.nanmin(r.steps["loss"])) for r in runs)
    hi = max(
        max(float(np.nanquantile(r.steps["loss"], 0.99)), float(smoothed_loss(r).max()))
        for r in runs
    )
    pad = 0.08 * (hi - lo) if hi > lo else 0.1
    ax.set_ylim(lo - 2 * pad, hi + pad)
    save_figure(fig, out, name)
    return fig
