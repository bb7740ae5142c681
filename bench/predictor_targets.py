"""Check a leave-one-architecture-out report against issue 57's targets, per architecture.

    dynpipe predictor fit profiles/cpu-*.parquet -o P.json.gz --report DIR --splits model
    python bench/predictor_targets.py DIR/report.json

Targets (calibrated per layer, each architecture held out in turn): layer MAPE at most the
identical-layer floor + 3 points and at least 4 points below ``stage-mean``; stage MAPE at most
5 %; the 80 % interval holding 75-85 % of held-out measurements. Architectures without a class
of three identical layers have no floor; their floor check reads "–". Prints one line per
architecture and the overall verdict; exits 0 either way (this reports, it does not gate).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "report", help="report.json of `dynpipe predictor fit/eval` with --splits model"
    )
    ap.add_argument("--estimator", default="xgb", help="the learned estimator (default xgb)")
    args = ap.parse_args()
    summary = json.loads(Path(args.report).read_text())
    res = summary["results"].get("model")
    if not res:
        raise SystemExit(f"{args.report} has no model split; evaluate with --splits model")
    cal = res[f"{args.estimator}+measured"]
    base = res["stage-mean"]
    floor = summary.get("floor", {}).get("by_model", {})

    def mark(ok: bool | None) -> str:
        return "–" if ok is None else ("yes" if ok else "NO")

    print(
        f"{'held out':<14} {'layer %':>8} {'floor %':>8} {'<=fl+3':>7} {'stage-mean %':>12} "
        f"{'<=sm-4':>7} {'stage %':>8} {'<=5':>5} {'80% int':>8} {'75-85':>6}"
    )
    verdicts = []
    for model, v in cal["layer"]["by_model"].items():
        fl = floor.get(model, {}).get("mape")
        sm = base["layer"]["by_model"][model]["mape"]
        st = cal["stage"].get("by_model", {}).get(model, {}).get("mape")
        cov = v.get("coverage")
        checks = (
            None if fl is None else v["mape"] <= fl + 3,
            v["mape"] <= sm - 4,
            None if st is None else st <= 5,
            None if cov is None else 0.75 <= cov <= 0.85,
        )
        verdicts.extend(c for c in checks if c is not None)
        print(
            f"{model:<14} {v['mape']:8.1f} {fl if fl is not None else float('nan'):8.1f} "
            f"{mark(checks[0]):>7} {sm:12.1f} {mark(checks[1]):>7} "
            f"{st if st is not None else float('nan'):8.1f} {mark(checks[2]):>5} "
            f"{100 * cov if cov is not None else float('nan'):7.0f}% {mark(checks[3]):>6}"
        )
    la, cov = cal["layer"]["all"], cal["layer"]["all"].get("coverage")
    print(
        f"{'all':<14} {la['mape']:8.1f} {'':>8} {'':>7} {base['layer']['all']['mape']:12.1f} "
        f"{'':>7} {cal['stage']['all']['mape']:8.1f} {'':>5} "
        f"{100 * cov if cov is not None else float('nan'):7.0f}%"
    )
    print(f"checks met: {sum(verdicts)} of {len(verdicts)}")


if __name__ == "__main__":
    main()
