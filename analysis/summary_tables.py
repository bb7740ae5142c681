"""The numbers behind the figures, per experiment: one markdown summary per experiment.

    python analysis/summary_tables.py
    python analysis/summary_tables.py --logs /path/to/bench/OUTDIR --target-loss 2.0

Reads every experiment's raw run logs (analysis/logs/<experiment>/*.jsonl.gz, or the flat
<experiment>-<system>.jsonl files bench/gpu_adapt.sh writes) and writes
analysis/figures/<experiment>/summary.md: per run, end-to-end samples/s, speed-up over the
static run, time to the target loss, repartitions, bytes moved and pauses; per run and phase,
mean step time and samples/s; every repartition and restart with its cost.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dynpipe.analysis.logs import group_experiments, load_runs
from dynpipe.analysis.summary import write_summary
from dynpipe.errors import UserError

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logs", type=Path, default=HERE / "logs", help="folder of experiments")
    p.add_argument("--out", type=Path, default=HERE / "figures", help="folder for the tables")
    p.add_argument("--target-loss", type=float, default=None, help="loss to reach")
    p.add_argument("--warmup", type=int, default=2, help="first steps of a run left out")
    p.add_argument("--print", action="store_true", help="also print each table")
    args = p.parse_args(argv)
    try:
        for name, paths in group_experiments(args.logs).items():
            path = write_summary(
                load_runs(paths),
                args.out / name / "summary.md",
                target=args.target_loss,
                warmup=args.warmup,
            )
            print(path)
            if args.print:
                print(path.read_text())
    except UserError as exc:
        print(f"summary_tables: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
