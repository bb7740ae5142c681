"""Pipeline bubbles per plan: the event simulator beside what the run measured.

For each plan a run trained under (per phase), the simulator (``dynpipe.planner.simulate``)
replays one step of the plan's schedule with the stage times the run measured: each stage's
median forward and backward per step, divided by the microbatches. Transfers are not in the
step records, so the simulated bubble is the schedule's own (dependencies between stages);
the measured bubble, 1 - Σ(fwd + bwd) / (stages × step time), adds transfers and overheads.
Plan files from ``dynpipe plan`` (``partitions/``) carry the planner's predicted per-stage
times and link costs and are simulated with those.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from dynpipe.analysis.logs import Run
from dynpipe.analysis.phases import PHASES
from dynpipe.analysis.style import describe, new_figure, save_figure
from dynpipe.errors import UserError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["partition_bubbles", "plot_bubbles", "run_bubbles"]

_COLUMNS = [
    "source",
    "plan",
    "phase",
    "schedule",
    "microbatches",
    "steps",
    "simulated_bubble",
    "measured_bubble",
    "simulated_step_ms",
    "measured_step_ms",
]


def _plan_text(bounds: Sequence[tuple[int, int]]) -> str:
    """``0-4|5-9``: the layers of each stage, inclusive (a one-layer stage is one number)."""
    return "|".join(f"{a}-{b - 1}" if b - 1 > a else f"{a}" for a, b in bounds)


def run_bubbles(runs: Sequence[Run], *, warmup: int = 2) -> pd.DataFrame:
    """One row per (run, plan, phase): simulated and measured bubble fraction and step time."""
    from dynpipe.planner.simulate import simulate

    rows = []
    for run in runs:
        st = run.stages
        if st.empty:
            continue
        st = st[st["step"] >= int(run.steps["step"].min()) + warmup]
        phase = dict(zip(run.steps["step"], run.steps["phase"], strict=True))
        bounds = st.groupby("step").apply(
            lambda g: tuple(zip(g["start"], g["stop"], strict=True)), include_groups=False
        )
        st = st.assign(plan=st["step"].map(bounds), phase=st["step"].map(phase))
        for (plan, ph), g in st.groupby(["plan", "phase"], sort=False):
            per = g.groupby("stage")[["fwd_ms", "bwd_ms"]].median().sort_index()
            m = run.microbatches
            sim = simulate(
                per["fwd_ms"] / m, per["bwd_ms"] / m, schedule=run.schedule, microbatches=m
            )
            by_step = g.groupby("step").agg(
                busy=("fwd_ms", "sum"), b=("bwd_ms", "sum"), step_ms=("step_ms", "first")
            )
            n = len(per)
            measured = 1.0 - (by_step["busy"] + by_step["b"]) / (n * by_step["step_ms"])
            rows.append(
                {
                    "source": run.name,
                    "plan": _plan_text(plan),
                    "phase": ph,
                    "schedule": run.schedule,
                    "microbatches": m,
                    "steps": len(by_step),
                    "simulated_bubble": sim.bubble,
                    "measured_bubble": float(measured.mean()),
                    "simulated_step_ms": sim.step_ms,
                    "measured_step_ms": float(by_step["step_ms"].median()),
                }
            )
    out = pd.DataFrame(rows, columns=_COLUMNS)
    if len(out):
        out["order"] = out["phase"].map(PHASES.index)
        out = out.sort_values(["source", "order"], kind="stable").drop(columns="order")
    return out.reset_index(drop=True)


def partition_bubbles(paths: Iterable[str | Path]) -> tuple[pd.DataFrame, list[str]]:
    """Rows for plan files (or folders of them) that carry predicted stage times, and a
    note for each file that was skipped and why."""
    from dynpipe.planner.plan import Plan
    from dynpipe.planner.simulate import simulate

    files: list[Path] = []
    for item in paths:
        p = Path(item)
        files.extend(sorted(p.glob("*.json")) if p.is_dir() else [p])
    rows, notes = [], []
    for f in files:
        try:
            plan = Plan.load(f)
        except (UserError, ValueError, KeyError, TypeError) as exc:
            notes.append(f"{f}: not a plan file ({str(exc).splitlines()[0][:120]})")
            continue
        if any(st.fwd_ms is None or st.bwd_ms is None for st in plan.stages):
            notes.append(f"{f}: plan has no predicted stage times (hand-made or even split)")
            continue
        comm = [st.comm_ms or 0.0 for st in plan.stages[:-1]]
        sim = simulate(
            [st.fwd_ms for st in plan.stages],
            [st.bwd_ms for st in plan.stages],
            comm_ms=comm,
            schedule=plan.schedule,
            microbatches=plan.microbatches,
        )
        rows.append(
            {
                "source": f"{f.stem} ({plan.model})",
                "plan": _plan_text(plan.bounds),
                "phase": "planned",
                "schedule": plan.schedule,
                "microbatches": plan.microbatches,
                "steps": 0,
                "simulated_bubble": sim.bubble,
                "measured_bubble": np.nan,
                "simulated_step_ms": sim.step_ms,
                "measured_step_ms": np.nan,
            }
        )
    return pd.DataFrame(rows, columns=_COLUMNS), notes


def plot_bubbles(
    table: pd.DataFrame,
    *,
    runs: Sequence[Run] = (),
    out: str | Path | None = None,
    name: str = "bubbles",
) -> Figure:
    """Horizontal bars per plan: simulated bubble fraction, and measured where a run ran it."""
    if table.empty:
        raise UserError(
            "no plan to simulate: give run logs with per-stage timings or plan files with "
            "predicted stage times (`dynpipe plan -o partitions/NAME.json`)"
        )
    labels = [
        f"{r.source}: {r.plan} ({r.phase}, {r.schedule} M={r.microbatches})"
        for r in table.itertuples()
    ]
    ys = np.arange(len(table))[::-1]
    fig = new_figure(width=10, height=2.2 + 0.5 * len(table))
    ax = fig.add_subplot()
    sim = table["simulated_bubble"].to_numpy(dtype=float)
    meas = table["measured_bubble"].to_numpy(dtype=float)
    both = bool(np.isfinite(meas).any())
    h = 0.38 if both else 0.6
    up = h / 2 if both else 0.0
    ax.barh(ys + up, sim, h, color="#4c72b0", label="simulated (event simulator)")
    for y, a in zip(ys, sim, strict=True):
        ax.text(a, y + up, f" {a:.0%}", va="center", fontsize=8)
    if both:
        ax.barh(
            ys - h / 2,
            np.nan_to_num(meas),
            h,
            color="#dd8452",
            label="measured (1 − Σ compute / (stages × step))",
        )
        for y, b in zip(ys, meas, strict=True):
            if np.isfinite(b):
                ax.text(b, y - h / 2, f" {b:.0%}", va="center", fontsize=8)
    ax.set_yticks(ys, labels, fontsize=8)
    ax.set_xlim(0, min(1.0, float(np.nanmax(np.r_[sim, meas])) * 1.25 + 0.05))
    ax.xaxis.set_major_formatter(lambda v, _pos: f"{v:.0%}")
    ax.set_xlabel("bubble fraction of the step (idle share of stage time)")
    ax.set_ylabel("run or plan file: layers per stage (phase, schedule)")
    title = describe(runs) if runs else "plan files"
    if runs and (table["phase"] == "planned").any():
        title += " and plan files"
    ax.set_title(f"Pipeline bubbles per plan: {title} (plan = layer ranges per stage)", fontsize=10)
    fig.legend(fontsize=8, loc="outside lower center", ncols=2)
    ax.grid(axis="x", alpha=0.3)
    save_figure(fig, out, name)
    return fig
