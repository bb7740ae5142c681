"""Step time over training steps, one line per system, for every experiment.

    python analysis/fig_step_time.py
    python analysis/fig_step_time.py --logs analysis/logs/gpu

Reads the raw run logs analysis/logs/<experiment>/*.jsonl.gz (one per system: static,
measured, adaptive, restart) and writes analysis/figures/<experiment>/step_time.{png,pdf}.
Shaded: interference on, from the logs' interference events; dashed: live repartitions;
dotted: restarts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dynpipe.analysis.logs import group_experiments, load_runs
from dynpipe.analysis.timeline import plot_step_time
from dynpipe.errors import UserError

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logs", type=Path, default=HERE / "logs", help="folder of experiments")
    p.add_argument("--out", type=Path, default=HERE / "figures", help="folder for figures")
    p.add_argument("--smooth", type=int, default=5, help="steps in the rolling median")
    args = p.parse_args(argv)
    try:
        experiments = group_experiments(args.logs)
        for name, paths in experiments.items():
            plot_step_time(load_runs(paths), out=args.out / name, smooth=args.smooth)
            print(args.out / name / "step_time.png")
    except UserError as exc:
        print(f"fig_step_time: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
