"""Replay the adaptation loop over a recorded run: what would the controller decide?

Feeds a run log's step records and telemetry, window by window, to a real ``Adapter`` (the
same monitor, calibration and controller the runtime uses) with the configuration of the
log or the one given here, and prints each window's decision. Moves are not carried out:
the replay stops at the first repartition it would make, since the log's later timings
belong to the plan the recorded run held, not to the replayed one.

The honest use is on ``static`` runs: every move proposed in a clean phase is a false one,
and the step of the first move after an onset is how fast the controller reacts.

    python bench/replay_controller.py analysis/logs/gpu-h200-2gpu/vgg16-gemm-static.jsonl \
        [--mode measured|adaptive] [--predictor P] [--min-gain 0.05] ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from dynpipe.cliargs import add_config_args, config_kwargs
from dynpipe.planner.plan import Plan
from dynpipe.runtime.adapter import Adapter
from dynpipe.runtime.cli import ADAPT_FLAGS
from dynpipe.runtime.config import TrainConfig
from dynpipe.runtime.controller import AdaptConfig
from dynpipe.runtime.records import read_log
from dynpipe.runtime.train import build_model_and_data


class _Moved(Exception):
    """Raised by the replay's ``_apply``: the run would repartition here."""

    def __init__(self, step: int, plan: Plan) -> None:
        super().__init__(step)
        self.step, self.plan = step, plan


class _ReplayAdapter(Adapter):
    def _apply(self, new_plan: Plan, *, step: int, before_ms: float, decide_ms: float) -> None:
        raise _Moved(step + 1, new_plan)


def replay(path: Path, overrides: dict, predictor: str | None) -> list[dict]:
    """Decisions, one dict per window, until the first move (its entry has ``moved``)."""
    log = read_log(path)
    header = log.headers[0]
    conf = header.config
    adapt = AdaptConfig(**{**conf["adapt"], **overrides})
    cfg = TrainConfig(
        model=conf["model"],
        model_args=conf["model_args"],
        data=conf.get("data", "synthetic"),
        batch_size=conf["batch_size"],
        microbatches=conf["microbatches"],
        adapt=adapt,
        predictor=predictor,
        progress=False,
    )
    model, _ = build_model_and_data(cfg)
    plan = Plan.from_dict(header.plan)
    engine = SimpleNamespace(plan=plan, model=model)
    topo = SimpleNamespace(
        world_size=1, rank=0, device=torch.device("cpu"), is_cuda=False, timeout_s=30.0
    )
    adapter = _ReplayAdapter(cfg, engine=engine, topo=topo, log=None)  # type: ignore[arg-type]
    # The adapter reads a window's steps as the plain dicts the training loop hands it.
    steps = [r.to_dict() for r in log.steps]
    tels = {r.step: r.devices for r in log.telemetry}
    events = {e.step: e.event for e in log.events() if e.step is not None}
    every = adapt.monitor_every
    out = []
    for i in range(0, len(steps), every):
        window = steps[i : i + every]
        if len(window) < every:
            break
        last = window[-1]["step"]
        # Static runs gather telemetry every log_every steps: take the record that covers
        # this window (the first at or after its end).
        covering = min((t for t in tels if t >= last), default=None)
        devices = tels[covering] if covering is not None else []
        tel = [{k: (float("nan") if v is None else v) for k, v in d.items()} for d in devices]
        marks = [events[s] for s in range(window[0]["step"], last + 1) if s in events]
        try:
            d = adapter.window(last, window, tel)
        except _Moved as m:
            out.append({"step": m.step, "moved": m.plan.bounds, "events": marks})
            break
        if d is not None:
            out.append(
                {
                    "step": d.step,
                    "slowdown": d.slowdown,
                    "gain": round(1 - d.proposed_ms / max(d.current_ms, 1e-9), 4),
                    "reason": d.reason,
                    "events": marks,
                }
            )
        elif marks:
            out.append({"step": last + 1, "events": marks})
    return out


def build_parser() -> argparse.ArgumentParser:
    """Every AdaptConfig field but ``mode`` as a flag that overrides the log's value (the same
    flags, from the same dataclass, as ``dynpipe train``'s)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--mode", choices=("measured", "adaptive"), default="measured")
    ap.add_argument("--predictor", default=None)
    add_config_args(ap, AdaptConfig, flags=ADAPT_FLAGS, exclude=("mode",), unset=True)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    given = {k: v for k, v in config_kwargs(args, AdaptConfig).items() if v is not None}
    overrides = {**given, "mode": args.mode}
    for path in args.logs:
        print(f"## {path}")
        for d in replay(path, overrides, args.predictor):
            print("  ", d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
