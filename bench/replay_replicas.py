"""Replay the replica policy over a recorded data x pipeline run, and time its decisions.

Rebuilds, from a replicated run's log, every window the training loop handed its
``ReplicaPolicy`` (each replica's step timings, per-layer timings and telemetry; ``Window``
as the loop builds it), builds the policy the run used (``make_policy`` with the log's
configuration, predictor and measured link), and feeds it the windows in order. The moves
the run made (``reshare``, ``repartition``, ``reshape``) are imposed as they were recorded,
so every window replays under the plan the run held, whatever the policy now decides.
Each window's decision is printed with the host time ``observe`` took here and the
``decide_ms`` the run logged for it.

A static run (no policy of its own) is priced with ``--policy measured|adaptive``: that
policy, with live reshapes allowed, reads the run's windows and its options are printed
with ``--shapes``, so what it would predict for every shape can be set beside the static
runs of the other shapes in the same session.

Free device memory is not in the log: ``--device-mib`` rebuilds it from the telemetry's
memory in use (a device of that many MiB), so the policy's memory limits run as on the
device; without it the windows carry none (as on CPU).

    python bench/replay_replicas.py analysis/logs/dp-pp-h200x4-6bdb40a/vgg16-adaptive.jsonl \
        [--device-mib 143771] [--repeat 3] [--profile 30]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dynpipe.runtime.adapt.config import AdaptConfig
from dynpipe.runtime.adapt.make import make_policy
from dynpipe.runtime.adapt.policy import Decision
from dynpipe.runtime.adapt.window import Window
from dynpipe.runtime.config import TrainConfig
from dynpipe.runtime.records import read_log
from dynpipe.runtime.train import build_model_and_data

__all__ = ["Replayed", "replay", "windows"]

_MOVES = ("reshare", "repartition", "reshape")


@dataclass
class Replayed:
    """One window: what the policy decided here and in how long, and what the run logged."""

    window: Window
    decision: Decision | None
    ms: float  # host time of ``observe`` here
    logged: dict[str, Any] | None  # the run's ``decision`` event for this window
    # With ``shapes``: the options the decision weighed, each with its predicted time per
    # batch (``ReplicaPolicy.priced``).
    priced: list[tuple[float, Any]] | None = None


def windows(path: Path, *, device_mib: float | None = None) -> Iterator[tuple[Window, int]]:
    """The log's windows in order, each with the number of its last step.

    A window is the steps up to a multiple of ``monitor_every``, less those flushed under
    the plan before a move (the loop logs them before layers move; no policy reads them);
    the last windows, whose move would have no step left, are not handed to the policy."""
    log = read_log(path)
    conf = log.headers[0].config
    schedule = log.headers[0].plan.get("schedule") or "1f1b"
    every, total = conf["adapt"]["monitor_every"], conf["steps"]
    layers = {r.step: r.to_dict() for r in log.layer_times}
    tels = {r.step: [_nan(d) for d in r.devices] for r in log.telemetry}
    steps = [r.to_dict() for r in log.steps]
    cur: list[dict] = []
    for r in steps:
        if cur and _plan_of(r) != _plan_of(cur[-1]):
            cur = []
        cur.append(r)
        if (r["step"] + 1) % every == 0:
            if r["step"] + 2 < total:
                got = _window(cur, schedule, layers.get(r["step"]), tels.get(r["step"]), device_mib)
                yield got, r["step"]
            cur = []


def _nan(d: dict[str, Any]) -> dict[str, float]:
    return {k: float("nan") if v is None else float(v) for k, v in d.items()}


def _plan_of(rec: dict) -> tuple:
    return tuple(
        (rep["microbatches"], rep["dropped"], tuple(tuple(s["layers"]) for s in rep["stages"]))
        for rep in rec["replicas"]
    )


def _window(
    recs: list[dict],
    schedule: str,
    layers: dict | None,
    tel: list[dict[str, float]] | None,
    device_mib: float | None,
) -> Window:
    reps = recs[-1]["replicas"]
    pp = len(reps[0]["stages"])
    memory = None
    if device_mib is not None and tel is not None:
        # What ``_free_bytes`` read on the device, as far as telemetry tells it.
        memory = [(device_mib - t["tel_mem_used_mb"]) * 2**20 for t in tel]
    rl = None
    if layers is not None and layers.get("replicas"):
        rl = [dict(x) or None for x in layers["replicas"]]
    return Window.from_records(
        recs,
        bounds=[s["layers"] for s in reps[0]["stages"]],
        ranks=[s["rank"] % pp for s in reps[0]["stages"]],
        microbatches=reps[0]["microbatches"],
        schedule=schedule,
        layers=layers,
        telemetry=tel,
        memory_bytes=memory,
        shares=[rep["microbatches"] for rep in reps],
        dropped=[rep["replica"] for rep in reps if rep["dropped"]],
        replica_layers=rl,
    )


def replay(
    path: Path,
    *,
    device_mib: float | None = None,
    profile: cProfile.Profile | None = None,
    shapes: bool = False,
    mode: str | None = None,
    link_gbs: float | None = None,
) -> list[Replayed]:
    """Every window of ``path`` through a fresh policy built as the run built its own
    (``shapes``: with the options each decision weighed, priced; ``mode``: that policy
    instead, reshapes allowed, as for a static run; ``link_gbs``: the link's measured
    bandwidth, where the log and its session have none)."""
    log = read_log(path)
    header = log.headers[0]
    conf = header.config
    dp = int(header.plan.get("dp", 1) or 1)
    adapt = AdaptConfig.from_dict(conf["adapt"])
    if mode is not None:
        adapt = dataclasses.replace(adapt, mode=mode, reshape=True)
    if dp < 2 and not adapt.reshape:
        # One pipeline under --reshape is a run of one replica to the replica policy.
        raise SystemExit(f"{path}: one pipeline (dp 1); replay it with bench/replay_controller.py")
    cfg = TrainConfig.of_logged_model(conf, adapt)
    model, _ = build_model_and_data(cfg)
    links = [{"bandwidth_gbs": link_gbs}] if link_gbs else log.events("links")
    if not links and mode is not None:
        # A static run measures no link: the runs of its session beside it did.
        links = [e for sib in sorted(path.parent.glob("*.jsonl*")) for e in _links(sib)][:1]
        if not links:
            raise SystemExit(f"{path}: no link measured in its session: pass --link-gbs")
    wire = 0.5 if conf.get("bf16") else 1.0
    predictor = conf.get("predictor")
    if predictor and not Path(predictor).exists():
        # A path relative to the repository the run was launched from.
        predictor = str(Path(__file__).resolve().parents[1] / predictor)
        if not Path(predictor).exists():
            raise SystemExit(f"{path}: predictor {conf['predictor']} not found")
    policy = make_policy(
        adapt,
        model=model,
        microbatch_size=conf["batch_size"] // (dp * conf["microbatches"]),
        num_ranks=len(header.plan["stages"]),
        predictor=predictor,
        dp=dp,
        replicas=True,
        link_bandwidth=links[0]["bandwidth_gbs"] * 1e9 / wire if links else None,
    )
    # Decisions logged before they named their window carry no timing to set beside ours.
    logged = {
        e["window_step"]: e.to_dict() for e in log.events("decision") if "window_step" in e.fields
    }
    moves = {e.step: e for e in log.events(*_MOVES)}
    out: list[Replayed] = []
    for w, last in windows(path, device_mib=device_mib):
        t0 = time.perf_counter()
        if profile is not None:
            profile.enable()
        d = policy.observe(w)
        if profile is not None:
            profile.disable()
        ms = (time.perf_counter() - t0) * 1e3
        rec = logged.get(last)
        # A sweep's policy weighs no options: nothing to price.
        priced = (
            policy.priced(w) if shapes and d is not None and hasattr(policy, "priced") else None
        )
        out.append(Replayed(window=w, decision=d, ms=ms, logged=rec, priced=priced))
        # The run's move, if it made one from this window, takes effect as it did.
        move = moves.get(rec["step"]) if rec is not None and rec.get("repartition") else None
        if move is not None:
            nbytes = move.get("bytes") or 0
            policy.applied(step=move.step, pause_ms=move["pause_ms"], moved_bytes=nbytes)
    return out


def _links(path: Path) -> list[Any]:
    return read_log(path).events("links")


def _shapes(priced: list[tuple[float, Any]]) -> str:
    """Per shape, its best option's predicted ms per batch (the configuration in force,
    listed first, marked ``now``)."""
    now = priced[0][1]
    best: dict[tuple[int, int], tuple[float, Any]] = {}
    for ms, c in priced:
        if c.shape not in best or ms < best[c.shape][0]:
            best[c.shape] = (ms, c)
    parts = [f"now {priced[0][0]:.1f}"]
    for (d, p), (ms, c) in sorted(best.items(), key=lambda x: x[1][0]):
        mark = "=" if c == now else ""
        parts.append(f"{d}x{p} {ms:.1f}{mark} ({c!r})")
    return "; ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument(
        "--device-mib",
        type=float,
        default=None,
        help="device memory in MiB: free memory rebuilt from the telemetry (H200: 143771)",
    )
    ap.add_argument("--repeat", type=int, default=1, help="replays per log (times: the median)")
    ap.add_argument(
        "--profile", type=int, default=0, help="print the top N functions by cumulative time"
    )
    ap.add_argument("--quiet", action="store_true", help="no per-window lines")
    ap.add_argument(
        "--policy",
        choices=("measured", "adaptive"),
        default=None,
        help="replay with this policy (reshapes allowed) instead of the run's own: a static "
        "run's windows priced",
    )
    ap.add_argument(
        "--link-gbs",
        type=float,
        default=None,
        help="the link's measured GB/s (a links event's bandwidth_gbs), for a static run whose "
        "session measured none",
    )
    ap.add_argument(
        "--shapes",
        action="store_true",
        help="under each decision, every shape's best option and its predicted ms per batch",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for path in args.logs:
        prof = cProfile.Profile() if args.profile else None
        kw = {"device_mib": args.device_mib, "mode": args.policy, "link_gbs": args.link_gbs}
        runs = [replay(path, shapes=args.shapes, **kw) for _ in range(args.repeat)]
        if prof is not None:
            replay(path, profile=prof, **kw)
        ms = np.median([[r.ms for r in run] for run in runs], axis=0)
        print(f"## {path}: {len(ms)} windows")
        for r, t in zip(runs[0], ms, strict=True):
            if args.quiet:
                break
            d = r.decision
            got = "settle" if d is None else ("MOVE " if d.repartition else "") + d.reason
            was = r.logged["decide_ms"] if r.logged else None
            print(f"  step {r.window.step:4d} {r.window!r}: {t:7.2f} ms (run {was}) {got}")
            if r.priced:
                print(f"    measured {r.window.median_step_ms:.2f} ms; {_shapes(r.priced)}")
        busy = [t for r, t in zip(runs[0], ms, strict=True) if r.decision is not None]
        if busy:
            print(
                f"  observe ms over {len(busy)} deciding windows: median {np.median(busy):.2f}"
                f" p90 {np.percentile(busy, 90):.2f} max {max(busy):.2f}"
            )
        if prof is not None:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
