"""Training throughput (samples/s, end to end) per model, interference and system.

    python analysis/fig_throughput.py

Reads every analysis/logs/<experiment>/*.jsonl.gz and writes
analysis/figures/throughput.{png,pdf}. Throughput is the samples of all steps over the wall
time from the first step's start to the last step's end, so migration pauses and restarts
count against a system. Inside each bar: the speed-up over the static run of the same model
under the same interference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dynpipe.analysis.bars import plot_throughput
from dynpipe.analysis.logs import group_experiments, load_runs
from dynpipe.errors import UserError

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logs", type=Path, default=HERE / "logs", help="folder of experiments")
    p.add_argument("--out", type=Path, default=HERE / "figures", help="folder for figures")
    args = p.parse_args(argv)
    try:
        paths = [f for files in group_experiments(args.logs).values() for f in files]
        plot_throughput(load_runs(paths), out=args.out)
        print(args.out / "throughput.png")
    except UserError as exc:
        print(f"fig_throughput: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
