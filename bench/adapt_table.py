"""Tabulate adaptive-runtime benchmark logs: per-phase step time, time to adapt, pauses.

Reads the raw JSONL logs written by ``bench/gpu_adapt.sh`` (``<model>-<kind>-<mode>.jsonl``,
or ``.jsonl.gz`` as committed) and prints markdown tables; nothing here is typed in by hand.

    python bench/adapt_table.py analysis/logs/gpu-h200-2gpu-vgg16-rep1/*.jsonl.gz

Phases are cut at the steps where the scenario started or stopped interference. A phase's
step time is the median over the whole phase but its first ``SETTLE`` steps (the first
phase skips two windows of start-up), so it includes the time a system took to adapt and
any plan it tried and undid: what a user of the run would have seen. The pause of a live
repartition is the logged one (decide + transfer + rebuild) plus the excess of the first
step under the new plan over the steps after it.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from dynpipe.analysis.phases import interference_windows
from dynpipe.runtime.records import Event, log_stem, read_log

SETTLE = 5  # steps skipped after a phase starts or the plan changes


def _static(system: str) -> bool:
    """A static baseline: ``static``, or a static run of another plan (``static_tuned``,
    ``static_profile``)."""
    return system == "static" or system.startswith("static_")


def _phases(ev: list[Event], end: int) -> list[tuple[str, int, int]]:
    """(label, start, stop) of each phase; labels name the interfered stages."""
    wins = interference_windows(ev, last_step=end - 1, t0=ev[0].time if ev else 0.0)
    cuts = sorted({w.start for w in wins} | {w.stop for w in wins if w.stop < end})
    out, prev = [], 0
    for i, stop in enumerate([*cuts, end]):
        on = sorted({w.stage for w in wins if w.start <= prev < w.stop})
        empty = "after" if i == len(cuts) else "clean"
        out.append(("+".join(f"s{s}" for s in on) or empty, prev, stop))
        prev = stop
    return out


def summarise(path: Path) -> dict:
    log = read_log(path)
    model, kind, mode = log_stem(path).split("-", 2)
    steps = {r.step: r for r in log.steps}
    ev = log.events()
    end = max(steps) + 1
    changes = log.events("repartition", "restart")

    def med(a: int, b: int) -> float | None:
        vals = [steps[s].step_ms for s in range(a, b) if s in steps]
        return statistics.median(vals) if vals else None

    phases = {}
    for i, (label, a, b) in enumerate(_phases(ev, end)):
        # The first phase starts after start-up warm-up (two windows' worth of steps).
        lo = a + SETTLE * (2 if i == 0 else 1)
        phases[label if label not in phases else f"{label}'"] = med(lo, b)
    onsets = log.events("interference_start")
    adapt = []
    for o in onsets:
        nxt = next((c for c in changes if c.step >= o.step), None)
        if nxt is not None:
            adapt.append((nxt.step - o.step, nxt.time - o.time))
    firsts = {e.step: e for e in log.events("first_step")}
    pauses, full = [], []
    for e in ev:
        if e.event == "repartition":
            pauses.append(e["pause_ms"])
            f = firsts.get(e.step)
            extra = 0.0
            if f is not None and f.get("after_ms") is not None:
                extra = max(0.0, f["first_step_ms"] - f["after_ms"])
            full.append(e["pause_ms"] + extra)
        elif e.event == "resumed":
            pauses.append(e["pause_ms"])
            full.append(e["pause_ms"])
    header = log.headers[0]
    device = header.env.get("device_name", "?")
    return {
        "model": model,
        "kind": kind,
        "mode": mode,
        "device": device,
        "stages": len(header.plan["stages"]),
        "phases": phases,
        "adapt": adapt,
        "pause_ms": max(pauses) if pauses else None,
        "pause_full_ms": max(full) if full else None,
        "bytes": sum(e.get("bytes", 0) for e in log.events("repartition")),
        "repartitions": len(changes),
    }


def fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def main(paths: list[str]) -> None:
    rows = [summarise(Path(p)) for p in sorted(paths)]
    labels = list(dict.fromkeys(k for r in rows for k in r["phases"]))
    print(
        "| model | interferer | system | "
        + " | ".join(f"{lb} ms" for lb in labels)
        + " | steps (s) to adapt | max pause ms | with first step | bytes moved | changes |"
    )
    print("|---" * (len(labels) + 8) + "|")
    for r in rows:
        adapt = ", ".join(f"{n} ({s:.2f})" for n, s in r["adapt"]) or "–"
        print(
            f"| {r['model']} | {r['kind']} | {r['mode']} | "
            + " | ".join(fmt(r["phases"].get(lb)) for lb in labels)
            + f" | {adapt} | {fmt(r['pause_ms'])} | {fmt(r['pause_full_ms'])} | "
            f"{r['bytes']:,} | {r['repartitions']} |"
        )
    # Each system against the best static plan of each phase, measured in the same session.
    print(
        "\n| model | interferer | system | "
        + " | ".join(f"{lb} ÷ best static" for lb in labels)
        + " |"
    )
    print("|---" * (len(labels) + 3) + "|")
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["kind"]), []).append(r)
    for (model, kind), rs in groups.items():
        best = {
            lb: min(
                (r["phases"][lb] for r in rs if _static(r["mode"]) and r["phases"].get(lb)),
                default=None,
            )
            for lb in labels
        }
        for r in rs:
            if _static(r["mode"]):
                continue
            cells = [
                fmt(r["phases"][lb] / best[lb], 3) if best[lb] and r["phases"].get(lb) else "–"
                for lb in labels
            ]
            print(f"| {model} | {kind} | {r['mode']} | " + " | ".join(cells) + " |")
    devices = sorted({r["device"] for r in rows})
    print(
        f"\ndevice: {', '.join(devices)}; step time = median over each phase but its first "
        f"{SETTLE} steps (adapting included); pause = decide + transfer + rebuild, 'with first "
        "step' adds the first step's excess under the new plan"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
