"""A markdown summary of profile datasets: how much each kind of interference slows which layers.

    dynpipe profile summary profiles/*.parquet

Per device it reports the baseline noise, the slowdown per condition with the telemetry
seen, the slowdown per layer kind and interferer kind, memory-bound against compute-bound
layers (split at the median arithmetic intensity) under each interferer at matched
intensity, and how well each telemetry column ranks the slowdowns (Spearman).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from dynpipe.devices.columns import TELEMETRY_COLUMNS
from dynpipe.profiler.conditions import NONE
from dynpipe.profiler.schema import META_KEY

__all__ = ["memory_vs_compute", "summarize"]

# Which interferer stresses memory bandwidth and which compute, per device type.
_MEMORY_KIND = {"cuda": "copy", "cpu": "membw"}
_COMPUTE_KIND = {"cuda": "gemm", "cpu": "spin"}


def _fmt(x: Any, digits: int = 2) -> str:
    if isinstance(x, str):
        return x
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _q(s: Any, q: float) -> float:
    return float(s.quantile(q)) if len(s) else math.nan


def memory_vs_compute(df: Any) -> Any:
    """Median slowdown of low- vs high-arithmetic-intensity layers per condition.

    Layers are split at the median ``arith_intensity`` of the device's rows (phase by
    phase pooled): below it a layer moves many bytes per FLOP (memory-bound), above it few.
    Returns a frame indexed by condition with ``memory_bound``, ``compute_bound`` and their
    ratio, plus ``interferer``, ``intensity`` and ``n_jobs``.
    """
    import pandas as pd

    rows = df[(df["condition"] != NONE) & df["slowdown"].notna()]
    if rows.empty:
        return pd.DataFrame(
            columns=["interferer", "intensity", "n_jobs", "memory_bound", "compute_bound", "ratio"]
        )
    cut = float(df["arith_intensity"].median())
    mem = rows["arith_intensity"] <= cut
    g = rows.assign(bound=mem.map({True: "memory_bound", False: "compute_bound"}))
    tab = g.pivot_table(index="condition", columns="bound", values="slowdown", aggfunc="median")
    for col in ("memory_bound", "compute_bound"):
        if col not in tab:
            tab[col] = math.nan
    info = rows.groupby("condition")[["interferer", "intensity", "n_jobs"]].first()
    out = info.join(tab[["memory_bound", "compute_bound"]])
    out["ratio"] = out["memory_bound"] / out["compute_bound"]
    out.attrs["cut"] = cut
    return out.sort_values(["interferer", "n_jobs", "intensity"])


def _spearman(x: Any, y: Any) -> float:
    ok = x.notna() & y.notna()
    if ok.sum() < 5 or x[ok].nunique() < 2 or y[ok].nunique() < 2:
        return math.nan
    return float(x[ok].rank().corr(y[ok].rank()))


def _device_section(df: Any, device: str) -> list[str]:
    out = [f"## {device}", ""]
    dtype = str(df["device_type"].iloc[0])
    models = ", ".join(
        f"{m} ({df[df['model'] == m]['layer'].nunique()} layers, batch "
        f"{'/'.join(map(str, sorted(df[df['model'] == m]['batch_size'].unique())))})"
        for m in sorted(df["model"].unique())
    )
    out += [f"{len(df)} rows; models: {models}; {df['condition'].nunique()} conditions.", ""]

    base = df[df["condition"] == NONE]
    if not base.empty:
        spread = (base["time_p90_ms"] / base["time_p10_ms"]).median()
        out += [
            f"Baseline noise: median p90/p10 spread of the timing samples under `none` is "
            f"{spread:.3f}; slowdowns closer to 1 than that are not resolved.",
            "",
        ]

    hit = df[(df["condition"] != NONE) & df["slowdown"].notna()]
    if hit.empty:
        return [*out, "No interference conditions measured.", ""]

    out += ["### Slowdown per condition", ""]
    rows = []
    for cond, g in hit.groupby("condition"):
        s = g["slowdown"]
        rows.append(
            [
                cond,
                str(g["interferer"].iloc[0]),
                float(g["intensity"].iloc[0]),
                int(g["n_jobs"].iloc[0]),
                float(s.median()),
                _q(s, 0.1),
                _q(s, 0.9),
                float(s.max()),
                float(g["tel_util"].mean()),
                float(g["tel_other_util"].mean()),
                float(g["tel_other_procs"].mean()),
            ]
        )
    rows.sort(key=lambda r: (r[1], r[3], r[2]))
    out += [
        _table(
            [
                "condition",
                "interferer",
                "intensity",
                "jobs",
                "median",
                "p10",
                "p90",
                "max",
                "tel_util",
                "tel_other_util",
                "tel_other_procs",
            ],
            rows,
        ),
        "",
    ]

    out += ["### Median slowdown by layer kind and interferer (p10–p90)", ""]
    kinds = sorted(hit["interferer"].unique())
    rows = []
    for lk, g in hit.groupby("kind"):
        row: list[Any] = [lk, int(g["layer"].nunique())]
        for k in kinds:
            s = g[g["interferer"] == k]["slowdown"]
            row.append(f"{s.median():.2f} ({_q(s, 0.1):.2f}–{_q(s, 0.9):.2f})" if len(s) else "–")
        rows.append(row)
    out += [_table(["layer kind", "layers", *kinds], rows), ""]

    mvc = memory_vs_compute(df)
    out += [
        "### Memory-bound vs compute-bound layers",
        "",
        f"Split at the median arithmetic intensity, {mvc.attrs.get('cut', math.nan):.1f} "
        "FLOP/byte: below it a layer is counted memory-bound.",
        "",
        _table(
            [
                "condition",
                "interferer",
                "intensity",
                "jobs",
                "memory-bound",
                "compute-bound",
                "ratio",
            ],
            [
                [
                    c,
                    r.interferer,
                    float(r.intensity),
                    int(r.n_jobs),
                    r.memory_bound,
                    r.compute_bound,
                    r.ratio,
                ]
                for c, r in mvc.iterrows()
            ],
        ),
        "",
    ]
    out += _answer(mvc, dtype)

    out += ["### Telemetry vs slowdown (Spearman rank correlation, interference rows)", ""]
    rows = [
        [col, _spearman(hit[col], hit["slowdown"]), float(hit[col].notna().mean())]
        for col in TELEMETRY_COLUMNS
    ]
    out += [_table(["column", "rho", "non-NaN share"], rows), ""]
    return out


def _answer(mvc: Any, dtype: str) -> list[str]:
    mk, ck = _MEMORY_KIND.get(dtype), _COMPUTE_KIND.get(dtype)

    # Single interferers on the profiler's own placement only: ids like ``copy@0.5x1``.
    def pick(kind: str) -> Any:
        sel = mvc[[bool(re.fullmatch(rf"{kind}@[0-9.]+x1", str(i))) for i in mvc.index]]
        return sel.set_index("intensity")

    m, c = pick(mk), pick(ck)
    common = sorted(set(m.index) & set(c.index))
    if not common:
        return [f"(No {mk} and {ck} conditions at a common intensity: cannot compare.)", ""]
    rows = [
        [
            i,
            float(m.loc[i, "memory_bound"]),
            float(c.loc[i, "memory_bound"]),
            float(m.loc[i, "compute_bound"]),
            float(c.loc[i, "compute_bound"]),
        ]
        for i in common
    ]
    n = len(rows)
    worse = sum(r[1] > r[2] for r in rows)  # memory-bound: slower beside mk than beside ck
    rel = sum(r[1] / r[2] > r[3] / r[4] for r in rows)  # ... relative to compute-bound layers
    top = rows[-1]
    return [
        f"Do memory-bound layers suffer more under `{mk}` than under `{ck}`? "
        f"**{'yes' if worse > n / 2 else 'no'}** — at {worse} of {n} matched intensities their "
        f"median slowdown beside {mk} exceeds the one beside {ck} (at intensity {top[0]:g}: "
        f"{top[1]:.2f} vs {top[2]:.2f}). Relative to compute-bound layers, {mk} hurts them "
        f"{'more' if rel > n / 2 else 'not more'}: the {mk}/{ck} slowdown ratio is larger for "
        f"memory-bound than for compute-bound layers at {rel} of {n} intensities.",
        "",
        _table(
            [
                "intensity",
                f"memory-bound under {mk}",
                f"memory-bound under {ck}",
                f"compute-bound under {mk}",
                f"compute-bound under {ck}",
            ],
            rows,
        ),
        "",
    ]


def summarize(df: Any) -> str:
    """Markdown report of one or more loaded datasets (see ``load_profiles``)."""
    lines = ["# Profile summary", ""]
    for meta in df.attrs.get(META_KEY, []):
        runs = meta.get("baseline_runs", [])
        drift_s = (
            "; baseline re-timed after "
            + ", ".join(f"{r['after']} (x{r['median_ratio']:.2f})" for r in runs)
            if runs
            else ""
        )
        lines.append(
            f"- `{meta.get('path', '?')}`: {meta.get('device_name')} ({meta.get('driver')}), "
            f"torch {meta.get('torch_version')}, {meta.get('date')}{drift_s}"
        )
    lines.append("")
    for device, g in df.groupby("device_name"):
        lines += _device_section(g, str(device))
    return "\n".join(lines).rstrip() + "\n"
