"""Scaling: throughput against the number of devices (GPUs), per system, from raw run logs.

Each run log names its world size (header) and every step's samples/s (step records). A
run's throughput in a phase is the median of its per-step samples/s over the phase's steps
(the first ``warmup`` steps of the run left out); runs of one system, model and world size
are averaged, their spread drawn as an error bar. With interference in the logs, one panel
shows the clean steps (before any onset) and one the steps under interference.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from dynpipe.analysis.logs import Run
from dynpipe.analysis.style import color_of, new_figure, save_figure, system_order
from dynpipe.errors import UserError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_scaling", "scaling_table"]

_PANELS = (("clean", "clean steps"), ("interference", "steps under interference"))


def scaling_table(runs: Sequence[Run], *, warmup: int = 2) -> pd.DataFrame:
    """One row per (run, phase): ``run, system, model, device, world_size, condition,
    phase, steps, samples_per_s`` (median of the per-step samples/s)."""
    rows = []
    for r in runs:
        s = r.steps[r.steps["step"] >= int(r.steps["step"].min()) + warmup]
        for phase, _ in _PANELS:
            sel = s[s["phase"] == phase]
            if sel.empty:
                continue
            rows.append(
                {
                    "run": r.name,
                    "system": r.system,
                    "model": r.model,
                    "device": r.device,
                    "world_size": r.world_size,
                    "condition": r.condition,
                    "phase": phase,
                    "steps": len(sel),
                    "samples_per_s": float(np.median(sel["samples_per_s"])),
                }
            )
    return pd.DataFrame(rows)


def plot_scaling(
    runs: Sequence[Run], *, out: str | Path | None = None, warmup: int = 2, name: str = "scaling"
) -> Figure:
    """Samples/s against world size, a line per system (and model), a panel per phase."""
    table = scaling_table(runs, warmup=warmup)
    if table.empty or table["world_size"].nunique() < 2:
        sizes = sorted(set(table["world_size"])) if len(table) else []
        raise UserError(
            f"the scaling figure needs runs at two or more world sizes; these logs have "
            f"{', '.join(map(str, sizes)) or 'none'} (run the same model with other --nproc)"
        )
    panels = [(p, t) for p, t in _PANELS if p in set(table["phase"])]
    fig = new_figure(width=5.2 * len(panels) + 1.5, height=4.4)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    systems = system_order(list(table["system"]))
    models = list(dict.fromkeys(table["model"]))
    markers = ("o", "s", "^", "D", "v")
    for ax, (phase, title) in zip(axes, panels, strict=True):
        part = table[table["phase"] == phase]
        for system in systems:
            for k, model in enumerate(models):
                g = part[(part["system"] == system) & (part["model"] == model)]
                if g.empty:
                    continue
                agg = g.groupby("world_size")["samples_per_s"].agg(["mean", "min", "max"])
                label = system if len(models) == 1 else f"{system} ({model})"
                ax.errorbar(
                    agg.index,
                    agg["mean"],
                    yerr=[agg["mean"] - agg["min"], agg["max"] - agg["mean"]],
                    color=color_of(system, systems),
                    marker=markers[k % len(markers)],
                    lw=1.8,
                    capsize=3,
                    label=label,
                )
        sizes = sorted(set(table["world_size"]))
        ax.set_xticks(sizes)
        ax.set_xlabel(_x_label(table))
        ax.set_ylabel("samples/s (median per step)")
        conds = ", ".join(dict.fromkeys(part.loc[part["phase"] == phase, "condition"]))
        ax.set_title(title + (f"\n({conds})" if phase == "interference" else ""), fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    devices = ", ".join(dict.fromkeys(table["device"]))
    fig.suptitle(f"Throughput vs device count: {', '.join(models)} on {devices}", fontsize=11)
    save_figure(fig, out, name)
    return fig


def _x_label(table: pd.DataFrame) -> str:
    if set(table["device"]) == {"cpu"}:
        return "processes (world size; one pipeline stage each)"
    return "GPUs (world size)"
