"""Replay the adaptation policy over a recorded run: what would it decide, window by window?

Feeds a run log's windows (step records, the sampled per-layer timings, telemetry) to the
policy the runtime uses (``make_policy``; through the same ``Window`` type the training loop
builds), with the log's configuration or the overrides given here, and prints each window's
decision. Moves are not carried out: the replay stops at the first move the policy would
make whose plan the recorded run did not also move to, since the log's later timings belong
to the plan the recorded run held.

The honest use is on ``static`` runs: every move proposed in a clean phase is a false one,
and the step of the first move after an onset is how fast the policy reacts. Logs recorded
before per-layer timing existed replay with stage times spread over layers by the policy's
current estimates (``CostEstimates``' fallback).

    python bench/replay_controller.py analysis/logs/oracle-*/*/static.jsonl.gz \
        [--mode measured|adaptive] [--predictor P] [--min-gain 0.05] ...

``--explain STEP`` prints, for the window decided at ``STEP``, the model behind the
decision: every layer's cost on every device of the plan in force (forward / backward, ms a
microbatch; a device that does not hold a layer prices it by its clean cost and the
device's slowdown), the host issue times kept per layer, and per plan (the one in force, the
one the policy picked, and any ``--plan 4|3|3|4`` given) the predicted step and each stage's
device and host sums: what to read before changing the model.

``--time`` also prints the policy's host time per window (what a training rank spends in
``think`` while its device runs a step), with the predictor's part in ``adaptive`` mode;
on a GPU host ``--cuda`` first opens a CUDA context, as a training rank holds one.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dynpipe.cliargs import add_config_args, config_kwargs
from dynpipe.planner.plan import Plan, split_label
from dynpipe.runtime.adapt.config import AdaptConfig
from dynpipe.runtime.adapt.make import make_policy
from dynpipe.runtime.adapt.policy import predicted_step_ms, stage_costs
from dynpipe.runtime.adapt.record import Bounds
from dynpipe.runtime.adapt.window import Window
from dynpipe.runtime.cli import ADAPT_FLAGS
from dynpipe.runtime.config import TrainConfig
from dynpipe.runtime.records import read_log
from dynpipe.runtime.train import build_model_and_data


def replay(
    path: Path,
    overrides: dict,
    predictor: str | None,
    *,
    through: bool = False,
    link_gbs: float | None = None,
    host_ms: list[tuple[float, float, float | None]] | None = None,
    explain: int | None = None,
    plans: Sequence[str] = (),
) -> list[dict]:
    """One dict per window: the decision, or the first move the recorded run did not make.

    ``through``: replay the whole log, the recorded moves imposed on the policy where it
    would have moved elsewhere or not at all (decisions after one are conditional on it;
    such windows carry ``recorded``, the plan the run moved to).
    ``host_ms``: if given, gets one ``(wall, cpu, predictor)`` per window the policy read:
    milliseconds of its ``observe`` (wall clock and this thread's CPU time) and of the
    predictor's call within it (None where it made none).
    ``explain``: the window decided at this step carries ``explain`` (``_explain``), with
    ``plans`` (splits as ``4|3|3|4``) priced beside the plan in force and the one picked."""
    log = read_log(path)
    header = log.headers[0]
    conf = header.config
    dp = int(header.plan.get("dp", 1) or 1)
    if dp > 1 or log.events("reshape"):
        # The replica policy reads each replica's timings and moves shares and shapes: its
        # windows are not the single pipeline's this tool rebuilds, so replaying one here
        # would show decisions the run could not have made.
        raise SystemExit(
            f"{path}: a replicated run (dp {dp}, or reshaped while running) cannot be "
            "replayed; replay single-pipeline logs (dp 1)"
        )
    adapt = AdaptConfig.from_dict({**conf["adapt"], **overrides})
    cfg = TrainConfig.of_logged_model(conf, adapt)
    model, _ = build_model_and_data(cfg)
    plan = Plan.from_dict(header.plan)
    # The links as the run measured them (``links`` event; the analytic default without):
    # a split's transfers cost what they cost the run. A bf16 run measured its wire bytes.
    links = log.events("links")  # ``link_gbs``: for logs without one (static runs)
    wire = 0.5 if conf.get("bf16") else 1.0
    policy = make_policy(
        adapt,
        model=model,
        microbatch_size=cfg.batch_size // plan.microbatches,
        num_ranks=header.world_size,
        predictor=predictor,
        link_bandwidth=(
            links[0]["bandwidth_gbs"] * 1e9 / wire if links else (link_gbs or 0) * 1e9 or None
        ),
    )
    if policy is None:
        raise SystemExit(f"{path}: mode {adapt.mode!r} has no policy to replay")
    # The policy reads a window's steps as the plain dicts the training loop hands it.
    steps = [r.to_dict() for r in log.steps]
    layers = {r.step: r.to_dict() for r in log.layer_times}
    tels = {r.step: list(r.devices) for r in log.telemetry}
    events = {e.step: e.event for e in log.events() if e.step is not None}
    moves = {e.step: e for e in log.events("repartition")}
    every = adapt.monitor_every
    out: list[dict] = []
    for window in _windows(steps, every):
        last = window[-1]["step"]
        st = window[-1]["stages"]
        bounds = [s["layers"] for s in st]
        covering = min((t for t in tels if t >= last), default=None)
        w = Window.from_records(
            window,
            bounds=bounds,
            ranks=[s["rank"] for s in st],
            microbatches=plan.microbatches,
            schedule=plan.schedule,
            layers=layers.get(last),
            telemetry=tels[covering] if covering is not None and predictor else None,
            # Light ranks' probes and idle ranks' (a plan that leaves ranks idle, --elastic).
            probes={
                int(r): (int(i), f, b) for r, i, f, b in (layers.get(last) or {}).get("probes", [])
            }
            or None,
            idle=sorted(set(range(header.world_size)) - {s["rank"] for s in st}),
        )
        t0, c0 = time.perf_counter(), time.thread_time()
        d = policy.observe(w)
        if host_ms is not None:
            wall, cpu = (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3
            host_ms.append((wall, cpu, getattr(policy, "predict_ms", None)))
        marks = [events[s] for s in range(window[0]["step"], last + 1) if s in events]
        # A move starts a step after the window's decision (the loop decides while the
        # device runs the next step); logs from before that started it at once.
        first = last + 1
        rec = moves.get(first + 1, moves.get(first))
        if d is None:
            if marks:
                out.append({"step": first, "events": marks})
            if rec is not None:
                if not through:
                    break  # the recorded run moved where this policy could not have
                _impose(policy, rec)
            continue
        if explain is not None and d.step == explain:
            out.append({"step": d.step, "explain": _explain(policy, w, d, plans)})
            return out  # what follows the window explained is another question
        entry = {
            "step": d.step,
            "slowdown": d.slowdown,
            "gain": round(1 - d.proposed_ms / max(d.current_ms, 1e-9), 4),
            # The model's price of the plan in force against what its window's steps took.
            "model_ms": round(float(d.current_ms), 2),
            "step_ms": round(w.median_step_ms, 2),
            "reason": d.reason,
            "events": marks,
        }
        recorded = (
            None if rec is None else [[s["start"], s["stop"]] for s in rec["new_plan"]["stages"]]
        )
        if d.repartition:
            same = recorded == [list(b) for b in d.bounds]
            entry["moved"] = [list(b) for b in d.bounds]
            entry["as_recorded"] = same
            out.append(entry)
            if same:
                policy.applied(step=d.step, pause_ms=rec["pause_ms"], moved_bytes=rec["bytes"])
                continue
            if not through:
                break
            entry["recorded"] = recorded
            if hasattr(policy, "pending"):
                policy.pending = None  # not made (the loop's veto seam)
            if rec is not None:
                _impose(policy, rec)
            continue
        if rec is not None:
            entry["recorded"] = recorded
            out.append(entry)
            if not through:
                break
            _impose(policy, rec)
            continue
        out.append(entry)
    return out


def _bounds(split: str, num_layers: int) -> Bounds:
    """``4|3|3|4`` as stage bounds; one clear line if it does not cover the model."""
    try:
        sizes = [int(x) for x in split.split("|")]
    except ValueError:
        sizes = [0]
    if sum(sizes) != num_layers or min(sizes) < 1:
        raise SystemExit(
            f"--plan {split}: {sum(sizes)} layers in stages of at least 1, the model has "
            f"{num_layers}; give sizes that sum to {num_layers}"
        )
    edges = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return tuple((int(a), int(b)) for a, b in itertools.pairwise(edges))


def _explain(policy: Any, w: Window, d: Any, plans: Sequence[str]) -> dict:
    """The model behind the decision of window ``w``: per-layer costs per stage (rows in the
    plan's stage order), the host times kept, and per plan its predicted step and each
    stage's device and host sums a microbatch (the stage costs the longer, ``stage_ms``)."""
    cm = policy.cost_model(w)
    kw = {"schedule": w.schedule, "microbatches": w.microbatches}
    candidates = [w.bounds]
    if d.repartition and d.bounds is not None and len(d.bounds) == w.num_stages:
        candidates.append(tuple(tuple(b) for b in d.bounds))
    candidates += [_bounds(p, cm.num_layers) for p in plans]
    priced = []
    for bounds in dict.fromkeys(candidates):
        if len(bounds) != w.num_stages:
            raise SystemExit(
                f"--plan {split_label(bounds)}: {len(bounds)} stages, the plan in force has "
                f"{w.num_stages}; give a split of {w.num_stages} stages"
            )
        sc = stage_costs(cm, bounds, **kw)
        device, host = [], []
        for s, (a, b) in enumerate(bounds):
            device.append(
                float(cm.fwd_ms[s, a:b].sum() + cm.bwd_ms[s, a:b].sum())
                + float(cm.stage_fwd_ms[s] + cm.stage_bwd_ms[s])
            )
            if cm.host_fwd_ms is not None and cm.host_bwd_ms is not None:
                host.append(float(cm.host_fwd_ms[s, a:b].sum() + cm.host_bwd_ms[s, a:b].sum()))
        priced.append(
            {
                "split": split_label(bounds),
                "step_ms": round(predicted_step_ms(cm, bounds, **kw), 2),
                "stage_ms": [round(f + b, 2) for f, b in zip(sc.fwd_ms, sc.bwd_ms, strict=True)],
                "device_ms": [round(x, 2) for x in device],
                "host_ms": [round(x, 2) for x in host] or None,
                "comm_ms": [round(x, 3) for x in sc.comm_ms],
            }
        )
    rows = {"fwd_ms": cm.fwd_ms, "bwd_ms": cm.bwd_ms}
    if cm.host_fwd_ms is not None and cm.host_bwd_ms is not None:
        rows |= {"host_fwd_ms": cm.host_fwd_ms[:1], "host_bwd_ms": cm.host_bwd_ms[:1]}
    return {
        "reason": d.reason,
        "layers": list(cm.layer_names),
        **{k: np.round(v, 3).tolist() for k, v in rows.items()},
        "plans": priced,
    }


def _impose(policy: object, rec: object) -> None:
    """The recorded move takes effect as one the policy did not ask for."""
    if hasattr(policy, "pending"):
        policy.pending = None
    policy.applied(step=rec.step, pause_ms=rec["pause_ms"], moved_bytes=rec["bytes"])


def _windows(steps: list[dict], every: int) -> list[list[dict]]:
    """The windows the training loop handed its policy: steps up to each multiple of
    ``every``, less the steps a move between windows flushed under the plan before it."""
    out: list[list[dict]] = []
    cur: list[dict] = []
    for i, r in enumerate(steps):
        if cur and [s["layers"] for s in r["stages"]] != [s["layers"] for s in cur[-1]["stages"]]:
            cur = []  # logged under the old plan before the move; no policy saw them
        cur.append(r)
        if (r["step"] + 1) % every == 0:
            if i + 2 < len(steps):  # a window's move needs a step after it
                out.append(cur)
            cur = []
    return out


def build_parser() -> argparse.ArgumentParser:
    """Every AdaptConfig field but ``mode`` as a flag that overrides the log's value (the same
    flags, from the same dataclass, as ``dynpipe train``'s)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--mode", choices=("measured", "adaptive"), default="measured")
    ap.add_argument("--predictor", default=None)
    ap.add_argument(
        "--through",
        action="store_true",
        help="replay the whole log, imposing the recorded moves where the policy differs",
    )
    ap.add_argument(
        "--link-gbs",
        type=float,
        default=None,
        help="link bandwidth (GB/s, the model's float32 bytes) for logs that did not measure "
        "theirs (static and sweep runs); a log's own links event wins",
    )
    ap.add_argument(
        "--time",
        action="store_true",
        help="also print the policy's host time per window (median, p90, max)",
    )
    ap.add_argument(
        "--explain",
        type=int,
        default=None,
        metavar="STEP",
        help="print the model behind the decision at STEP (per-layer costs, host times, "
        "each plan's stages); replays up to it",
    )
    ap.add_argument(
        "--plan",
        action="append",
        default=[],
        metavar="SPLIT",
        help="with --explain: a split (e.g. 4|3|3|4) to price beside the plan in force",
    )
    ap.add_argument(
        "--cuda",
        action="store_true",
        help="open a CUDA context before replaying, as a training rank holds one (GPU hosts)",
    )
    add_config_args(ap, AdaptConfig, flags=ADAPT_FLAGS, exclude=("mode",), unset=True)
    return ap


def _time_line(host_ms: list[tuple[float, float, float | None]]) -> str:
    """Median, p90 and max of the policy's wall and CPU time per window, and the
    predictor's wall time where it ran."""

    def stats(xs: list[float]) -> str:
        a = np.asarray(xs)
        return f"median {np.median(a):.3f} p90 {np.percentile(a, 90):.3f} max {a.max():.3f}"

    out = [
        f"host ms per window ({len(host_ms)} windows): wall {stats([h[0] for h in host_ms])}",
        f"cpu {stats([h[1] for h in host_ms])}",
    ]
    pred = [h[2] for h in host_ms if h[2] is not None]
    if pred:
        out.append(f"predictor wall {stats(pred)}")
    return "; ".join(out)


def _print_explain(step: int, e: dict) -> None:
    print(f"   step {step}: {e['reason']}")
    names = e["layers"]
    for key in ("fwd_ms", "bwd_ms", "host_fwd_ms", "host_bwd_ms"):
        for s, row in enumerate(e.get(key) or []):
            label = f"{key} stage {s}" if not key.startswith("host") else f"{key} (every host)"
            print(
                f"   {label:<22}", " ".join(f"{n}={x:g}" for n, x in zip(names, row, strict=True))
            )
    for p in e["plans"]:
        print(
            f"   {p['split']:<14} step {p['step_ms']} ms; per stage and microbatch: "
            f"cost {p['stage_ms']}, device {p['device_ms']}, host {p['host_ms']}, "
            f"links {p['comm_ms']}"
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    given = {k: v for k, v in config_kwargs(args, AdaptConfig).items() if v is not None}
    overrides = {**given, "mode": args.mode}
    if args.cuda:
        import torch

        torch.zeros(1, device="cuda")  # the context a training rank's process holds
    for path in args.logs:
        print(f"## {path}")
        host_ms: list[tuple[float, float, float | None]] | None = [] if args.time else None
        explained = False
        for d in replay(
            path,
            overrides,
            args.predictor,
            through=args.through,
            link_gbs=args.link_gbs,
            host_ms=host_ms,
            explain=args.explain,
            plans=args.plan,
        ):
            if "explain" in d:
                _print_explain(d["step"], d["explain"])
                explained = True
            else:
                print("  ", d)
        if args.explain is not None and not explained:
            print(
                f"   no decision at step {args.explain} before the replay stopped; explain one "
                "of the steps printed above"
            )
        if host_ms:
            print("  ", _time_line(host_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
