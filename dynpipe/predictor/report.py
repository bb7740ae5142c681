"""Accuracy report of an ``Evaluation``: JSON, markdown and a predicted-vs-measured figure.

Everything here is drawn from the out-of-fold predictions in the ``Evaluation`` (also written
as parquet beside the report), never from edited numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from dynpipe.predictor.crossval import Evaluation

__all__ = [
    "SPLIT_TITLES",
    "held_out_architectures",
    "plot_pred_vs_measured",
    "render_markdown",
    "write_report",
]

SPLIT_TITLES = {
    "condition": "Held-out interference conditions",
    "model": "Held-out models",
    "interferer": "Held-out interferer kinds (extrapolation)",
    "device": "Held-out devices",
}


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def render_markdown(summary: dict, *, primary: str, figure: str | None = None) -> str:
    """The report as markdown; ``primary`` names the estimator broken down by kind."""
    data = summary["data"]
    lines = [
        "# Slowdown predictor accuracy",
        "",
        f"Data: {data['rows']} rows ({data['interfered_rows']} under interference); "
        f"devices: {', '.join(data['devices'])}; models: {', '.join(data['models'])}; "
        f"{len(data['conditions'])} conditions.",
    ]
    if summary.get("fingerprint"):
        lines.append(f"Dataset fingerprint: `{summary['fingerprint']}`.")
    lines += [
        "",
        "Error = |predicted − measured| / measured time, on interfered rows only (condition "
        "`none` is exact by construction). *Layer*: one error per (layer, phase, run), predicted "
        "time = alone time × predicted slowdown. *Stage*: one error per stage of the balanced "
        f"{'/'.join(map(str, summary['n_stages']))}-stage splits of each model (forward + "
        "backward summed). `stage-mean` applies the slowdown measured on the stage a device "
        "runs now to all layers; it is scored only on the *other* layers and stages (on its "
        "own stage it is exact). `<name>+measured` is the learned model rescaled per device so "
        "that the stage it runs now matches its measured time (what the run time does with "
        "both), scored like `stage-mean`. Hyper-parameters: "
        + (
            f"chosen by nested grouped CV for {', '.join(summary['tuned'])}."
            if summary["tuned"]
            else "fixed (no tuning on any fold)."
        ),
        "",
    ]
    skipped = [s for s, info in summary["splits"].items() if "skipped" in info]
    if skipped:
        lines += [f"Not possible on this data (fewer than two groups): {', '.join(skipped)}.", ""]
    for split, res in summary["results"].items():
        info = summary["splits"][split]
        scheme = info.get("scheme", "")
        lines += [f"## {SPLIT_TITLES.get(split, split)} ({scheme}, {info['n_folds']} folds)", ""]
        rows = []
        for name, r in res.items():
            la, st = r["layer"]["all"], r["stage"]["all"]
            rows.append(
                [
                    f"**{name}**" if name == primary else name,
                    _pct(la["mape"]),
                    _pct(la["p90"]),
                    _pct(st["mape"]),
                    _pct(st["p90"]),
                    str(la["n"]),
                    str(st["n"]),
                ]
            )
        for row, r in zip(rows, res.values(), strict=True):
            row.append(_cov(r["layer"]["all"]))
        lines += _table(
            [
                "estimator",
                "layer MAPE %",
                "layer p90 %",
                "stage MAPE %",
                "stage p90 %",
                "layers",
                "stages",
                "80% interval holds",
            ],
            rows,
        )
        lines.append("")
        if split == "model":
            lines += held_out_architectures(summary, primary=primary)
    for split in ("condition", "model"):
        res = summary["results"].get(split, {}).get(primary)
        if res is None:
            continue
        title = SPLIT_TITLES[split].lower()
        lines += [f"### {primary}, {title}: by layer kind", ""]
        lines += _table(
            ["kind", "n", "MAPE %", "p90 %"],
            [
                [k, str(v["n"]), _pct(v["mape"]), _pct(v["p90"])]
                for k, v in res["layer"]["by_kind"].items()
            ],
        )
        lines += ["", f"### {primary}, {title}: by interferer", ""]
        stage_by = res["stage"]["by_interferer"]
        lines += _table(
            ["interferer", "layers", "layer MAPE %", "layer p90 %", "stage MAPE %", "stage p90 %"],
            [
                [
                    k,
                    str(v["n"]),
                    _pct(v["mape"]),
                    _pct(v["p90"]),
                    _pct(stage_by.get(k, {}).get("mape")),
                    _pct(stage_by.get(k, {}).get("p90")),
                ]
                for k, v in res["layer"]["by_interferer"].items()
            ],
        )
        lines.append("")
    lines += _calibrated_section(summary, primary=primary)
    lines += _floor_section(summary, primary=primary)
    if figure:
        lines += [f"![predicted vs measured]({figure})", ""]
    return "\n".join(lines)


def _cov(entry: dict) -> str:
    c = entry.get("coverage")
    return "–" if c is None else f"{100 * c:.0f}%"


def held_out_architectures(summary: dict, *, primary: str) -> list[str]:
    """The leave-one-architecture-out tables: per held-out architecture, the calibrated
    prediction beside ``stage-mean``, ``none`` and the identical-layer floor, with the
    interval's coverage; then per interferer kind and per layer kind."""
    res = summary["results"].get("model", {})
    cal_name = f"{primary}+measured"
    cal, base, none = res.get(cal_name), res.get("stage-mean"), res.get("none")
    if cal is None:
        return []
    floor = (summary.get("floor") or {}).get("by_model", {})

    def get(r: dict | None, part: str, by: str, key: str) -> dict:
        return ((r or {}).get(part, {}).get(by, {}) or {}).get(key, {})

    rows = []
    for model, v in cal["layer"].get("by_model", {}).items():
        fl = floor.get(model, {}).get("mape")
        rows.append(
            [
                model,
                str(v["n"]),
                f"**{_pct(v['mape'])}**",
                _pct(get(base, "layer", "by_model", model).get("mape")),
                _pct(get(none, "layer", "by_model", model).get("mape")),
                _pct(fl),
                _pct(get(cal, "stage", "by_model", model).get("mape")),
                _pct(get(base, "stage", "by_model", model).get("mape")),
                _cov(v),
            ]
        )
    la, st = cal["layer"]["all"], cal["stage"]["all"]
    fl_all = (summary.get("floor") or {}).get("sibling", {}).get("mape")
    rows.append(
        [
            "**all**",
            str(la["n"]),
            f"**{_pct(la['mape'])}**",
            _pct((base or {}).get("layer", {}).get("all", {}).get("mape")),
            _pct((none or {}).get("layer", {}).get("all", {}).get("mape")),
            _pct(fl_all),
            _pct(st["mape"]),
            _pct((base or {}).get("stage", {}).get("all", {}).get("mape")),
            _cov(la),
        ]
    )
    out = [
        f"### Per held-out architecture ({cal_name})",
        "",
        "Each row is an architecture the predictor was not fitted on (its whole family of "
        "runs held out). Layer and stage errors as in the calibrated tables below; `none`: no "
        "slowdown; floor: identical layers of that architecture predicted from their siblings "
        "(– where it has no class of three identical layers); interval: share of its "
        "measurements inside the predicted central 80% interval.",
        "",
        *_table(
            [
                "held out",
                "layers",
                f"{cal_name} %",
                "stage-mean %",
                "none %",
                "floor %",
                "stage: calibrated %",
                "stage: stage-mean %",
                "80% interval holds",
            ],
            rows,
        ),
        "",
    ]
    for by, title in (("interferer", "interferer kind"), ("kind", "layer kind (label)")):
        rows = []
        for key, v in cal["layer"].get(f"by_{by}", {}).items():
            rows.append(
                [
                    key,
                    str(v["n"]),
                    _pct(v["mape"]),
                    _pct(get(base, "layer", f"by_{by}", key).get("mape")),
                    _pct(get(none, "layer", f"by_{by}", key).get("mape")),
                    _cov(v),
                ]
            )
        out += [
            f"### Held-out architectures, by {title}",
            "",
            *_table(
                [title, "layers", f"{cal_name} %", "stage-mean %", "none %", "80% interval"],
                rows,
            ),
            "",
        ]
    return out


def _calibrated_section(summary: dict, *, primary: str) -> list[str]:
    """Per held-out condition: the learned model calibrated on the stage a device holds and
    scored on the layers of its other stages, beside measurement alone (``stage-mean``)."""
    res = summary["results"].get("condition", {})
    cal, base = res.get(f"{primary}+measured"), res.get("stage-mean")
    if cal is None:
        return []
    names = [f"{primary}+measured"] + (["stage-mean"] if base else [])
    out = [
        f"## Calibrated per-layer accuracy, by held-out condition ({primary}+measured)",
        "",
        "Folds as in the held-out conditions table. Per run and per balanced split, the "
        "device holds one stage, the prediction is scaled so that stage's layers sum to what "
        "they measure (the runtime's rule), and every layer of the other stages is scored (one "
        "error per layer, phase, split and held stage). `stage-mean` scales every layer alike.",
        "",
    ]
    for by, title in (("condition", "condition"), ("model", "model"), ("phase", "phase")):
        rows = []
        for key, v in cal["layer"].get(f"by_{by}", {}).items():
            row = [key, str(v["n"]), _pct(v["mape"]), _pct(v["p90"])]
            if base:
                row.append(_pct(base["layer"].get(f"by_{by}", {}).get(key, {}).get("mape")))
            rows.append(row)
        la = cal["layer"]["all"]
        row = ["**all**", str(la["n"]), f"**{_pct(la['mape'])}**", _pct(la["p90"])]
        if base:
            row.append(_pct(base["layer"]["all"]["mape"]))
        rows.append(row)
        header = [title, "layers", f"{names[0]} MAPE %", "p90 %"]
        if base:
            header.append("stage-mean MAPE %")
        out += [*_table(header, rows), ""]
    return out


def _floor_section(summary: dict, *, primary: str) -> list[str]:
    floor = summary.get("floor") or {}
    if not floor.get("rows"):
        return []
    out = [
        "## Measurement floor: identical layers in one window",
        "",
        f"{floor['rows']} interfered rows belong to classes of three or more identical layers "
        "(same model, kind, FLOPs and bytes; measured in one window). Predicting each from its "
        "siblings' measured times is as well as a per-layer predictor can do there; the "
        "estimators' errors on the same rows are beside it (held-out conditions).",
        "",
    ]
    models = list(floor["by_model"])
    est = floor.get("estimators", {}).get("condition", {})
    names = [n for n in (f"{primary}+measured", "stage-mean", primary) if n in est]
    rows = [
        ["siblings (floor)", _pct(floor["sibling"]["mape"])]
        + [_pct(floor["by_model"][m]["mape"]) for m in models]
    ]
    for n in names:
        rows.append(
            [n, _pct(est[n]["all"]["mape"])]
            + [_pct(est[n]["by_model"].get(m, {}).get("mape")) for m in models]
        )
    out += [*_table(["predictor", "MAPE %", *(f"{m} %" for m in models)], rows), ""]
    return out


def plot_pred_vs_measured(
    ev: Evaluation, path: str | Path, *, primary: str, split: str = "condition"
) -> Path:
    """Log-log scatter of predicted vs measured time: the primary estimator per layer and
    per stage, then per stage its measurement-rescaled variant and stage-mean, where scored."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, pd.DataFrame]] = []
    for name, frame, what in (
        (primary, ev.layers, "layers"),
        (primary, ev.stages, "stages"),
        (f"{primary}+measured", ev.stages, "stages"),
        ("stage-mean", ev.stages, "stages"),
    ):
        sel = frame[(frame["split"] == split) & (frame["estimator"] == name)]
        sel = sel[(sel["interferer"] != "none") & np.isfinite(sel["predicted_ms"])]
        if len(sel):
            panels.append((f"{name}: {what}", sel))
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5 * max(1, len(panels)), 4.6))
    axes = np.atleast_1d(axes)
    kinds = sorted(set().union(*(set(p["interferer"]) for _, p in panels))) if panels else []
    colors = {k: plt.cm.tab10(i % 10) for i, k in enumerate(kinds)}
    for ax, (title, sel) in zip(axes, panels, strict=False):
        for k, g in sel.groupby("interferer"):
            ax.scatter(
                g["measured_ms"], g["predicted_ms"], s=6, alpha=0.5, color=colors[k], label=k
            )
        lo = float(min(sel["measured_ms"].min(), sel["predicted_ms"].min()))
        hi = float(max(sel["measured_ms"].max(), sel["predicted_ms"].max()))
        xs = np.geomspace(max(lo, 1e-6), hi, 50)
        ax.plot(xs, xs, "k-", lw=0.8)
        ax.fill_between(xs, xs * 0.9, xs * 1.1, color="k", alpha=0.08, label="±10%")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ape = 100 * np.abs(sel["predicted_ms"] - sel["measured_ms"]) / sel["measured_ms"]
        ax.set_title(f"{title} (MAPE {ape.mean():.1f}%)", fontsize=10)
        ax.set_xlabel("measured time (ms)")
        ax.set_ylabel("predicted time (ms)")
    if panels:
        axes[0].legend(fontsize=7, markerscale=2, loc="upper left")
    fig.suptitle(f"{SPLIT_TITLES.get(split, split)}: out-of-fold predictions", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(ev: Evaluation, out_dir: str | Path, *, primary: str) -> dict[str, Path]:
    """Write report.json, report.md, pred_vs_measured.png and the raw predictions."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out / "report.json",
        "markdown": out / "report.md",
        "figure": out / "pred_vs_measured.png",
        "layers": out / "predictions_layers.parquet",
        "stages": out / "predictions_stages.parquet",
    }
    split = (
        "condition" if "condition" in ev.summary["results"] else next(iter(ev.summary["results"]))
    )
    plot_pred_vs_measured(ev, paths["figure"], primary=primary, split=split)
    paths["json"].write_text(json.dumps(ev.summary, indent=1, sort_keys=False) + "\n")
    paths["markdown"].write_text(
        render_markdown(ev.summary, primary=primary, figure=paths["figure"].name)
    )
    ev.layers.to_parquet(paths["layers"], index=False)
    ev.stages.to_parquet(paths["stages"], index=False)
    return paths
