"""Per-stage busy fraction, (forward + backward) / step time, over steps, per experiment.

    python analysis/fig_busy.py
    python analysis/fig_busy.py --logs analysis/logs/gpu

Reads analysis/logs/<experiment>/*.jsonl.gz and writes
analysis/figures/<experiment>/busy_fraction.{png,pdf}: one panel per run, one line per stage.
A stage far below the others waits on its neighbours: the pipeline is unbalanced.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dynpipe.analysis.logs import group_experiments, load_runs
from dynpipe.analysis.timeline import plot_busy_fraction
from dynpipe.errors import UserError

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logs", type=Path, default=HERE / "logs", help="folder of experiments")
    p.add_argument("--out", type=Path, default=HERE / "figures", help="folder for figures")
    p.add_argument("--smooth", type=int, default=5, help="steps in the rolling mean")
    args = p.parse_args(argv)
    try:
        for name, paths in group_experiments(args.logs).items():
            plot_busy_fraction(load_runs(paths), out=args.out / name, smooth=args.smooth)
            print(args.out / name / "busy_fraction.png")
    except UserError as exc:
        print(f"fig_busy: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
