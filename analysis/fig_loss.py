"""Training loss against wall time per system, with time to a target loss, per experiment.

    python analysis/fig_loss.py
    python analysis/fig_loss.py --logs analysis/logs/gpu --target-loss 2.0

Reads analysis/logs/<experiment>/*.jsonl.gz and writes
analysis/figures/<experiment>/loss_time.{png,pdf}. Without --target-loss the target is the
largest of the runs' 10% loss quantiles (a loss every run reaches). All systems run the same
steps on the same data, so a system that spends less wall time per step, pauses included,
reaches the target sooner.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dynpipe.analysis.logs import group_experiments, load_runs
from dynpipe.analysis.timeline import plot_loss
from dynpipe.errors import UserError

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logs", type=Path, default=HERE / "logs", help="folder of experiments")
    p.add_argument("--out", type=Path, default=HERE / "figures", help="folder for figures")
    p.add_argument("--target-loss", type=float, default=None, help="loss to reach")
    p.add_argument("--quantile", type=float, default=0.1, help="picks the target if not given")
    p.add_argument("--smooth", type=int, default=5, help="steps in the trailing mean")
    args = p.parse_args(argv)
    try:
        for name, paths in group_experiments(args.logs).items():
            plot_loss(
                load_runs(paths),
                out=args.out / name,
                target=args.target_loss,
                quantile=args.quantile,
                smooth=args.smooth,
            )
            print(args.out / name / "loss_time.png")
    except UserError as exc:
        print(f"fig_loss: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
