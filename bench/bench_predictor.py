"""Latency of the run-time predictor call: every layer on every device from telemetry.

The controller calls ``predict_layer_times`` every few steps; it must stay well below a
training step. This times it for ``--layers`` layers x ``--devices`` devices (default
200 x 8, target: median under 10 ms) with the static features prepared once, and also
without preparation and with the random-forest baseline for comparison.

    python bench/bench_predictor.py                                # synthetic-data predictor
    python bench/bench_predictor.py --predictor predictor/cpu.json.gz
    python bench/bench_predictor.py --predictor old.json.gz new.json.gz --threads 1  # side by side
    python bench/bench_predictor.py --layers 400 --devices 16 --threads 1

Several predictors given are timed in one run, interleaved call by call, so that their
ratio does not depend on what else the host did meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import pandas as pd


def _layers(n: int, kinds: tuple[str, ...], rng: np.random.Generator) -> pd.DataFrame:
    """A plausible layer table (LayerStats-like columns, and work counts per phase) of ``n``
    layers."""
    from dynpipe.profiler.work import FLOP_KINDS, OP_KINDS

    flops = rng.lognormal(np.log(2e9), 1.5, n)
    params = rng.lognormal(np.log(4e6), 1.5, n).astype(np.int64)
    act = rng.lognormal(np.log(8e6), 1.0, n).astype(np.int64)
    cols = {
        "kind": rng.choice(list(kinds) or ["block"], n),
        "fwd_flops": flops,
        "bwd_flops": 2 * flops,
        "param_bytes": params,
        "in_bytes": act,
        "out_bytes": act,
    }
    for phase, mult in (("fwd", 1.0), ("bwd", 2.0)):
        moved = mult * (params + 2 * act) * rng.uniform(1.0, 3.0, n)
        launches = np.round(mult * rng.integers(1, 40, n))
        byte_mix = rng.dirichlet(np.ones(len(OP_KINDS)), n)
        flop_mix = rng.dirichlet(np.ones(len(FLOP_KINDS)), n)
        cols.update(
            {
                f"{phase}_work_flops": mult * flops,
                f"{phase}_work_bytes": moved,
                f"{phase}_work_launches": launches,
                f"{phase}_work_max_op_bytes": moved / np.sqrt(launches),
                **{f"{phase}_work_bytes_{k}": byte_mix[:, i] for i, k in enumerate(OP_KINDS)},
                **{f"{phase}_work_flops_{k}": flop_mix[:, i] for i, k in enumerate(FLOP_KINDS)},
            }
        )
    return pd.DataFrame(cols)


def _time(calls: dict, *, warmup: int = 5) -> dict[str, tuple[list[float], list[float]]]:
    """Wall and calling-thread CPU milliseconds per call of each ``{key: (fn, repeats)}``,
    interleaved call by call. Single-threaded, CPU time is what a call costs on an idle
    core; wall time adds waiting for other processes on a busy host."""
    for fn, _ in calls.values():
        for _ in range(warmup):
            fn()
    out: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in calls}
    for r in range(max(reps for _, reps in calls.values())):
        for key, (fn, reps) in calls.items():
            if r >= reps:
                continue
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            out[key][1].append((time.thread_time() - c0) * 1e3)
            out[key][0].append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--predictor",
        nargs="+",
        metavar="PATH",
        help="saved predictor(s) (default: fit xgb and rf on synthetic profiles)",
    )
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=None, help="xgboost/sklearn threads")
    ap.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = ap.parse_args()

    from dynpipe.predictor import (
        fit_predictor,
        load_predictor,
        predict_layer_distribution,
        predict_layer_times,
        prepare_layers,
    )
    from dynpipe.predictor.synthetic import synthetic_profiles

    rng = np.random.default_rng(0)
    jobs = {} if args.threads is None else {"n_jobs": args.threads}
    if args.predictor:
        preds = {}
        for path in args.predictor:
            pred = load_predictor(path)
            if args.threads is not None:
                pred.estimator.set_predict_threads(args.threads)
            preds[f"{pred.estimator_name} ({Path(path).name})"] = pred
    else:
        data = synthetic_profiles()
        preds = {
            "xgb": fit_predictor(data, estimator="xgb", params=jobs),
            "rf": fit_predictor(data, estimator="rf", params=jobs),
        }
    load = os.getloadavg()[0]
    print(
        f"{len(os.sched_getaffinity(0))} CPUs, load average {load:.1f}, "
        f"threads {args.threads or 'default'}"
    )
    calls = {}
    for name, pred in preds.items():
        layers = _layers(args.layers, pred.schema.kinds, rng)
        a_f = rng.uniform(0.05, 5.0, args.layers)
        a_b = 2 * a_f
        tel = [
            {k: float(rng.uniform(0, 100)) for k in pred.schema.telemetry}
            for _ in range(args.devices)
        ]
        prepared = prepare_layers(pred, layers, batch_size=32)

        def call(layers=prepared, pred=pred, a_f=a_f, a_b=a_b, tel=tel):
            return predict_layer_times(
                pred,
                layers=layers,
                alone_fwd_ms=a_f,
                alone_bwd_ms=a_b,
                telemetry=tel,
                batch_size=32,
            )

        fwd, _ = call()
        assert fwd.shape == (args.devices, args.layers)
        reps = args.repeats if name.startswith("xgb") else max(20, args.repeats // 10)
        calls[f"{name} prepared"] = (call, reps)
        if name.startswith("xgb"):
            calls[f"{name} unprepared"] = (
                lambda call=call, layers=layers: call(layers=layers),
                reps,
            )
        if getattr(pred.estimator, "spread_booster_", None) is not None:
            # Times and their spread in one call: what the adaptation core uses.
            def dist(layers=prepared, pred=pred, a_f=a_f, a_b=a_b, tel=tel):
                return predict_layer_distribution(
                    pred, layers=layers, alone_fwd_ms=a_f, alone_bwd_ms=a_b, telemetry=tel
                )

            calls[f"{name} with spread"] = (dist, reps)
    results = {}
    for key, (ms, cpu) in _time(calls).items():
        results[key] = {
            "median_ms": statistics.median(ms),
            "p90_ms": float(np.percentile(ms, 90)),
            "median_thread_cpu_ms": statistics.median(cpu),
            "repeats": len(ms),
        }
        print(
            f"{key:<24} {args.layers} layers x {args.devices} devices: "
            f"median {statistics.median(ms):7.3f} ms  p90 {np.percentile(ms, 90):7.3f} ms  "
            f"(thread CPU median {statistics.median(cpu):6.3f} ms)"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "layers": args.layers,
                    "devices": args.devices,
                    "host": platform.node(),
                    "cpu": platform.processor() or platform.machine(),
                    "cpus_available": len(os.sched_getaffinity(0)),
                    "load_average_1min": load,
                    "threads": args.threads,
                    "results": results,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
