"""Tabulate adaptive-runtime benchmark logs: per-phase step time, time to adapt, pauses.

Reads the raw JSONL logs written by ``bench/gpu_adapt.sh`` (``<model>-<kind>-<mode>.jsonl``)
and prints a markdown table; nothing here is typed in by hand.

    python bench/adapt_table.py analysis/logs/gpu/*.jsonl
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from dynpipe.runtime.runlog import read_log

SETTLE = 5  # steps skipped at the start of each phase (warm-up, the switch itself)


def summarise(path: Path) -> dict:
    recs = read_log(path)
    model, kind, mode = path.stem.split("-", 2)
    steps = {r["step"]: r for r in recs if r["type"] == "step"}
    ev = [r for r in recs if r["type"] == "event"]
    start = next(e for e in ev if e["event"] == "interference_start")
    stop = next((e for e in ev if e["event"] == "interference_stop"), None)
    on, off = start["step"], (stop["step"] if stop else max(steps) + 1)
    end = max(steps) + 1
    changes = [e for e in ev if e["event"] in ("repartition", "restart") and on <= e["step"] < off]
    first = changes[0] if changes else None

    def med(a: int, b: int) -> float | None:
        vals = [steps[s]["step_ms"] for s in range(a, b) if s in steps]
        return statistics.median(vals) if vals else None

    adapted_from = first["step"] + SETTLE if first else on + SETTLE
    pauses = [e["pause_ms"] for e in ev if e["event"] == "repartition"]
    pauses += [e["pause_ms"] for e in ev if e["event"] == "resumed"]
    device = next(r for r in recs if r["type"] == "header")["env"].get("device_name", "?")
    return {
        "model": model,
        "kind": kind,
        "mode": mode,
        "device": device,
        "clean": med(SETTLE * 2, on),
        "interference": med(adapted_from, off),
        "after": med(off + 3 * SETTLE, end),
        "steps_to_adapt": (first["step"] - on) if first else None,
        "s_to_adapt": (first["time"] - start["time"]) if first else None,
        "pause_ms": max(pauses) if pauses else None,
        "bytes": sum(e.get("bytes", 0) for e in ev if e["event"] == "repartition"),
        "repartitions": sum(1 for e in ev if e["event"] in ("repartition", "restart")),
    }


def fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def main(paths: list[str]) -> None:
    rows = [summarise(Path(p)) for p in sorted(paths)]
    print(
        "| model | interferer | system | clean ms | interference ms | after ms | "
        "steps to adapt | s to adapt | max pause ms | bytes moved | changes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['kind']} | {r['mode']} | {fmt(r['clean'])} | "
            f"{fmt(r['interference'])} | {fmt(r['after'])} | {r['steps_to_adapt'] or '–'} | "
            f"{fmt(r['s_to_adapt'], 2)} | {fmt(r['pause_ms'])} | {r['bytes']:,} | "
            f"{r['repartitions']} |"
        )
    devices = sorted({r["device"] for r in rows})
    print(
        f"\ndevice: {', '.join(devices)}; step time = median per phase, first {SETTLE} "
        "steps of each phase skipped; 'interference' starts after the first adaptation"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
