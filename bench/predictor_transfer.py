"""A shipped predictor on profiles it was not trained on, no refit: the tables of a report.

    python bench/predictor_transfer.py predictor/h200q.json.gz \\
        profiles/h100q-bs64.parquet profiles/h100q-bs128.parquet \\
        -o predictor/h100q_report/h200_transfer/h200q

Scores the saved predictor as it is (``xgb``: alone time x predicted slowdown) and calibrated
the way the runtime and ``predictor fit --report`` calibrate it (``xgb+measured``: per run and
per balanced 2/4-stage split, the prediction rescaled so the stage the device holds matches
its measured time, every layer of the other stages scored), beside ``stage-mean`` and
``none`` and the identical-layer floor, with the same code as the cross-validated reports
(``dynpipe.predictor.crossval``, ``dynpipe.predictor.report``). Nothing is fitted: every
condition of the data is unseen by the predictor, so "held-out condition" rows are simply the
rows of that condition.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from dynpipe.predictor.crossval import (
    Evaluation,
    _empty_stages,
    _floor,
    _layer_frame,
    _measured_frames,
    _summarise,
    data_summary,
)
from dynpipe.predictor.io import dataset_fingerprint, load_predictor
from dynpipe.predictor.report import plot_pred_vs_measured, render_markdown
from dynpipe.predictor.stages import assign_stages, stage_sums
from dynpipe.profiler.schema import load_profiles


def _scored(df: pd.DataFrame, pred_ms: np.ndarray, stage_ids: dict, name: str):
    lay = _layer_frame(df, pred_ms, split="condition", estimator=name)
    parts = [
        stage_sums(df, stage=sid, predicted_ms=pred_ms).assign(n_stages=s)
        for s, sid in stage_ids.items()
    ]
    stg = pd.concat(parts, ignore_index=True) if parts else _empty_stages()
    return lay, stg.assign(split="condition", estimator=name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("predictor")
    ap.add_argument("profiles", nargs="+")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args(argv)

    pred = load_predictor(args.predictor)
    df = load_profiles(args.profiles).reset_index(drop=True)
    stage_ids = {s: assign_stages(df, n_stages=s) for s in (2, 4)}
    stage_ids = {s: sid for s, sid in stage_ids.items() if (sid >= 0).any()}
    name = pred.estimator_name

    shipped = pred.predict_time_ms(df)
    frames = {
        name: _scored(df, shipped, stage_ids, name),
        f"{name}+measured": tuple(
            f.assign(split="condition", estimator=f"{name}+measured")
            for f in _measured_frames(df, stage_ids, base_ms=shipped)
        ),
        "stage-mean": tuple(
            f.assign(split="condition", estimator="stage-mean")
            for f in _measured_frames(df, stage_ids)
        ),
        "none": _scored(df, df["time_alone_ms"].to_numpy(dtype=np.float64), stage_ids, "none"),
    }
    results = {"condition": {k: _summarise(lay, stg) for k, (lay, stg) in frames.items()}}
    layers = pd.concat([f[0] for f in frames.values()], ignore_index=True)
    stages = pd.concat([f[1] for f in frames.values()], ignore_index=True)
    conditions = sorted(map(str, df["condition"].unique()))
    summary = {
        "data": data_summary(df, pred.schema),
        "splits": {
            "condition": {
                "n_folds": 1,
                "scheme": "shipped predictor, no refit",
                "held_out": [c for c in conditions if c != "none"],
            }
        },
        "n_stages": sorted(stage_ids),
        "estimators": {},
        "tuned": [],
        "calibrated": [f"{name}+measured"],
        "results": results,
        "floor": _floor(df, layers),
        "fingerprint": dataset_fingerprint(df),
        "predictor": {
            "path": str(args.predictor),
            "trained_on": pred.data_fingerprint,
            "profiles": [str(p) for p in args.profiles],
        },
    }
    ev = Evaluation(summary=summary, layers=layers, stages=stages)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    plot_pred_vs_measured(ev, out / "pred_vs_measured.png", primary=name, split="condition")
    (out / "report.json").write_text(json.dumps(summary, indent=1) + "\n")
    md = render_markdown(summary, primary=name, figure="pred_vs_measured.png")
    md = (
        md.replace(
            "# Slowdown predictor accuracy",
            f"# `{args.predictor}` on {', '.join(f'`{p}`' for p in args.profiles)}, no refit",
            1,
        )
        .replace(
            "## Held-out interference conditions (shipped predictor, no refit, 1 folds)",
            "## Every interference condition (shipped predictor, no refit: none was seen in training)",
        )
        .replace("held-out interference conditions", "every condition, no refit")
    )
    (out / "report.md").write_text(md)
    for split, res in results.items():
        for k, r in res.items():
            la, st = r["layer"]["all"], r["stage"]["all"]
            print(f"{split} {k:<14} layer MAPE {la['mape']}%  stage MAPE {st['mape']}%")
    print(f"report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
