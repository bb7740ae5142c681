"""Mean step time per phase (clean / interference / after) and system, one figure per model.

    python analysis/fig_phases.py
    python analysis/fig_phases.py --logs analysis/logs --warmup 5

Reads every analysis/logs/<experiment>/*.jsonl.gz and writes
analysis/figures/phases_<model>.{png,pdf}. Experiments of the same model under different
interference (light, heavy) become panels side by side. Phases are cut where the logs'
interference events say the interferer went on and off.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dynpipe.analysis.bars import plot_phases
from dynpipe.analysis.logs import group_experiments, load_runs
from dynpipe.errors import UserError

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logs", type=Path, default=HERE / "logs", help="folder of experiments")
    p.add_argument("--out", type=Path, default=HERE / "figures", help="folder for figures")
    p.add_argument("--warmup", type=int, default=2, help="first steps of a run left out")
    args = p.parse_args(argv)
    try:
        paths = [f for files in group_experiments(args.logs).values() for f in files]
        runs = load_runs(paths)
        for model in dict.fromkeys(r.model for r in runs):
            mine = [r for r in runs if r.model == model]
            plot_phases(mine, out=args.out, warmup=args.warmup, name=f"phases_{model}")
            print(args.out / f"phases_{model}.png")
    except UserError as exc:
        print(f"fig_phases: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
