"""Bar figures: step time per phase, end-to-end throughput, migration cost vs restart."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from dynpipe.analysis.logs import Run
from dynpipe.analysis.metrics import migration_costs, phase_stats, throughput
from dynpipe.analysis.phases import PHASES
from dynpipe.analysis.style import color_of, describe, new_figure, save_figure, system_order
from dynpipe.errors import UserError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_migration", "plot_phases", "plot_throughput"]


def _grouped_bars(
    ax,
    groups: list[str],
    systems: list[str],
    values: dict,
    *,
    fmt: str,
    errors: dict | None = None,
    all_systems: Sequence[str] = (),
) -> dict[tuple[str, str], float]:
    """Bars of ``values[(group, system)]``, one cluster per group (only the systems it has,
    centred under its label), the number above each; returns each bar's x position."""
    errors = errors or {}
    most = max(sum((g, s) in values for s in systems) for g in groups)
    width = 0.8 / max(1, most)
    top = max(
        (v + errors.get(k, 0.0) for k, v in values.items() if np.isfinite(v)),
        default=1.0,
    )
    where: dict[tuple[str, str], float] = {}
    labelled: set[str] = set()
    for i, g in enumerate(groups):
        present = [s for s in systems if (g, s) in values]
        for k, system in enumerate(present):
            x = i + (k - (len(present) - 1) / 2) * width
            y, e = values[(g, system)], errors.get((g, system), 0.0)
            where[(g, system)] = x
            ax.bar(
                x,
                y,
                width * 0.92,
                color=color_of(system, all_systems or systems),
                label=None if system in labelled else system,
                yerr=e if errors else None,
                error_kw={"lw": 0.8, "capsize": 2, "ecolor": "#333"},
            )
            labelled.add(system)
            ax.text(
                x,
                y + (e if np.isfinite(e) else 0) + 0.015 * top,
                format(y, fmt),
                ha="center",
                va="bottom",
                fontsize=7.5,
                rotation=90 if most > 3 else 0,
            )
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylim(0, top * 1.25)
    ax.grid(axis="y", alpha=0.3)
    return where


def _legend_below(fig, axes, systems: Sequence[str]) -> None:
    """One legend under the panels, systems in the fixed order (clear of the bar numbers)."""
    found: dict[str, object] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            found.setdefault(lab, h)
    names = [s for s in systems if s in found]
    # About 0.07 inch per character at 8 pt, plus the colour patch: as many columns as fit.
    per = 0.07 * (max(map(len, names), default=1) + 6)
    ncols = max(1, min(len(names), int(fig.get_figwidth() / per)))
    fig.legend(
        [found[n] for n in names], names, loc="outside lower center", ncols=ncols, fontsize=8
    )


def plot_phases(
    runs: Sequence[Run], *, out: str | Path | None = None, warmup: int = 2, name: str = "phases"
) -> Figure:
    """Mean step time (± one standard deviation) per phase and system.

    One panel per interference condition in the logs, light to heavy (so light vs heavy sit
    side by side when the logs hold both); a run's clean phase appears in the panel of every
    condition it saw, and a run without interference in every panel of its model.
    """
    if not runs:
        raise UserError("no run logs given; pass JSONL files written by `dynpipe train --log`")
    stats = pd.concat([phase_stats(r, warmup=warmup) for r in runs], ignore_index=True)
    severity = {w.label: w.severity for r in runs for w in r.windows}
    conds = sorted(
        {c for c in stats["condition"].dropna()},
        key=lambda c: (max((severity.get(p, 0.0) for p in c.split(" + ")), default=0.0), c),
    )
    panels: list[tuple[str, pd.DataFrame]] = []
    if not conds:
        panels.append(("no interference in these logs", stats))
    clean_only = {r.name for r in runs if not r.windows}
    for cond in conds:
        runs_here = set(stats.loc[stats["condition"] == cond, "run"])
        models = set(stats.loc[stats["run"].isin(runs_here), "model"])
        runs_here |= {r.name for r in runs if r.name in clean_only and r.model in models}
        sel = stats[
            stats["run"].isin(runs_here)
            & (stats["condition"].isna() | (stats["condition"] == cond))
        ]
        panels.append((cond, sel))
    kinds = {w.label: w.kind for r in runs for w in r.windows}
    same_kind = len({kinds.get(p) for c in conds for p in c.split(" + ")}) == 1
    if len(conds) == 2 and same_kind:  # light vs heavy only within one kind of interferer
        panels = [
            (f"{tag}: {c}", sel) for tag, (c, sel) in zip(("light", "heavy"), panels, strict=True)
        ]
    all_systems = system_order(stats["system"])
    fig = new_figure(width=max(6.0, 4.6 * len(panels)), height=4.6)
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=True)[0]
    for ax, (title, sel) in zip(axes, panels, strict=True):
        phases = [p for p in PHASES if p in set(sel["phase"])]
        # Several runs of one system in one cell (repeats) are averaged.
        cell = sel.groupby(["phase", "system"]).agg(
            mean=("mean_ms", "mean"), std=("std_ms", "mean")
        )
        values = {k: float(v) for k, v in cell["mean"].items()}
        errors = {k: float(v) for k, v in cell["std"].items()}
        systems = [s for s in all_systems if s in set(sel["system"])]
        _grouped_bars(
            ax, phases, systems, values, fmt=".0f", errors=errors, all_systems=all_systems
        )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("phase")
        ax.set_ylabel("mean step time (ms)")
    _legend_below(fig, axes, all_systems)
    fig.suptitle(
        f"Step time per phase: {describe(runs)}\n(first {warmup} steps left out; whiskers: ±1 sd)",
        fontsize=11,
    )
    save_figure(fig, out, name)
    return fig


def plot_throughput(
    runs: Sequence[Run], *, out: str | Path | None = None, name: str = "throughput"
) -> Figure:
    """End-to-end samples/s per model (and interference condition) and system; pauses count.

    With a ``static`` run of the same model and condition, each bar also gives its speed-up.
    """
    if not runs:
        raise UserError("no run logs given; pass JSONL files written by `dynpipe train --log`")
    rows = [
        {"group": f"{r.model}\n{r.condition}", "system": r.system, "sps": throughput(r)}
        for r in runs
    ]
    df = pd.DataFrame(rows).groupby(["group", "system"], sort=False)["sps"].mean()
    groups = list(dict.fromkeys(g for g, _ in df.index))
    systems = system_order([s for _, s in df.index])
    values = {k: float(v) for k, v in df.items()}
    fig = new_figure(width=max(6.0, 1.5 + 1.1 * len(values)), height=4.8)
    ax = fig.add_subplot()
    where = _grouped_bars(ax, groups, systems, values, fmt=".1f")
    speedups = 0
    for (g, s), x in where.items():
        base = values.get((g, "static"))
        if base and s != "static":
            speedups += 1
            ax.text(
                x,
                values[(g, s)] / 2,
                f"{values[(g, s)] / base:.2f}×",
                ha="center",
                va="center",
                fontsize=8,
                color="white",
                fontweight="bold",
            )
    ax.set_xlabel("model and interference")
    ax.set_ylabel("throughput (samples/s, end to end)")
    _legend_below(fig, [ax], systems)
    note = " (inside the bars: speed-up over static)" if speedups else ""
    ax.set_title(f"Throughput: {describe(runs)}{note}", fontsize=10)
    save_figure(fig, out, name)
    return fig


def plot_migration(
    runs: Sequence[Run], *, out: str | Path | None = None, name: str = "migration"
) -> Figure:
    """Left: every live repartition's pause broken into decide / transfer / rebuild. Right:
    the whole pause of every repartition and restart (decide + checkpoint, exit, relaunch)
    on one log scale, since a restart costs orders of magnitude more, with a tick at the
    wall-clock gap the step records show around each (an independent check of the pause)."""
    costs = migration_costs(runs)
    if costs.empty:
        raise UserError(
            "the run logs hold no repartition or restart events; record runs with "
            "`dynpipe train --adapt measured|adaptive|restart --scenario FILE`"
        )
    costs = costs.sort_values(["kind", "run", "step"], ascending=[False, True, True])
    costs = costs.reset_index(drop=True)

    def label(r) -> str:
        mb = f", {r.bytes / 2**20:.2f} MiB" if np.isfinite(r.bytes) else ""
        what = r.run if r.kind in r.run else f"{r.run} {r.kind}"
        return f"{what} @ step {r.step}{mb}"

    live = costs[costs["kind"] == "repartition"]
    fig = new_figure(width=12, height=1.8 + 0.45 * len(costs))
    left, right = fig.subplots(1, 2, width_ratios=[1.3, 1])
    if len(live):
        ys = np.arange(len(live))[::-1]
        acc = np.zeros(len(live))
        for col, part, c in (
            ("decide_ms", "decide", "#4c72b0"),
            ("transfer_ms", "transfer (P2P)", "#dd8452"),
            ("rebuild_ms", "rebuild", "#55a868"),
        ):
            v = live[col].fillna(0.0).to_numpy()
            left.barh(ys, v, left=acc, color=c, label=part, height=0.7)
            acc += v
        for y, a, total in zip(ys, acc, live["pause_ms"], strict=True):
            left.text(a, y, f" {total:.2f} ms", va="center", fontsize=8)
        left.set_yticks(ys, [label(r) for r in live.itertuples()], fontsize=8)
        left.set_xlim(0, max(float(acc.max()), 1e-3) * 1.3)
    else:
        left.text(
            0.5,
            0.5,
            "no live repartition in these logs",
            ha="center",
            va="center",
            transform=left.transAxes,
        )
        left.set_yticks([])
    left.set_xlabel("time (ms)")
    left.set_ylabel("repartition (run, step, bytes moved)")
    left.set_title("live repartition pause, by part", fontsize=10)
    left.grid(axis="x", alpha=0.3)

    ys = np.arange(len(costs))[::-1]
    totals = costs["pause_ms"].to_numpy(dtype=float)
    systems = list(costs["system"])
    colors = [color_of(s, systems) for s in systems]
    hatches = ["" if k == "repartition" else "//" for k in costs["kind"]]
    bars = right.barh(ys, np.where(np.isfinite(totals), totals, np.nan), color=colors, height=0.7)
    for b, h in zip(bars, hatches, strict=True):
        b.set_hatch(h)
    gaps = costs["gap_ms"].to_numpy(dtype=float)
    if np.isfinite(gaps).any():
        right.plot(gaps, ys, "k|", ms=16, mew=2, label="wall gap between the steps around it")
    finite = totals[np.isfinite(totals) & (totals > 0)]
    lo = float(finite.min()) / 3 if len(finite) else 0.1
    for y, t, g in zip(ys, totals, gaps, strict=True):
        text = (
            (f" {t / 1e3:.2f} s" if t >= 1e3 else f" {t:.2f} ms")
            if np.isfinite(t)
            else (" no resumed event")
        )
        at = np.nanmax([t, g]) if np.isfinite([t, g]).any() else lo
        right.text(at * 1.08, y, text, va="center", fontsize=8)
    right.set_xscale("log")
    restarts = bool((costs["kind"] == "restart").any())
    if restarts and len(live):
        right.set_yticks(ys, [label(r) for r in costs.itertuples()], fontsize=8)
        right.yaxis.tick_right()
    else:  # the same rows as the left panel, or only restarts: label on the left
        right.set_yticks(ys, [""] * len(ys))
        if not len(live):
            left.set_yticks(ys, [label(r) for r in costs.itertuples()], fontsize=8)
    right.set_xlabel("whole pause (ms, log scale)")
    right.set_ylabel("repartition or restart (run, step)")
    if restarts and len(live):
        right.yaxis.set_label_position("right")
    right.set_title(
        "repartition (solid) vs restart (hatched)"
        if restarts
        else "whole pause (no restart baseline in these logs)",
        fontsize=10,
    )
    if len(finite):
        right.set_xlim(lo, float(finite.max()) * 12)
    right.grid(axis="x", alpha=0.3)
    handles, names = [], []
    for ax in (left, right):
        h, n = ax.get_legend_handles_labels()
        handles += h
        names += n
    if names:
        fig.legend(handles, names, loc="outside lower center", ncols=len(names), fontsize=8)
    fig.suptitle(f"Migration cost: {describe(runs)}", fontsize=11)
    save_figure(fig, out, name)
    return fig
