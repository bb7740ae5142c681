"""Slowdown predictor accuracy: predicted vs measured layer times and the error CDF.

    python analysis/fig_predictor.py
    python analysis/fig_predictor.py --report predictor/h200_report
    python analysis/fig_predictor.py --predictor predictor/h200.json.gz --profiles profiles/h200-bs64.parquet

Without arguments it draws every evaluation report under predictor/ (folders holding the
out-of-fold predictions_layers.parquet that `dynpipe predictor eval ... -o DIR` writes) into
analysis/figures/predictor_<report>.{png,pdf}. With --predictor it runs that saved predictor
on the given profile datasets instead (the title says when those trained it: in-sample).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dynpipe.analysis.accuracy import (
    plot_predictor,
    predictions_from_predictor,
    predictions_from_report,
)
from dynpipe.errors import UserError

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", type=Path, nargs="*", default=None, help="report folders")
    p.add_argument(
        "--predictor", type=Path, default=None, help="a saved predictor (.json or .json.gz)"
    )
    p.add_argument("--profiles", type=Path, nargs="*", default=[], help="profile datasets")
    p.add_argument("--out", type=Path, default=HERE / "figures", help="folder for figures")
    args = p.parse_args(argv)
    try:
        if args.predictor is not None:
            preds = predictions_from_predictor(args.predictor, profiles=args.profiles)
            name = f"predictor_{args.predictor.stem}"
            plot_predictor(preds, out=args.out, name=name)
            print(args.out / f"{name}.png")
            return 0
        reports = args.report
        if reports is None:
            found = (HERE.parent / "predictor").rglob("predictions_layers.parquet")
            reports = sorted(f.parent for f in found)
        if not reports:
            raise UserError(
                "no predictor evaluation report under predictor/; write one with "
                "`dynpipe predictor eval PREDICTOR PROFILES -o predictor/NAME_report`"
            )
        for folder in reports:
            name = f"predictor_{folder.name}"
            plot_predictor(predictions_from_report(folder), out=args.out, name=name)
            print(args.out / f"{name}.png")
    except UserError as exc:
        print(f"fig_predictor: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
