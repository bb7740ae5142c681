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

from dynpipe.predictor.crossval import evaluate_shipped
from dynpipe.predictor.io import dataset_fingerprint, load_predictor
from dynpipe.predictor.report import plot_pred_vs_measured, render_markdown
from dynpipe.profiler.schema import load_profiles


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("predictor")
    ap.add_argument("profiles", nargs="+")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args(argv)

    pred = load_predictor(args.predictor)
    df = load_profiles(args.profiles).reset_index(drop=True)
    name = pred.estimator_name
    ev = evaluate_shipped(df, pred.predict_time_ms(df), schema=pred.schema, name=name)
    summary = {
        **ev.summary,
        "fingerprint": dataset_fingerprint(df),
        "predictor": {
            "path": str(args.predictor),
            "trained_on": pred.data_fingerprint,
            "profiles": [str(p) for p in args.profiles],
        },
    }
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
    for split, res in summary["results"].items():
        for k, r in res.items():
            la, st = r["layer"]["all"], r["stage"]["all"]
            print(f"{split} {k:<14} layer MAPE {la['mape']}%  stage MAPE {st['mape']}%")
    print(f"report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
