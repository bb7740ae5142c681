"""Cost of each live repartition (decide, transfer, rebuild) beside each restart's pause.

    python analysis/fig_migration.py

Reads every analysis/logs/<experiment>/*.jsonl.gz and writes
analysis/figures/<experiment>/migration.{png,pdf} for each experiment whose logs hold
repartition or restart events (the others are listed as skipped). Numbers are the
repartition events' own decide_ms / transfer_ms / rebuild_ms / pause_ms, and for the restart
baseline the restart event's decide_ms plus the resumed event's pause_ms.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dynpipe.analysis.bars import plot_migration
from dynpipe.analysis.logs import group_experiments, load_runs
from dynpipe.analysis.metrics import migration_costs
from dynpipe.errors import UserError

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logs", type=Path, default=HERE / "logs", help="folder of experiments")
    p.add_argument("--out", type=Path, default=HERE / "figures", help="folder for figures")
    args = p.parse_args(argv)
    try:
        for name, paths in group_experiments(args.logs).items():
            runs = load_runs(paths)
            if migration_costs(runs).empty:
                print(f"skipped {name}: no repartition or restart in its logs")
                continue
            plot_migration(runs, out=args.out / name)
            print(args.out / name / "migration.png")
    except UserError as exc:
        print(f"fig_migration: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
