"""The demo's numbers and figures, from the two run logs only.

Phases come from the interference events in each log (``dynpipe.analysis.phases``): step
time is the median over a phase's steps, leaving out the first ``SETTLE`` steps of the run
and of the phase after the interference (the interferers winding down). Adaptation lag
counts: the adaptive run's "during" includes the steps before its first move.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

__all__ = ["SETTLE", "draw_figures", "format_report", "summarise"]

SETTLE = 5


def _phase_ms(steps: Any, phase: str, skip: int = 0) -> float | None:
    sel = steps[steps["phase"] == phase]
    vals = sel["step_ms"].iloc[skip:].tolist()
    return round(statistics.median(vals), 2) if vals else None


def _split(plan: dict) -> list[int]:
    return [st["stop"] - st["start"] for st in plan["stages"]]


def _run_summary(log: Path) -> dict[str, Any]:
    from dynpipe.analysis.logs import load_run

    run = load_run(log)
    steps = run.steps[run.steps["step"] >= SETTLE]
    ends = run.events_of("end")
    last_time = ends[-1].time if ends else float(run.steps["t_end"].iloc[-1])
    final = run.evals.iloc[-1] if not run.evals.empty else None
    reps = run.events_of("repartition")
    return {
        "log": str(log),
        "step_ms": {
            "before": _phase_ms(steps, "clean"),
            "during": _phase_ms(steps, "interference"),
            "after": _phase_ms(steps, "after", skip=SETTLE),
        },
        "wall_s": round(last_time - run.t0, 2),
        "final_eval": None
        if final is None
        else {
            "step": int(final["step"]),
            "accuracy": float(final["accuracy"]),
            "loss": float(final["loss"]),
        },
        "initial_split": _split(run.headers[0].plan),
        "final_split": _split(ends[-1]["plan"]) if ends else None,
        "repartitions": [
            {
                "step": int(e.step),
                "split": _split(e["new_plan"]),
                "bytes": int(e["bytes"]),
                "pause_ms": float(e["pause_ms"]),
            }
            for e in reps
        ],
        "window": [run.windows[0].start, run.windows[0].stop] if run.windows else None,
    }


def summarise(
    static_log: str | Path, adaptive_log: str | Path, *, launch_s: dict[str, float] | None = None
) -> dict[str, Any]:
    """Both runs' phases, moves, wall times and final evaluations, and how they compare."""
    runs = {"static": _run_summary(Path(static_log)), "adaptive": _run_summary(Path(adaptive_log))}
    for name, secs in (launch_s or {}).items():
        runs[name]["launch_s"] = round(secs, 2)
    st, ad = runs["static"], runs["adaptive"]
    onset, stop = st["window"] or [None, None]

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    moves = ad["repartitions"]
    after_ms, before_ms = ad["step_ms"]["after"], ad["step_ms"]["before"]
    return {
        "interference": {"start": onset, "stop": stop},
        "runs": runs,
        "static_slowdown": ratio(st["step_ms"]["during"], st["step_ms"]["before"]),
        # Each run against its own clean steps: other jobs on the cores can make one run's
        # every step slower than the other's, which this ratio does not see.
        "adaptive_slowdown": ratio(ad["step_ms"]["during"], ad["step_ms"]["before"]),
        "speedup_during": ratio(st["step_ms"]["during"], ad["step_ms"]["during"]),
        "moves_before_onset": [m for m in moves if onset is not None and m["step"] < onset],
        "moves_during": [m for m in moves if onset is not None and onset <= m["step"] < stop],
        "moves_after": [m for m in moves if stop is not None and m["step"] >= stop],
        "back_to_initial_plan": ad["final_split"] == ad["initial_split"],
        # The plan it ended on runs as fast after the interference as the first one did before
        # (the same run, earlier) and as the first one did after it (the static run).
        "after_vs_before": ratio(after_ms, before_ms),
        "after_vs_static": ratio(after_ms, st["step_ms"]["after"]),
        "same_final_accuracy": (
            st["final_eval"] is not None
            and ad["final_eval"] is not None
            and st["final_eval"]["accuracy"] == ad["final_eval"]["accuracy"]
        ),
    }


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}"


def format_report(s: dict[str, Any]) -> str:
    """What the demo prints: a table per phase, the speed-up, moves, wall times, accuracy."""
    st, ad = s["runs"]["static"], s["runs"]["adaptive"]
    on, off = s["interference"]["start"], s["interference"]["stop"]
    lines = [
        "",
        f"median step time (ms)      static   adaptive   (interference: steps {on}-{off - 1})"
        if on is not None
        else "median step time (ms)      static   adaptive   (no interference in the logs)",
    ]
    for key, label in (
        ("before", "before interference"),
        ("during", "during interference"),
        ("after", "after interference"),
    ):
        lines.append(f"  {label:<24} {_ms(st['step_ms'][key]):>6}   {_ms(ad['step_ms'][key]):>8}")
    slow, speed = s["static_slowdown"], s["speedup_during"]
    ad_slow = s["adaptive_slowdown"]
    lines += [
        f"interference slowed the static run {slow:.2f}x"
        + (
            f", the adaptive run {ad_slow:.2f}x (each against its own steps before)"
            if ad_slow
            else ""
        )
        if slow
        else "",
        f"adaptive over static during the interference: {speed:.2f}x "
        + ("faster" if speed >= 1 else "(slower)")
        if speed
        else "adaptive over static during the interference: –",
        f"adaptive moves: {len(ad['repartitions'])} "
        f"({len(s['moves_before_onset'])} before the onset, {len(s['moves_during'])} during, "
        f"{len(s['moves_after'])} after); split {ad['initial_split']} -> {ad['final_split']}",
    ]
    for m in ad["repartitions"]:
        lines.append(
            f"    step {m['step']}: split {m['split']}, {m['bytes']:,} bytes, "
            f"pause {m['pause_ms']:.0f} ms"
        )
    vs_static, vs_before = s["after_vs_static"], s["after_vs_before"]
    if vs_static and vs_before and ad["final_split"] != ad["initial_split"]:
        lines.append(
            f"after the interference the adaptive run's split {ad['final_split']} took "
            f"{vs_static:.2f}x the static run's step time on {ad['initial_split']} "
            f"({vs_before:.2f}x its own steps before the interference)"
        )
    lines.append(
        f"wall time (training, from the logs): static {st['wall_s']:.1f} s, adaptive "
        f"{ad['wall_s']:.1f} s"
    )
    fe_s, fe_a = st["final_eval"], ad["final_eval"]
    if fe_s and fe_a:
        same = "equal" if s["same_final_accuracy"] else "DIFFERENT"
        lines.append(
            f"final held-out accuracy (step {fe_s['step']}): static {fe_s['accuracy']:.2%}, "
            f"adaptive {fe_a['accuracy']:.2%} ({same}: the split does not change the math)"
        )
    lines.append(f"logs: {st['log']}, {ad['log']}")
    return "\n".join(line for line in lines if line)


def draw_figures(
    static_log: str | Path, adaptive_log: str | Path, *, out: str | Path
) -> list[Path]:
    """One step-time figure with both runs, and time to accuracy (PNG and PDF each)."""
    from dynpipe.analysis.convergence import plot_time_to_accuracy
    from dynpipe.analysis.logs import load_runs
    from dynpipe.analysis.style import save_figure
    from dynpipe.analysis.timeline import plot_step_time

    runs = load_runs(labels={"static": static_log, "adaptive": adaptive_log})
    out = Path(out)
    paths = save_figure(plot_step_time(runs), out, "step_time")
    if all(not r.evals.empty for r in runs):
        paths += save_figure(plot_time_to_accuracy(runs), out, "time_to_accuracy")
    return paths
