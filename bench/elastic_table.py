"""Per-phase step times and time to accuracy of ``bench/gpu_elastic.sh``'s runs, from the
raw logs only.

    python bench/elastic_table.py OUTDIR

Phases (from ``OUTDIR/meta.json``): before the interferer (steps 10 to onset), during it
(onset + 10 to its end: the first windows of a reaction are left out of every run alike),
after it (end + 10 to the last step). Each cell is the median step time in ms and the run's
stage counts seen in that phase. Freeze runs: the held-out accuracy over wall time, and the
time each run first reaches the target (the lower of the two runs' best accuracies).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from dynpipe.runtime.records import read_log

RUNS = ("keep-static", "keep-measured", "drop-static", "elastic", "release")


def _phases(meta: dict) -> list[tuple[str, int, int]]:
    onset, end, steps = meta["onset"], meta["end"], meta["steps"]
    return [("before", 10, onset), ("during", onset + 10, end), ("after", end + 10, steps)]


def _stage_counts(recs, a: int, b: int, initial: int) -> list[int]:
    counts, n = set(), initial
    changes = sorted((e.step, e["stages"]) for e in recs.events("stage_count"))
    for step, stages in changes:
        if step <= a:
            n = stages
    counts.add(n)
    counts.update(stages for step, stages in changes if a < step < b)
    return sorted(counts)


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    meta = json.loads((out / "meta.json").read_text())
    card = meta["device"]
    print(f"device {card}, scenario {meta['scenario']}, revision {meta.get('revision')}")
    print(f"{'run':<14}" + "".join(f"{name:>22}" for name, _, _ in _phases(meta)))
    for run in RUNS:
        log = out / run / "log.jsonl"
        if not log.is_file():
            print(f"{run:<14} (no log)")
            continue
        recs = read_log(log)
        steps = {r.step: r.step_ms for r in recs.steps}
        initial = len(recs.headers[0].plan["stages"]) if recs.headers else 0
        cells = []
        for _, a, b in _phases(meta):
            xs = [steps[s] for s in range(a, b) if s in steps]
            if not xs:
                cells.append(f"{'-':>22}")
                continue
            n = "/".join(map(str, _stage_counts(recs, a, b, initial)))
            cells.append(f"{statistics.median(xs):>12.2f} ms ({n} st)")
        print(f"{run:<14}" + "".join(cells))
    rel = out / "release" / "log.jsonl"
    if rel.is_file():
        for e in read_log(rel).events("release"):
            what = f"released {e['ranks']}" if e["ranks"] else f"reclaimed {e['reclaimed']}"
            print(
                f"release run: {what} from step {e.step}, {e.get('waited_s')} s after the "
                f"request was written; active ranks {e.get('active')}"
            )
    evals = {}
    for run in ("nofreeze", "freeze"):
        log = out / run / "log.jsonl"
        if log.is_file():
            recs = read_log(log)
            t0 = recs.headers[0].time if recs.headers else 0.0
            evals[run] = [(e.time - t0, e.step, e.accuracy) for e in recs.evals]
            frozen = [(e.step, e["frozen"]) for e in recs.events("freeze")]
            if frozen:
                print(f"{run}: frozen prefix (step, layers): {frozen}")
    if len(evals) == 2 and all(evals.values()):
        target = min(max(a or 0.0 for _, _, a in v) for v in evals.values())
        print(f"time to accuracy {target:.4f} (the lower of the two runs' best):")
        for run, v in evals.items():
            hit = next(((t, s) for t, s, a in v if (a or 0.0) >= target), None)
            last = v[-1]
            where = f"{hit[0]:.1f} s (step {hit[1]})" if hit else "not reached"
            print(f"  {run:<9} {where}; final accuracy {last[2]:.4f} at step {last[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
