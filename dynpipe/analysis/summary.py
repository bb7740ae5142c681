"""``summary.md``: the numbers behind the figures, per run and phase, as markdown tables."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from dynpipe.analysis.logs import Run
from dynpipe.analysis.metrics import (
    choose_target,
    migration_costs,
    phase_stats,
    throughput,
    time_to_target,
)

__all__ = ["render_summary", "run_table", "write_summary"]


def _num(v: object, fmt: str) -> str:
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return "–"
    return format(v, fmt)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def run_table(
    runs: Sequence[Run], *, target: float | None = None, quantile: float = 0.1, smooth: int = 5
) -> pd.DataFrame:
    """Per run: end-to-end samples/s, speed-up over the static run of the same model,
    condition and world size, time to the target loss, total pause, repartitions and
    restarts."""
    if target is None:
        target = choose_target(runs, quantile=quantile, smooth=smooth)
    moves = migration_costs(runs)
    rows = []
    for r in runs:
        m = moves[moves["run"] == r.name]
        rows.append(
            {
                "run": r.name,
                "system": r.system,
                "model": r.model,
                "device": r.device,
                "condition": r.condition,
                "world_size": r.world_size,
                "steps": len(r.steps),
                "samples_per_s": throughput(r),
                "time_to_target_s": time_to_target(r, target, smooth=smooth),
                "target": target,
                "repartitions": int((m["kind"] == "repartition").sum()),
                "restarts": int((m["kind"] == "restart").sum()),
                "bytes": float(m["bytes"].fillna(0).sum()),
                "pause_ms": float(m["pause_ms"].fillna(0).sum()),
                "redone_steps": r.redone_steps,
            }
        )
    df = pd.DataFrame(rows)
    key = ["model", "condition", "world_size"]
    base = df[df["system"] == "static"].groupby(key)["samples_per_s"].mean()
    df["speedup"] = [
        row.samples_per_s / base[(row.model, row.condition, row.world_size)]
        if (row.model, row.condition, row.world_size) in base.index
        else np.nan
        for row in df.itertuples()
    ]
    return df


def render_summary(
    runs: Sequence[Run],
    *,
    target: float | None = None,
    quantile: float = 0.1,
    smooth: int = 5,
    warmup: int = 2,
    target_accuracy: float | None = None,
) -> str:
    per_run = run_table(runs, target=target, quantile=quantile, smooth=smooth)
    phases = pd.concat([phase_stats(r, warmup=warmup) for r in runs], ignore_index=True)
    tgt = float(per_run["target"].iloc[0])
    how = "given" if target is not None else f"the {quantile:.0%} quantile every run reaches"
    lines = ["# Run summary", "", "Drawn from these run logs:", ""]
    lines += [
        f"- `{_shown(r.path)}`: **{r.name}** ({r.mode}), {r.model} on {r.device}, "
        f"{r.num_stages} stages, {r.schedule} M={r.microbatches}, batch {r.batch_size}, "
        f"{len(r.steps)} steps, {r.condition}"
        for r in runs
    ]
    lines += [
        "",
        "## Per run",
        "",
        f"Samples/s end to end (pauses included). Time to target: wall seconds until the "
        f"trailing mean of {smooth} losses first reaches {tgt:.4g} ({how}).",
        "",
    ]
    lines += _table(
        [
            "run",
            "model",
            "condition",
            "samples/s",
            "vs static",
            "time to target (s)",
            "repartitions",
            "restarts",
            "moved (MiB)",
            "pause (ms)",
        ],
        [
            [
                r.run,
                r.model,
                r.condition,
                _num(r.samples_per_s, ".2f"),
                _num(r.speedup, ".2f"),
                _num(r.time_to_target_s, ".1f"),
                str(r.repartitions),
                str(r.restarts),
                _num(r.bytes / 2**20, ".2f"),
                _num(r.pause_ms, ".1f"),
            ]
            for r in per_run.itertuples()
        ],
    )
    lines += [
        "",
        "## Per run and phase",
        "",
        f"Phases come from the interference events in each log. Step statistics leave out "
        f"the first {warmup} steps of a run; samples/s here is batch × steps over summed "
        "step time (pauses are in the last column).",
        "",
    ]
    lines += _table(
        [
            "run",
            "phase",
            "condition",
            "steps",
            "mean step (ms)",
            "sd (ms)",
            "samples/s",
            "repartitions",
            "restarts",
            "moved (MiB)",
            "pause (ms)",
        ],
        [
            [
                r.run,
                r.phase,
                "–" if pd.isna(r.condition) else r.condition,
                str(r.steps),
                _num(r.mean_ms, ".2f"),
                _num(r.std_ms, ".2f"),
                _num(r.samples_per_s, ".2f"),
                str(r.repartitions),
                str(r.restarts),
                _num(r.bytes / 2**20, ".2f"),
                _num(r.pause_ms, ".1f"),
            ]
            for r in phases.itertuples()
        ],
    )
    lines += _accuracy_section(runs, target_accuracy=target_accuracy, target_loss=target)
    moves = migration_costs(runs)
    if len(moves):
        lines += [
            "",
            "## Repartitions and restarts",
            "",
            "Pause and its parts as the runtime logged them; wall gap: the time between the "
            "steps around the move, measured from the step records (pause plus the timing "
            "gather).",
            "",
        ]
        lines += _table(
            [
                "run",
                "kind",
                "step",
                "moved (MiB)",
                "decide (ms)",
                "transfer (ms)",
                "rebuild (ms)",
                "relaunch (ms)",
                "pause (ms)",
                "wall gap (ms)",
            ],
            [
                [
                    m.run,
                    m.kind,
                    str(m.step),
                    _num(m.bytes / 2**20, ".2f"),
                    _num(m.decide_ms, ".2f"),
                    _num(m.transfer_ms, ".2f"),
                    _num(m.rebuild_ms, ".2f"),
                    _num(m.relaunch_ms, ".1f"),
                    _num(m.pause_ms, ".2f"),
                    _num(m.gap_ms, ".1f"),
                ]
                for m in moves.itertuples()
            ],
        )
    return "\n".join(lines) + "\n"


def _accuracy_section(
    runs: Sequence[Run], *, target_accuracy: float | None, target_loss: float | None
) -> list[str]:
    """Time to the held-out target per run and its ratio to the static run (runs that
    logged evaluations only)."""
    from dynpipe.analysis.convergence import time_to_accuracy_table

    evaluated = [r for r in runs if not r.evals.empty]
    if not evaluated:
        return []
    table, tgt = time_to_accuracy_table(
        evaluated, target_accuracy=target_accuracy, target_loss=target_loss
    )
    final = "final accuracy" if tgt.metric == "accuracy" else "final eval loss"
    fmt = ".2%" if tgt.metric == "accuracy" else ".4f"
    lines = [
        "",
        "## Time to accuracy",
        "",
        f"Held-out evaluations (`eval` records). Target: {tgt}. Time: wall seconds from the "
        "run's start to its first evaluation at the target; vs static: the static run's time "
        "(same model, interference and GPU count) over this run's (> 1: sooner).",
        "",
    ]
    lines += _table(
        ["run", "model", "condition", "time to target (s)", "steps", "vs static", final],
        [
            [
                r.run,
                r.model,
                r.condition,
                _num(r.time_s, ".1f"),
                "–" if r.step is None or pd.isna(r.step) else str(int(r.step)),
                _num(r.vs_static, ".2f"),
                f"{_num(r.final, fmt)} (step {r.final_step})",
            ]
            for r in table.itertuples()
        ],
    )
    return lines


def write_summary(runs: Sequence[Run], path: str | Path, **kwargs: object) -> Path:
    """Write ``render_summary(runs, **kwargs)`` to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_summary(runs, **kwargs))  # type: ignore[arg-type]
    return path


def _shown(path: Path) -> str:
    """The log's path relative to the working folder when under it: summaries are committed."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
