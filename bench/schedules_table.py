"""The schedules table of docs/schedules.md, from the raw logs of bench/schedules_cpu.py.

    python bench/schedules_table.py bench/results/schedules-cpu.jsonl [--docs docs/schedules.md]

Measured: a step's time is the longest of the ranks' ``step_ms`` (every rank's step ends with
the same all-reduce), the median over steps after the first ``--skip``. Predicted: the
schedule simulator (``dynpipe.planner.multisim.simulate_schedule``) run on the same record's
measured per-stage costs: each forward and backward interval is matched to its virtual
stage by the rank's action order (``rank_orders``: the runtime runs torch's lists in that
order), medians per stage; zero-bubble weight parts the same way; the ranks' optimizer
update. Nothing is edited by hand: the table is rewritten between its markers.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from dynpipe.planner.multisim import rank_orders, simulate_schedule
from dynpipe.planner.plan import schedule_ranks
from dynpipe.planner.report import replace_section


def _predict(rows: list[dict], skip: int, action_ms: float = 0.0) -> float:
    """Simulated step time from the per-stage medians of ``rows`` (one schedule, one
    condition, every rank and step)."""
    first = rows[0]
    world, chunks, m = first["world"], first["chunks"], first["microbatches"]
    n = world * chunks
    orders = rank_orders(first["schedule"], pp=world, chunks=chunks, microbatches=m)
    fwd, bwd, wgt = defaultdict(list), defaultdict(list), defaultdict(list)
    update = defaultdict(list)
    for row in rows:
        if row["step"] < skip:
            continue
        acts = orders[row["rank"]]
        f_acts = [a for a in acts if a[0] == "F"]
        b_acts = [a for a in acts if a[0] in "BI"]
        w_acts = [a for a in acts if a[0] == "W"]
        if (len(f_acts), len(b_acts)) != (len(row["fwd_ms"]), len(row["bwd_ms"])):
            raise SystemExit(
                f"{row['schedule']} rank {row['rank']}: {len(row['fwd_ms'])} forwards and "
                f"{len(row['bwd_ms'])} backwards recorded, {len(f_acts)} and {len(b_acts)} in "
                "its action list; the log is not of this schedule"
            )
        for (_, s, _), ms in zip(f_acts, row["fwd_ms"], strict=True):
            fwd[s].append(ms)
        for (_, s, _), ms in zip(b_acts, row["bwd_ms"], strict=True):
            bwd[s].append(ms)
        for (_, s, _), ms in zip(w_acts, row["bwd_w_ms"], strict=True):
            wgt[s].append(ms)
        update[row["rank"]].append(row["update_ms"])
    med = lambda xs: float(np.median(xs)) if xs else 0.0  # noqa: E731
    split = any(wgt.values())
    # The measured one-way time of each link; the wrap of a looped schedule from the last
    # rank to the first is priced as the first link, two stages of one rank hand over free.
    owner = schedule_ranks(first["schedule"], pp=world, chunks=chunks)
    p2p = first["p2p_ms"]
    comm = []
    for s in range(n - 1):
        a, b = owner[s], owner[s + 1]
        comm.append(0.0 if a == b else p2p[min(a, b)] if abs(a - b) == 1 else p2p[0])
    return simulate_schedule(
        [med(fwd[s]) for s in range(n)],
        [med(bwd[s]) for s in range(n)],
        schedule=first["schedule"],
        microbatches=m,
        chunks=chunks,
        update_ms=[med(update[r]) for r in range(world)],
        comm_ms=comm,
        action_ms=action_ms,
        bwd_w_ms=[med(wgt[s]) for s in range(n)] if split else None,
    ).step_ms


def _measured(rows: list[dict], skip: int) -> float:
    steps = defaultdict(list)
    for row in rows:
        if row["step"] >= skip:
            steps[row["step"]].append(row["step_ms"])
    return float(np.median([max(v) for v in steps.values()]))


def table(path: Path, *, skip: int = 2) -> tuple[str, list[dict]]:
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        groups[(row["schedule"], row["condition"])].append(row)
    results, order = [], list(dict.fromkeys(k[0] for k in groups))
    for schedule in order:
        out = {"schedule": schedule}
        # The runtime's host time per action, from the sleepless run alone: the one number
        # of the simulator's that comes from measurement rather than the stage timers.
        bare = groups[(schedule, "bare")]
        base, unit = _predict(bare, skip), _predict(bare, skip, 1.0) - _predict(bare, skip)
        act = max(0.0, (_measured(bare, skip) - base) / unit)
        out["action_ms"] = act
        for cond in ("clean", "slowed"):
            rows = groups[(schedule, cond)]
            meas, pred = _measured(rows, skip), _predict(rows, skip, act)
            out[cond] = (meas, pred, pred / meas - 1.0)
            out["chunks"], out["factor"] = rows[0]["chunks"], rows[0]["factor"]
        results.append(out)
    some = next(iter(groups.values()))[0]
    lines = [
        f"{some['world']} gloo ranks on {some['cores']} CPU cores (rank r pinned to core "
        f"r mod {some['cores']}), torch {some['torch']}, `bench/sleepy.py` model, "
        f"{some['microbatches']} microbatches; slowed: rank {some['slow_rank']} at "
        f"{results[0]['factor']:g}x (emulated). Median step over steps {skip}+.",
        "",
        "| schedule | chunks | host ms/action | clean measured ms | clean predicted ms | "
        "error | slowed measured ms | slowed predicted ms | error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        c, s = r["clean"], r["slowed"]
        lines.append(
            f"| {r['schedule']} | {r['chunks']} | {r['action_ms']:.2f} | {c[0]:.1f} | "
            f"{c[1]:.1f} | {c[2]:+.1%} | "
            f"{s[0]:.1f} | {s[1]:.1f} | {s[2]:+.1%} |"
        )
    return "\n".join(lines), results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log", type=Path)
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out (default 2)")
    p.add_argument("--docs", type=Path, help="rewrite this page's schedules-cpu section")
    args = p.parse_args(argv)
    text, _ = table(args.log, skip=args.skip)
    print(text)
    if args.docs:
        replace_section(args.docs, "schedules-cpu", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
