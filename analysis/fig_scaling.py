"""Throughput against the number of GPUs (world size), static and adaptive, from raw logs.

    python analysis/fig_scaling.py
    python analysis/fig_scaling.py --logs analysis/logs/scaling --out analysis/figures/scaling

Reads every run log below --logs (one experiment per world size, e.g. logs/scaling/1gpu/,
2gpu/, 4gpu/), takes each log's world size from its header and the median of its per-step
samples/s, clean and under interference, and writes <out>/scaling_<model>.{png,pdf}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dynpipe.analysis.logs import expand_log_paths, load_runs
from dynpipe.analysis.scaling import plot_scaling
from dynpipe.errors import UserError

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logs", type=Path, default=HERE / "logs", help="folder of run logs")
    p.add_argument("--out", type=Path, default=HERE / "figures", help="folder for figures")
    p.add_argument("--warmup", type=int, default=2, help="first steps of a run left out")
    args = p.parse_args(argv)
    try:
        runs = load_runs(expand_log_paths([args.logs]))
        for model in dict.fromkeys(r.model for r in runs):
            mine = [r for r in runs if r.model == model]
            if len({r.world_size for r in mine}) < 2:
                print(f"fig_scaling: {model}: logs at one world size only; skipped")
                continue
            plot_scaling(mine, out=args.out, warmup=args.warmup, name=f"scaling_{model}")
            print(args.out / f"scaling_{model}.png")
    except UserError as exc:
        print(f"fig_scaling: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
