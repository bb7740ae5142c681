"""Per-phase step times and time to accuracy of ``bench/gpu_elastic.sh``'s runs, from the
raw logs only.

    python bench/elastic_table.py OUTDIR

Phases (from ``OUTDIR/meta.json``): before the interferer (steps 10 to onset), during it
(onset + 10 to its end: the first windows of a reaction are left out of every run alike),
after it (end + 10 to the last step). Each cell is the median step time in ms and the run's
stage counts seen in that phase. Freeze runs (without freezing, with it, and with
``--autodp`` where it ran): the held-out accuracy over wall time, the time each run first
reaches the target (the lowest of the runs' best accuracies), each run's median step time
after its last freeze or reshape, and the autodp run's reshapes (shape before and after,
bytes copied, pause).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from dynpipe.runtime.records import find_log, read_log

RUNS = ("keep-static", "keep-measured", "drop-static", "elastic", "release")
FREEZE_RUNS = ("nofreeze", "freeze", "freeze-autodp")


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
        log = find_log(out / run, "log")
        if log is None:
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
    rel = find_log(out / "release", "log")
    if rel is not None:
        for e in read_log(rel).events("release"):
            what = f"released {e['ranks']}" if e["ranks"] else f"reclaimed {e['reclaimed']}"
            print(
                f"release run: {what} from step {e.step}, {e.get('waited_s')} s after the "
                f"request was written; active ranks {e.get('active')}"
            )
    evals = {}
    for run in FREEZE_RUNS:
        log = find_log(out / run, "log")
        if log is None:
            continue
        recs = read_log(log)
        t0 = recs.headers[0].time if recs.headers else 0.0
        evals[run] = [(e.time - t0, e.step, e.accuracy) for e in recs.evals]
        frozen = [(e.step, e["frozen"]) for e in recs.events("freeze")]
        if frozen:
            print(f"{run}: frozen prefix (step, layers): {frozen}")
        for e in recs.events("reshape"):
            print(
                f"{run}: step {e.step}: {e['old_shape'][0]} x {e['old_shape'][1]} -> "
                f"{e['new_shape'][0]} x {e['new_shape'][1]} ({e.get('reason')}), "
                f"{e['bytes']} bytes copied, pause {e['pause_ms']:.1f} ms"
            )
        settled = max([s for s, _ in frozen] + [e.step for e in recs.events("reshape")], default=0)
        tail = [r.step_ms for r in recs.steps if r.step >= settled + 10]
        if tail:
            print(f"{run}: median step {statistics.median(tail):.2f} ms from step {settled + 10}")
    done = {run: v for run, v in evals.items() if v}
    if len(done) >= 2:
        target = min(max(a or 0.0 for _, _, a in v) for v in done.values())
        print(f"time to accuracy {target:.4f} (the lowest of the runs' best):")
        for run, v in done.items():
            hit = next(((t, s) for t, s, a in v if (a or 0.0) >= target), None)
            last = v[-1]
            where = f"{hit[0]:.1f} s (step {hit[1]})" if hit else "not reached"
            print(f"  {run:<14} {where}; final accuracy {last[2]:.4f} at step {last[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
