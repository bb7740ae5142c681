"""Per-phase step times of the data x pipeline benchmark, against the best static shape/split.

Reads the raw logs ``bench/gpu_dp_pp.sh`` wrote into OUTDIR (``<model>-<system>.jsonl``, or
``.jsonl.gz`` as committed, and its ``meta.json``) and prints, per model and phase (clean,
interference, after), every system's mean wall-clock time per step and its ratio to the oracle
(``adaptive-dp4``: the adaptive policy started as DP only; the live policies may change shape,
``--reshape``, and their moves column lists reshapes as ``step:DPxPP split``): the fastest of
the static shapes run under the same conditions (``dp4``: data parallelism alone, ``pp4``: one
4-stage pipeline, ``static``: 2 x 2 with the even split) and of every 2 x 2 split the ``sweep``
run held (its clean pass for the clean and after phases, its second pass, under the interferer,
for the interference phase). Time per step is measured from one step's end to the next, so the
per-window gather, adaptation pauses and a split's first steps count. A 2-GPU run
(``meta.json``'s ``nproc``) has ``dp2``, ``pp2`` and ``adaptive-dp2``, no 2 x 2, and its sweep
holds the 1 x 2 splits.

    python bench/dp_pp_table.py OUTDIR            # prints a markdown table per model
    python bench/dp_pp_table.py OUTDIR --json OUTDIR/dp-pp-table.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dynpipe.analysis.metrics import sweep_split_ms
from dynpipe.planner.plan import split_label
from dynpipe.runtime.records import find_log, read_log


def systems(nproc: int) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """The static shapes, every system, and the shape the sweep holds, of a run on
    ``nproc`` GPUs (4 or 2)."""
    static = (f"dp{nproc}", f"pp{nproc}", *(("static",) if nproc == 4 else ()))
    every = (*static, "measured", "adaptive", f"adaptive-dp{nproc}", "partial")
    return static, every, "2x2" if nproc == 4 else "1x2"


def _steps(path: Path) -> tuple[dict[int, Any], list[Any], Any]:
    log = read_log(path)
    return {s.step: s for s in log.steps}, log.events(), log.headers[0] if log.headers else None


def _phase_ms(steps: dict[int, Any], a: int, b: int) -> float | None:
    """Mean time per step over steps [a, b), from the end of step a-1 to that of b-1."""
    if a - 1 not in steps or b - 1 not in steps:
        return None
    return (steps[b - 1].t_end - steps[a - 1].t_end) * 1e3 / (b - a)


def _split(step: Any) -> str:
    return split_label([st.layers for st in step.stages])


def _sweep(path: Path, onset: int, warmup: int, every: int) -> dict[str, dict[str, float]]:
    """Mean time per step of every split the sweep held, per pass (``sweep_split_ms``)."""
    steps, events, _ = _steps(path)
    moved = {e.step for e in events if e.event == "repartition"}
    held = [(s, steps[s].t_end, _split(steps[s])) for s in sorted(steps)]
    return sweep_split_ms(held, moved, onset=onset, warmup=warmup, every=every)


def _moves(events: list[Any], a: int, b: int) -> str:
    """The moves in steps ``[a, b)``: ``step:split/shares``, a reshape's with its new shape
    (``step:4x1 16``)."""
    parts = []
    for e in events:
        if e.event in ("repartition", "reshare", "reshape") and a <= (e.step or 0) < b:
            new = e["new_plan"]
            split = "|".join(str(st["stop"] - st["start"]) for st in new["stages"])
            shares = new.get("shares")
            if e.event == "reshape":
                split = f"{new.get('dp', 1)}x{len(new['stages'])} {split}"
            parts.append(f"{e.step}:{split}" + (f"/{'-'.join(map(str, shares))}" if shares else ""))
    return " ".join(parts)


def table(outdir: Path) -> dict[str, Any]:
    meta = json.loads((outdir / "meta.json").read_text())
    onset, end, steps_n, warm = meta["onset"], meta["end"], meta["steps"], meta["warmup"]
    static, every, swept = systems(int(meta.get("nproc", 4)))
    phases = {"clean": (warm, onset), "interference": (onset, end), "after": (end, steps_n)}
    out: dict[str, Any] = {"meta": meta, "models": {}, "systems": list(every)}
    for model in meta["models"]:
        runs = {}
        for system in every:
            p = find_log(outdir, f"{model}-{system}")
            if p is not None:
                runs[system] = _steps(p)
        sweep_path = find_log(outdir, f"{model}-sweep")
        sweep = (
            _sweep(sweep_path, meta["sweep_onset"][model], warm, meta["monitor_every"])
            if sweep_path is not None
            else {"clean": {}, "interference": {}}
        )
        device = next((h.env.get("device_name") for _, _, h in runs.values() if h), None)
        entry: dict[str, Any] = {"device": device, "phases": {}}
        for ph, (a, b) in phases.items():
            ms = {s: _phase_ms(st, a, b) for s, (st, _, _) in runs.items()}
            candidates = {s: ms[s] for s in static if ms.get(s) is not None}
            pass_ = sweep["interference" if ph == "interference" else "clean"]
            candidates.update({f"{swept} {k}": v for k, v in pass_.items()})
            best = min(candidates, key=candidates.get) if candidates else None
            oracle = candidates.get(best) if best else None
            entry["phases"][ph] = {
                "oracle": {"config": best, "ms": oracle},
                "systems": {
                    s: {
                        "ms": v,
                        "ratio": None if v is None or not oracle else v / oracle,
                        "moves": _moves(runs[s][1], a, b),
                    }
                    for s, v in ms.items()
                },
                "sweep": pass_,
            }
        out["models"][model] = entry
    return out


def markdown(res: dict[str, Any]) -> str:
    lines = []
    for model, entry in res["models"].items():
        lines.append(f"### {model} ({entry['device']})\n")
        lines.append("| system | clean | interference | after | ÷ oracle (c / i / a) | moves |")
        lines.append("|---|---|---|---|---|---|")
        phases = entry["phases"]
        order = res.get("systems") or systems(4)[1]
        for s in [s for s in order if any(s in p["systems"] for p in phases.values())]:
            cells, ratios, moves = [], [], []
            for ph in ("clean", "interference", "after"):
                v = phases[ph]["systems"].get(s, {})
                cells.append("–" if v.get("ms") is None else f"{v['ms']:.1f} ms")
                ratios.append("–" if v.get("ratio") is None else f"{v['ratio']:.3f}")
                if v.get("moves"):
                    moves.append(v["moves"])
            lines.append(
                f"| {s} | {' | '.join(cells)} | {' / '.join(ratios)} | {' '.join(moves)} |"
            )
        oracle = [phases[ph]["oracle"] for ph in ("clean", "interference", "after")]
        cells = ["–" if o["ms"] is None else f"{o['ms']:.1f} ms ({o['config']})" for o in oracle]
        lines.append(f"| oracle | {' | '.join(cells)} | | |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    a = ap.parse_args(argv)
    res = table(a.outdir)
    text = markdown(res)
    print(text)
    (a.outdir / "dp-pp-table.md").write_text(text + "\n")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
