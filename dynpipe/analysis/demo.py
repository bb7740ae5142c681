"""``dynpipe demo``: live adaptation on a laptop, in one command.

Two pipeline stages train an MLP on learnable synthetic data, each worker pinned to its own
CPU core. Mid-run a real interferer process (a busy loop) starts on stage 1's core and
takes half of it; the adaptive runtime sees stage 1 slow down, moves layers to stage 0,
and moves them back when the interferer stops. The run log and its figures land in a run
folder; a summary says what the step time was before, during and after, and what moved.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DemoConfig", "run_demo", "summarise"]


@dataclass(frozen=True)
class DemoConfig:
    """Sizes chosen so a step takes tens of milliseconds on one core.

    quick: fewer steps (for CI): the interference still starts, is adapted to, and stops.
    """

    out: str = ""
    quick: bool = False
    width: int = 512
    depth: int = 8
    batch_size: int = 64
    interferer: str = "spin"

    @property
    def steps(self) -> int:
        return 120 if self.quick else 300

    @property
    def onset(self) -> int:
        return 40 if self.quick else 80

    @property
    def departure(self) -> int:
        return 80 if self.quick else 200


def _scenario(cfg: DemoConfig, path: Path) -> Path:
    path.write_text(
        'name = "demo: a busy loop takes half of stage 1\'s core"\n'
        f'[[events]]\nstep = {cfg.onset}\naction = "start"\nkind = "{cfg.interferer}"\n'
        "intensity = 1.0\ncount = 1\nstage = 1\n"
        f'[[events]]\nstep = {cfg.departure}\naction = "stop"\nstage = 1\n'
    )
    return path


def run_demo(cfg: DemoConfig) -> int:
    from dynpipe.runtime.launch import launch_local

    run_dir = Path(cfg.out or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S"))
    run_dir.mkdir(parents=True, exist_ok=True)
    scenario = _scenario(cfg, run_dir / "scenario.toml")
    log = run_dir / "log.jsonl"
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(
        f"dynpipe demo: 2 pipeline stages on CPU ({ncpu} cores here), mlp "
        f"{cfg.depth + 2} layers x {cfg.width} wide, {cfg.steps} steps.\n"
        f"  step {cfg.onset}: a '{cfg.interferer}' interferer starts on stage 1's core; "
        f"step {cfg.departure}: it stops.\n  Watch `split` (layers per stage) and `ms` (step "
        f"time) on the progress bar. Run folder: {run_dir}\n"
    )
    argv = [
        "--model",
        "mlp",
        "--model-arg",
        f"width={cfg.width}",
        "--model-arg",
        f"depth={cfg.depth}",
        "--model-arg",
        f"in_features={cfg.width}",
        "--data",
        "synthetic",
        "--steps",
        str(cfg.steps),
        "--batch-size",
        str(cfg.batch_size),
        "--microbatches",
        "4",
        "--optimizer",
        "adamw",
        "--lr",
        "1e-3",
        "--device",
        "cpu",
        "--pin-cores",
        "--adapt",
        "measured",
        "--scenario",
        str(scenario),
        "--monitor-every",
        "5",
        # The demo's whole run is the horizon a repartition has to pay back within.
        "--horizon",
        str(cfg.steps),
        "--log",
        str(log),
    ]
    t0 = time.time()
    rc = launch_local(argv, nproc=2)
    if rc != 0:
        print(f"dynpipe demo: training failed (exit {rc}); the log so far is {log}")
        return rc
    summary = summarise(log)
    summary["wall_s"] = round(time.time() - t0, 1)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(_format(summary))
    figs = run_dir / "figures"
    try:
        from dynpipe.cli import main as dynpipe_main

        dynpipe_main(["figures", str(log), "-o", str(figs)])
        print(f"\nfigures: {figs}")
    except Exception as exc:  # figures are a bonus; the run and its log are what matter
        print(f"\nfigures were not drawn ({type(exc).__name__}: {exc}); log: {log}")
    return 0


def summarise(log: str | Path) -> dict[str, Any]:
    """Step time before, during and after the interference; repartitions; bytes moved."""
    from dynpipe.runtime.records import read_dicts as read_log

    recs = read_log(log)
    steps = {r["step"]: r for r in recs if r["type"] == "step"}
    events = [r for r in recs if r["type"] == "event"]
    on = next((e["step"] for e in events if e.get("event") == "interference_start"), None)
    off = next((e["step"] for e in events if e.get("event") == "interference_stop"), None)
    reps = [e for e in events if e.get("event") == "repartition"]
    last = max(steps) + 1 if steps else 0
    on = last if on is None else on
    off = last if off is None else off
    first_rep = next((e["step"] for e in reps if on <= e["step"] < off), None)

    def med(a: int, b: int) -> float | None:
        vals = [steps[s]["step_ms"] for s in range(a, b) if s in steps]
        return round(statistics.median(vals), 2) if vals else None

    settle = 5  # skip the first steps of each phase (warm-up, the repartition's own step)
    return {
        "interference": {"start": on, "stop": off},
        "step_ms": {
            "before": med(settle, on),
            "during_before_adapting": med(on, first_rep if first_rep is not None else off),
            "during_after_adapting": med(first_rep + settle, off)
            if first_rep is not None
            else None,
            "after": med(off + 2 * settle, last),
        },
        "repartitions": [
            {
                "step": e["step"],
                "split": [len(range(st["start"], st["stop"])) for st in e["new_plan"]["stages"]],
                "bytes": e["bytes"],
                "pause_ms": e["pause_ms"],
            }
            for e in reps
        ],
        "bytes_moved": sum(e["bytes"] for e in reps),
        "steps_to_adapt": (first_rep - on) if first_rep is not None else None,
        "log": str(log),
    }


def _format(s: dict[str, Any]) -> str:
    st = s["step_ms"]
    lines = [
        "",
        "summary (median step time, ms):",
        f"  before interference          {st['before']}",
        f"  interference, before adapting {st['during_before_adapting']}",
        f"  interference, after adapting  {st['during_after_adapting']}",
        f"  after interference            {st['after']}",
        f"  repartitions: {len(s['repartitions'])}, bytes moved: {s['bytes_moved']:,}, "
        f"steps from onset to adapted: {s['steps_to_adapt']}",
    ]
    for r in s["repartitions"]:
        lines.append(
            f"    step {r['step']}: split {r['split']}, {r['bytes']:,} bytes, "
            f"pause {r['pause_ms']:.0f} ms"
        )
    lines.append(f"  wall time: {s.get('wall_s')} s; log: {s['log']}")
    return "\n".join(lines)
