"""Oracle benchmark: every system against the best of every static split, same interferer.

For one configuration and interference scenario it runs, one after the other on the same
GPUs:

1. ``sweep``: one launch that holds every split in turn (``--adapt sweep``; two stages:
   every split; more: the ``sweep_plans`` best under the measured per-layer costs), first
   with the devices clean, then again with the interferer running (it starts when the first
   pass ends). Each split is held ``sweep_windows`` windows; the first settles (a split new
   to a device tunes its kernels), the rest are measured. The oracle of a phase is the
   split with the lowest mean step time in the matching pass; the clean pass also serves
   the phase after the interference.
2. ``static`` (the initial plan throughout), ``measured``, ``adaptive`` and ``restart``, each
   with the interferer starting at ``onset`` and stopping at ``end``.
3. ``resweep`` (opt-in, where ``--systems`` lists it): the sweep launched again. The report
   then gives, per phase, that launch's best split and its time of the oracle's split: how
   far two launches of one split agree at this size, the floor under every ratio here.

``report`` reads the raw logs and writes, per phase (clean, interference, after), the
oracle's split and step time and every system's phase mean step time (from wall-clock step
ends, so adaptation, pauses and relaunches count, from the phase's first step on), its
ratio to the oracle, and that ratio's two factors (``_held_ms``: the splits it held, and how
its launch ran them):

    python bench/oracle.py run --config vgg16-b128 --interferer gemm --stage 1 -o DIR
    python bench/oracle.py report DIR -o bench/results/oracle-vgg16-b128-gemm-s1.json

Phase boundaries skip ``warmup`` steps at the start (process start, cuDNN autotuning).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from dynpipe.planner.plan import split_label  # plain data: no torch for the orchestrator

# Sizes at which the GPUs, not kernel launches or the host, bound the step (docs/results/oracle.md).
CONFIGS: dict[str, list[str]] = {
    "vgg16-b128": ["--model", "vgg16", "--model-arg", "image_size=224", "--model-arg",
                   "num_classes=1000", "--batch-size", "128", "--microbatches", "8"],
    "vgg16-b256": ["--model", "vgg16", "--model-arg", "image_size=224", "--model-arg",
                   "num_classes=1000", "--batch-size", "256", "--microbatches", "8"],
    "resnet50-b256": ["--model", "resnet50", "--model-arg", "image_size=224", "--model-arg",
                      "num_classes=1000", "--batch-size", "256", "--microbatches", "8"],
    # 64 images a microbatch: at 32 (b256) the later stages' small kernels wait on their
    # host, and one split's stage time switched between ~45 and ~85 ms within a launch.
    "resnet50-b512": ["--model", "resnet50", "--model-arg", "image_size=224", "--model-arg",
                      "num_classes=1000", "--batch-size", "512", "--microbatches", "8"],
    # 128 images a microbatch: at 64 (b512) on the H200s the later stage's host fell behind
    # its GPU (torch profiler, 2|16: 236 ms of host time against 168 of device time a step;
    # the GPU 16-78% busy), and one split measured 148 ms in one launch and 206 in another.
    "resnet50-b1024": ["--model", "resnet50", "--model-arg", "image_size=224", "--model-arg",
                       "num_classes=1000", "--batch-size", "1024", "--microbatches", "8"],
    "gpt-w2048": ["--model", "gpt", "--model-arg", "depth=12", "--model-arg", "width=2048",
                  "--model-arg", "heads=16", "--model-arg", "seq_len=1024",
                  "--batch-size", "32", "--microbatches", "8"],
    "bert-w1024": ["--model", "bert", "--model-arg", "depth=12", "--model-arg", "width=1024",
                   "--model-arg", "heads=16", "--model-arg", "seq_len=512",
                   "--batch-size", "64", "--microbatches", "8"],
    # 16 sequences a microbatch: at 8 (b64) the step swung 80-143 ms within a launch and
    # 88-106 ms between launches of one split, too much for a phase comparison.
    "bert-w1024-b128": ["--model", "bert", "--model-arg", "depth=12", "--model-arg",
                        "width=1024", "--model-arg", "heads=16", "--model-arg", "seq_len=512",
                        "--batch-size", "128", "--microbatches", "8"],
    # 32 sequences a microbatch: at 16 (b128) a clean launch of 7|7 on 2 x H200 ran 118-160 ms
    # a step, the stages' forward times trading 30 <-> 58 ms from step to step while one
    # interferer held them steady (177-182), and launches of one split differed by 8-10%.
    "bert-w1024-b256": ["--model", "bert", "--model-arg", "depth=12", "--model-arg",
                        "width=1024", "--model-arg", "heads=16", "--model-arg", "seq_len=512",
                        "--batch-size", "256", "--microbatches", "8"],
    "mlp-cpu": ["--model", "mlp", "--model-arg", "depth=8", "--model-arg", "width=384",
                "--model-arg", "in_features=384", "--batch-size", "64", "--microbatches", "4"],
}  # fmt: skip
SYSTEMS = ("static", "measured", "adaptive", "restart")


def _scenario(path: Path, events: list[tuple[int, str, str, int]]) -> Path:
    """events: (step, action, kind, stage)."""
    lines = ['name = "oracle benchmark"']
    for step, action, kind, stage in events:
        lines.append("[[events]]")
        lines.append(f'step = {step}\naction = "{action}"\nstage = {stage}')
        if action == "start":
            lines.append(f'kind = "{kind}"\nintensity = 1.0\ncount = 1')
            if kind == "emulate":
                lines.append("factor = 3.0")
    path.write_text("\n".join(lines) + "\n")
    return path


def _train(args: list[str], log: Path, timeout_s: float) -> int:
    cmd = [sys.executable, "-m", "dynpipe", "train", *args, "--log", str(log), "--no-progress"]
    t0 = time.time()
    with open(log.with_suffix(".out"), "w") as out:
        try:
            rc = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    print(f"  {log.stem}: exit {rc} in {time.time() - t0:.0f}s", flush=True)
    return rc


def run(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = CONFIGS[a.config]
    n_layers = _num_layers(cfg)
    stages = [int(s) for s in a.stage.split(",")]
    kinds = a.interferer.split(",")
    common = [*cfg, "--nproc", str(a.nproc), "--device", a.device, "--optimizer", "adamw",
              "--lr", "1e-4", "--monitor-every", str(a.monitor_every), "--timeout", "300",
              "--sweep-windows", str(a.sweep_windows), "--sweep-plans", str(a.sweep_plans)]  # fmt: skip
    if a.device == "cpu":
        common += ["--pin-cores"]
    if a.device == "cuda":
        common += ["--bf16", "--device-batches", "4"]
    meta = {"config": a.config, "args": cfg, "interferer": kinds, "stages": stages,
            "nproc": a.nproc, "onset": a.onset, "end": a.end, "steps": a.steps,
            "warmup": a.warmup, "monitor_every": a.monitor_every,
            "sweep_windows": a.sweep_windows}  # fmt: skip
    # The sweep: every split of the clean pass, then the interferer on for the second pass.
    # The first pass holds the launch's first split before its ``plans`` visits (the last of
    # them that split again, warmed up: ``SweepPolicy``).
    plans = n_layers - 1 if a.nproc == 2 else a.sweep_plans
    per_pass = plans * a.sweep_windows * a.monitor_every
    onset = (plans + 1) * a.sweep_windows * a.monitor_every
    meta["sweep_onset"] = onset
    (out / "oracle.json").write_text(json.dumps(meta, indent=1) + "\n")
    sw_events = [(onset, "start", k, s) for k, s in zip(kinds, stages, strict=True)]
    sweep_scn = _scenario(out / "sweep.toml", sw_events)
    sweep_args = [*common, "--adapt", "sweep", "--scenario", str(sweep_scn), "--steps",
                  str(onset + per_pass)]  # fmt: skip
    if "sweep" in a.systems:
        _train(sweep_args, out / "sweep.jsonl", a.timeout)
    ev = [(a.onset, "start", k, s) for k, s in zip(kinds, stages, strict=True)]
    ev += [(a.end, "stop", k, s) for k, s in zip(kinds, stages, strict=True)]
    scn = _scenario(out / "scenario.toml", ev)
    if a.plan_profile:
        # Every system starts from the split ``dynpipe plan`` picks from the profile, as a
        # user who profiled first would start (``static`` then holds that split throughout).
        meta["initial_split"] = _plan_from_profile(cfg, a, out / "initial-plan.json")
        (out / "oracle.json").write_text(json.dumps(meta, indent=1) + "\n")
        common += ["--plan", str(out / "initial-plan.json")]
    for system in a.systems:
        if system == "sweep":
            continue
        if system == "resweep":  # the same sweep again, where the list puts it
            _train(sweep_args, out / "resweep.jsonl", a.timeout)
            continue
        extra = ["--adapt", system, "--scenario", str(scn), "--steps", str(a.steps)]
        if system in ("adaptive", "restart") and a.predictor:
            extra += ["--predictor", a.predictor]
        if system == "restart":
            extra += ["--save-dir", str(Path(a.ckpt or out) / f"ckpt-{a.config}")]
        _train([*common, *extra], out / f"{system}.jsonl", a.timeout)
    return 0


def _plan_from_profile(cfg: list[str], a: argparse.Namespace, path: Path) -> list[int]:
    """``dynpipe plan`` of the configuration on ``a.plan_profile``'s measured layer times
    (clean), written to ``path``; the split it picked, in layers per stage."""
    pairs = list(zip(cfg[::2], cfg[1::2], strict=True))  # every config is flag-value pairs
    opts = dict(pairs)
    sets = [x for k, v in pairs if k == "--model-arg" for x in ("--set", v)]
    cmd = [sys.executable, "-m", "dynpipe", "plan", "--model", opts["--model"], *sets,
           "--stages", str(a.nproc), "--batch-size", opts["--batch-size"],
           "--microbatches", opts["--microbatches"], "--profile", a.plan_profile,
           "-o", str(path)]  # fmt: skip
    if a.device == "cuda":
        cmd += ["--bf16"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=300)
    stages = json.loads(path.read_text())["stages"]
    split = [s["stop"] - s["start"] for s in stages]
    label = split_label([(s["start"], s["stop"]) for s in stages])
    print(f"  initial plan from {a.plan_profile}: {label}", flush=True)
    return split


def _num_layers(cfg: list[str]) -> int:
    from dynpipe.runtime.cli import config_from_args, register

    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    register(sub)
    args = p.parse_args(["train", *cfg])
    from dynpipe.runtime.train import build_model_and_data

    model, _ = build_model_and_data(config_from_args(args))
    return len(model)


# ---- report ---------------------------------------------------------------------------
def _read(path: Path) -> tuple[list[dict], list[dict]]:
    from dynpipe.runtime.records import read_dicts

    recs = read_dicts(path)
    steps = {r["step"]: r for r in recs if r["type"] == "step"}  # a relaunch rewrites none
    events = [r for r in recs if r["type"] == "event"]
    return [steps[k] for k in sorted(steps)], events


def _split(rec: dict) -> str:
    return split_label([s["layers"] for s in rec["stages"]])


def _sweep(path: Path, onset: int, warmup: int, every: int) -> dict[str, dict[str, float]]:
    """Mean wall-clock time per step of every split held in each pass
    (``sweep_split_ms``)."""
    from dynpipe.analysis.metrics import sweep_split_ms

    steps, events = _read(path)
    moved = {e["step"] for e in events if e["event"] == "repartition"}
    held = [(r["step"], r["t_end"], _split(r)) for r in steps]
    return sweep_split_ms(held, moved, onset=onset, warmup=warmup, every=every)


def _phase_ms(steps: list[dict], a: int, b: int) -> float | None:
    """Mean wall-clock time per step over steps [a, b): from the end of step a-1 to the end
    of step b-1, so everything between steps (pauses, relaunches) counts."""
    by = {r["step"]: r for r in steps}
    if a - 1 not in by or b - 1 not in by or "t_end" not in by[b - 1]:
        return None
    return (by[b - 1]["t_end"] - by[a - 1]["t_end"]) * 1e3 / (b - a)


def _held_ms(steps: list[dict], a: int, b: int, table: dict[str, float]) -> float | None:
    """The sweep's time per step of the splits a run held over steps [a, b), step-weighted:
    what the phase would have cost had every step run as fast as the sweep ran its split.
    None where a step is missing or its split was not swept (a bounded 4-stage sweep).

    It splits a system's ratio to the oracle in two exact factors: ``choice`` (held over
    oracle: 1 when it held the oracle's split all phase) and ``execution`` (its phase time
    over held: pauses, the policy's own time, and how its launch ran the same splits against
    the sweep's launch). A miss with choice near 1 is not the controller's choice of split."""
    by = {r["step"]: r for r in steps}
    held = []
    for s in range(a, b):
        r = by.get(s)
        ms = table.get(_split(r)) if r is not None else None
        if ms is None:
            return None
        held.append(ms)
    return float(np.mean(held)) if held else None


def report(a: argparse.Namespace) -> int:
    d = Path(a.dir)
    meta = json.loads((d / "oracle.json").read_text())
    every, warm = meta["monitor_every"], meta["warmup"]
    from dynpipe.analysis.metrics import oracle_phases
    from dynpipe.runtime.records import find_log, read_dicts

    # A run's folder holds plain logs, committed ones are compressed (``sweep.jsonl.gz``):
    # find_log and read_log take either.
    sweep = _sweep(d / "sweep.jsonl", meta["sweep_onset"], warm, every)
    again = (
        _sweep(d / "resweep.jsonl", meta["sweep_onset"], warm, every)
        if find_log(d, "resweep") is not None
        else None
    )
    phases = oracle_phases(meta)
    device = None
    out: dict[str, Any] = {"config": meta, "phases": {}}
    logs = {s: p for s in SYSTEMS if (p := find_log(d, s)) is not None}
    runs = {s: _read(p) for s, p in logs.items()}
    for p in logs.values():
        head = next(r for r in read_dicts(p) if r["type"] == "header")
        device = device or head.get("env", {}).get("device_name")
        out.setdefault("revision", head.get("revision"))
    if a.revision:
        # The runs' headers name the git metadata of the copy they ran in, which can be
        # older than its tree: both are kept.
        out["logged_revision"], out["revision"] = out.get("revision"), a.revision
    out["device"] = device
    for ph, (lo, hi) in phases.items():
        table = sweep["interference" if ph == "interference" else "clean"]
        if not table:
            continue
        best = min(table, key=table.get)
        entry: dict[str, Any] = {
            "oracle": {"split": [int(x) for x in best.split("|")], "ms": round(table[best], 3)},
            "splits": {k: round(v, 3) for k, v in sorted(table.items(), key=lambda x: x[1])},
            "systems": {},
        }
        table2 = again["interference" if ph == "interference" else "clean"] if again else None
        if table2:
            # The sweep launched again: does this size hold its oracle from launch to launch?
            best2 = min(table2, key=table2.get)
            entry["repeat"] = {
                "split": [int(x) for x in best2.split("|")],
                "ms": round(table2[best2], 3),
                "oracle_split_ms": round(table2[best], 3) if best in table2 else None,
            }
        for s, (steps, _ev) in runs.items():
            ms = _phase_ms(steps, lo, hi)
            if ms is None:
                continue
            got = {"ms": round(ms, 3), "ratio": round(ms / table[best], 4)}
            held = _held_ms(steps, lo, hi, table)
            if held is not None:
                got |= {"held_ms": round(held, 3), "choice": round(held / table[best], 4),
                        "execution": round(ms / held, 4)}  # fmt: skip
            entry["systems"][s] = got
        out["phases"][ph] = entry
    text = json.dumps(out, indent=1)
    if a.output:
        Path(a.output).write_text(text + "\n")
    for ph, e in out["phases"].items():
        sysr = "  ".join(
            f"{k} {v['ms']:.1f} ({v['ratio']:.3f}"
            + (f" = {v['choice']:.3f} x {v['execution']:.3f}" if "choice" in v else "")
            + ")"
            for k, v in e["systems"].items()
        )
        print(f"{ph:12s} oracle {e['oracle']['split']} {e['oracle']['ms']:.1f} ms | {sysr}")
        if "repeat" in e:
            rp, same = e["repeat"], e["repeat"]["oracle_split_ms"]
            again_txt = f"{same:.1f} ms ({same / e['oracle']['ms']:.3f})" if same else "not swept"
            print(
                f"{'':12s} sweep again: best {rp['split']} {rp['ms']:.1f} ms; "
                f"the oracle's split {again_txt}"
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--config", choices=sorted(CONFIGS), required=True)
    r.add_argument("--interferer", default="gemm", help="kind, or kinds comma-separated")
    r.add_argument("--stage", default="1", help="stage, or stages comma-separated")
    r.add_argument("--nproc", type=int, default=2)
    r.add_argument("--device", default="cuda")
    r.add_argument("--steps", type=int, default=160)
    r.add_argument("--onset", type=int, default=50)
    r.add_argument("--end", type=int, default=120)
    r.add_argument("--warmup", type=int, default=10)
    r.add_argument("--monitor-every", type=int, default=5)
    r.add_argument("--sweep-windows", type=int, default=3)
    r.add_argument("--sweep-plans", type=int, default=12)
    r.add_argument("--systems", default="sweep,static,measured,adaptive,restart")
    r.add_argument("--predictor", default=None)
    r.add_argument("--ckpt", default=None, help="where the restart baseline checkpoints")
    r.add_argument(
        "--plan-profile",
        default=None,
        help="profile dataset: every system starts from the split `dynpipe plan` picks from "
        "its measured layer times (default: the even split)",
    )
    r.add_argument("--timeout", type=float, default=900)
    r.add_argument("-o", "--out", required=True)
    p = sub.add_parser("report")
    p.add_argument("dir")
    p.add_argument("-o", "--output", default=None)
    p.add_argument(
        "--revision",
        default=None,
        help="the commit the runs ran, where their headers name another (a device copy run "
        "without DYNPIPE_REVISION reads the copy's own, possibly older, git metadata)",
    )
    a = ap.parse_args(argv)
    if a.cmd == "run":
        a.systems = a.systems.split(",")
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        return run(a)
    from dynpipe.errors import UserError

    try:
        return report(a)
    except UserError as e:  # a folder without a sweep log: one line, not a traceback
        print(f"oracle.py report: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
