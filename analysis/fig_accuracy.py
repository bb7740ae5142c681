"""Held-out accuracy (or eval loss) against wall time, and time to a target, per experiment.

    python analysis/fig_accuracy.py
    python analysis/fig_accuracy.py --logs analysis/logs/gpu --target-accuracy 0.7

Reads analysis/logs/<experiment>/*.jsonl.gz (runs trained with --eval-every N) and writes
analysis/figures/<experiment>/time_to_accuracy.{png,pdf}. Without a target, the target is
the best accuracy every run of the experiment reaches (or, for runs that log no accuracy,
the lowest eval loss every run reaches); the figure's title says which. Experiments whose
runs did not evaluate are skipped with a note.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dynpipe.analysis.convergence import plot_time_to_accuracy
from dynpipe.analysis.logs import group_experiments, load_runs
from dynpipe.errors import UserError

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logs", type=Path, default=HERE / "logs", help="folder of experiments")
    p.add_argument("--out", type=Path, default=HERE / "figures", help="folder for figures")
    p.add_argument("--target-accuracy", type=float, default=None, help="fraction, e.g. 0.7")
    p.add_argument("--target-loss", type=float, default=None, help="eval loss to reach")
    args = p.parse_args(argv)
    try:
        for name, paths in group_experiments(args.logs).items():
            runs = [r for r in load_runs(paths) if not r.evals.empty]
            if not runs:
                print(f"fig_accuracy: {name}: no eval records (train with --eval-every N)")
                continue
            plot_time_to_accuracy(
                runs,
                out=args.out / name,
                target_accuracy=args.target_accuracy,
                target_loss=args.target_loss,
            )
            print(args.out / name / "time_to_accuracy.png")
    except UserError as exc:
        print(f"fig_accuracy: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
