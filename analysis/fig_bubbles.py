"""Pipeline bubble fraction per plan: event simulator vs measurement, and planned splits.

    python analysis/fig_bubbles.py
    python analysis/fig_bubbles.py --partitions partitions/

For each experiment under analysis/logs/ it writes analysis/figures/<experiment>/bubbles.{png,pdf}:
every plan a run trained under (per phase), simulated by dynpipe.planner.simulate with the
stage times the run measured, beside the bubble the run measured. Plan files in partitions/
that carry the planner's predicted stage times go to analysis/figures/bubbles_partitions.{png,pdf}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dynpipe.analysis.bubbles import partition_bubbles, plot_bubbles, run_bubbles
from dynpipe.analysis.logs import group_experiments, load_runs
from dynpipe.errors import UserError
from dynpipe.runtime.records import glob_logs

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logs", type=Path, default=HERE / "logs", help="folder of experiments")
    p.add_argument("--partitions", type=Path, default=HERE.parent / "partitions")
    p.add_argument("--out", type=Path, default=HERE / "figures", help="folder for figures")
    p.add_argument("--warmup", type=int, default=2, help="first steps of a run left out")
    args = p.parse_args(argv)
    drew = False
    try:
        if args.logs.is_dir() and glob_logs(args.logs):
            for name, paths in group_experiments(args.logs).items():
                runs = load_runs(paths)
                plot_bubbles(run_bubbles(runs, warmup=args.warmup), runs=runs, out=args.out / name)
                print(args.out / name / "bubbles.png")
                drew = True
        if args.partitions.is_dir():
            table, notes = partition_bubbles([args.partitions])
            for note in notes:
                print(f"skipped {note}")
            if len(table):
                plot_bubbles(table, out=args.out, name="bubbles_partitions")
                print(args.out / "bubbles_partitions.png")
                drew = True
        if not drew:
            raise UserError(
                f"no run logs under {args.logs} and no plan with predicted stage times in "
                f"{args.partitions}; make one with `dynpipe plan -o partitions/NAME.json`"
            )
    except UserError as exc:
        print(f"fig_bubbles: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
