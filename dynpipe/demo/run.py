"""Run the demo: the same scenario twice, static then adaptive, each a real 2-worker job.

Both runs train the same MLP on the same synthetic data with the same seed, each worker
pinned to its own core. At step ``onset`` stage 1 slows down: by default every layer it
runs takes ``factor`` times as long (emulated, so the slowdown is the same on any machine
however loaded); with ``interferer="spin"`` real busy-loop processes start on its core
instead. At step ``departure`` the slowdown ends. The static run keeps its even split; the
adaptive run (``--adapt measured``: repartitions from the measured per-layer times) moves
layers to stage 0 and back. Both evaluate on the held-out split along the way; since the
training math does not depend on the split, both end with the same accuracy, the adaptive
one sooner.

``DemoConfig(adapt="adaptive", predictor=...)`` runs the predictor-based system instead
(``predictor/cpu.json.gz`` was trained on this kind of 2-vCPU machine); without a predictor
file it falls back to ``measured`` and says so.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DemoConfig", "run_demo"]

SYSTEMS = ("static", "adaptive")


@dataclass(frozen=True)
class DemoConfig:
    """The demo's model, scenario and adaptation settings.

    The model (a 10-layer MLP, 512 wide, batch 64 in 4 microbatches) takes about 20 ms a
    clean step on two idle cores, and 40-70 ms when other jobs share them.

    quick: fewer steps (under a minute for both runs).
    interferer: what slows stage 1 during the interference. ``emulate`` (the default)
        stretches every layer stage 1 runs to ``factor`` times its time, on its own core:
        the same slowdown on any machine, however loaded (logged as emulation). ``spin``
        starts ``count`` real busy loops at ``intensity`` on stage 1's core instead: what a
        co-located job does, but how much it slows a stage depends on the machine's
        scheduler and load (a stage that mostly waits gets its core back ahead of them).
    factor: 5, not 3: on a shared 2-core machine a step spends about as long waiting on
        the other stage as computing (each wake-up after a transfer queues behind other
        jobs), and that time is not stretched; under a 3x slowdown the static run then slows
        only about 2x while the best split (three quarters of the work on stage 0) runs 1.5x
        its clean time. The two runs are measured one after the other, and other jobs' load
        can double between them: the speed-up needs room for that.
    adapt / predictor: the adaptive system: ``measured``, or ``adaptive`` with a predictor
        file (without one it runs ``measured``).
    monitor_every: steps per monitoring window. Ten, not the runtime's five: when other jobs
        share the cores, one stage can run 1.5-2x slower than the other for a few steps,
        which five-step windows take for interference (moves before the onset, plans
        swapped back and forth); ten-step medians keep such swings far below ``min_gain``.
    min_gain: the smallest predicted gain worth a move: above what a loaded machine's
        swings make the model predict over ten-step windows, below what it predicts at the
        onset and for moving back after the end (a 9|1 split on clean cores).
    eval_batches: held-out batches per evaluation (both runs evaluate the same ones).
    """

    out: str = ""
    quick: bool = False
    width: int = 512
    depth: int = 8
    batch_size: int = 64
    microbatches: int = 4
    interferer: str = "emulate"
    factor: float = 5.0
    intensity: float = 1.0
    count: int = 2
    adapt: str = "measured"
    predictor: str | None = None
    min_gain: float = 0.2
    monitor_every: int = 10
    eval_batches: int = 4
    seed: int = 0

    # Scenario lengths, in whole windows: the clean phase calibrates the clean costs (its
    # first window settles). The adaptive run moves two windows after the onset: on the
    # first, the model's estimates move further than the steps (the model leaves out the
    # time stages wait on each other), which the controller does not act on. Its first
    # window on the new split settles too, so the interference lasts six or nine windows
    # for most of its steps to run settled on the new split (with five, the median took in
    # the slow steps before the move). The run ends three or nine windows after it, to move
    # back and be measured there.
    @property
    def steps(self) -> int:
        return 110 if self.quick else 240

    @property
    def onset(self) -> int:
        return 20 if self.quick else 60

    @property
    def departure(self) -> int:
        return 80 if self.quick else 150

    @property
    def eval_every(self) -> int:
        return 30 if self.quick else 40


def _what(cfg: DemoConfig) -> str:
    if cfg.interferer == "emulate":
        return f"stage 1 starts running {cfg.factor:g}x slower (emulated interference)"
    return f"{cfg.count} '{cfg.interferer}' interferers start on stage 1's core"


def _scenario(cfg: DemoConfig, path: Path) -> Path:
    if cfg.interferer == "emulate":
        name, what = f"stage 1 emulated {cfg.factor:g}x slower", f"factor = {cfg.factor}\n"
    else:
        name = f"{cfg.count} x '{cfg.interferer}' on stage 1's core"
        what = f"intensity = {cfg.intensity}\ncount = {cfg.count}\n"
    path.write_text(
        f'name = "demo: {name}"\n'
        f'[[events]]\nstep = {cfg.onset}\naction = "start"\nkind = "{cfg.interferer}"\n'
        f"{what}stage = 1\n"
        f'[[events]]\nstep = {cfg.departure}\naction = "stop"\nstage = 1\n'
    )
    return path


def _argv(cfg: DemoConfig, *, adapt: str, scenario: Path, log: Path) -> list[str]:
    words = {
        "--model": "mlp",
        "--data": "synthetic",
        "--steps": cfg.steps,
        "--batch-size": cfg.batch_size,
        "--microbatches": cfg.microbatches,
        "--optimizer": "adamw",
        "--lr": 1e-3,
        "--seed": cfg.seed,
        "--device": "cpu",
        "--adapt": adapt,
        "--scenario": scenario,
        "--monitor-every": cfg.monitor_every,
        "--min-gain": cfg.min_gain,
        # The demo's whole run is the horizon a repartition has to pay back within.
        "--horizon": cfg.steps,
        "--eval-every": cfg.eval_every,
        "--eval-batches": cfg.eval_batches,
        "--log": log,
    }
    if adapt == "adaptive" and cfg.predictor:
        words["--predictor"] = cfg.predictor
    argv = [str(w) for k, v in words.items() for w in (k, v)]
    for key, value in (("width", cfg.width), ("depth", cfg.depth), ("in_features", cfg.width)):
        argv += ["--model-arg", f"{key}={value}"]
    return [*argv, "--pin-cores"]


def run_demo(cfg: DemoConfig) -> int:
    """Both runs, then the report and figures; the exit status of the first failure."""
    from dynpipe.demo.report import draw_figures, format_report, summarise
    from dynpipe.runtime.cli import forked_worker
    from dynpipe.runtime.launch import launch_local

    if cfg.adapt == "adaptive" and not (cfg.predictor and Path(cfg.predictor).is_file()):
        print(
            f"dynpipe demo: no predictor at {cfg.predictor}; the adaptive run uses --adapt measured"
        )
        cfg = dataclasses.replace(cfg, adapt="measured", predictor=None)
    run_dir = Path(cfg.out or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S"))
    run_dir.mkdir(parents=True, exist_ok=True)
    scenario = _scenario(cfg, run_dir / "scenario.toml")
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(
        f"dynpipe demo: 2 pipeline stages on CPU ({ncpu} cores here), mlp {cfg.depth + 2} "
        f"layers x {cfg.width} wide, {cfg.steps} steps, run twice: static, then adaptive "
        f"(--adapt {cfg.adapt}).\n"
        f"  step {cfg.onset}: {_what(cfg)}; step {cfg.departure}: it stops.\n"
        "  Watch `split` (layers per stage) and "
        f"`ms` (step time) on the progress bar. Run folder: {run_dir}"
    )
    if ncpu is not None and ncpu < 2:
        print("  (fewer than 2 cores: both stages share one, so the effect will be muddled)")
    logs: dict[str, Path] = {}
    walls: dict[str, float] = {}
    for i, system in enumerate(SYSTEMS):
        adapt = "static" if system == "static" else cfg.adapt
        logs[system] = run_dir / f"{system}.jsonl"
        print(f"\n[{i + 1}/{len(SYSTEMS)}] {system} (--adapt {adapt})")
        argv = _argv(cfg, adapt=adapt, scenario=scenario, log=logs[system])
        t0 = time.time()
        rc = launch_local(argv, nproc=2, entry=forked_worker)
        walls[system] = time.time() - t0
        if rc != 0:
            print(f"dynpipe demo: the {system} run failed (exit {rc}); its log: {logs[system]}")
            return rc
    summary = summarise(logs["static"], logs["adaptive"], launch_s=walls)
    (run_dir / "summary.json").write_text(_json(summary))
    print(format_report(summary))
    try:
        paths = draw_figures(logs["static"], logs["adaptive"], out=run_dir / "figures")
        print("figures: " + ", ".join(str(p) for p in paths if p.suffix == ".png"))
    except Exception as exc:  # figures are a bonus; the runs and their logs are what matter
        print(f"figures were not drawn ({type(exc).__name__}: {exc}); logs in {run_dir}")
    return 0


def _json(obj: object) -> str:
    import json

    return json.dumps(obj, indent=1) + "\n"
