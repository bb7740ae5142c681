"""Planner benchmark: how fast it plans, and how much faster its plans run.

    python bench/bench_planner.py                 # print, and refresh partitions/README.md
    python bench/bench_planner.py --no-write      # print only

1. Planning time (median of repeats, this machine's CPU) for random 200-layer x 8-stage and
   1000-layer x 64-stage instances with heterogeneous devices, links and memory limits;
   the bottleneck solve alone and the full plan (candidates scored by the simulator).
2. Simulated step time of our plan against the equal-layer split and the parameter-balanced
   split (DeepSpeed's default ``partition_method="parameters"``) for vgg16, resnet50 and gpt
   at 2, 4 and 8 stages, clean and with device 1 slowed 2.4x (what interference does).
   All three are scored by the same simulator on the same costs — analytic until measured
   profiles are given with ``--profile``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dynpipe.planner.costs import CostModel  # noqa: E402
from dynpipe.planner.dp import plan_partition, solve_bottleneck  # noqa: E402
from dynpipe.planner.make import baseline_plan, make_plan  # noqa: E402
from dynpipe.planner.report import replace_section  # noqa: E402


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(
            x.split(":", 1)[1].strip() for x in out.splitlines() if x.startswith("Model name")
        )
        cpus = next(x.split(":", 1)[1].strip() for x in out.splitlines() if x.startswith("CPU(s)"))
        return f"{model}, {cpus} CPUs"
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or platform.machine()


def random_instance(layers: int, stages: int, seed: int) -> tuple[CostModel, float]:
    rng = np.random.default_rng(seed)
    base = rng.lognormal(0.0, 0.6, layers)
    slow = np.ones(stages)
    slow[rng.integers(stages)] = 2.4  # one interfered device
    fwd = base[None, :] * slow[:, None] * rng.uniform(0.9, 1.1, (stages, layers))
    cm = CostModel(
        model=f"random{layers}",
        layer_names=tuple(f"l{i}" for i in range(layers)),
        fwd_ms=fwd,
        bwd_ms=2.0 * fwd,
        param_bytes=rng.integers(1 << 18, 1 << 24, layers).astype(float),
        out_bytes=rng.integers(1 << 16, 1 << 22, layers).astype(float),
        act_bytes=rng.integers(1 << 16, 1 << 22, layers).astype(float),
        opt_mult=np.full(layers, 2.0),
        buffer_bytes=np.zeros(layers),
        bandwidth=np.full(stages - 1, 25e9),
        latency_ms=np.full(stages - 1, 0.02),
    )
    # A memory limit that binds: 1.5x an equal share of the static state and activations.
    mem = 1.5 * float(cm.static_bytes.sum() + stages * cm.act_bytes.sum()) / stages
    return cm, mem


def time_planner(layers: int, stages: int, repeats: int) -> dict:
    cm, mem = random_instance(layers, stages, seed=layers + stages)
    m = 2 * stages
    solve, full = [], []
    res = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        solve_bottleneck(cm, num_stages=stages, microbatches=m, memory_bytes=mem)
        t1 = time.perf_counter()
        res = plan_partition(cm, num_stages=stages, microbatches=m, memory_bytes=mem)
        t2 = time.perf_counter()
        solve.append((t1 - t0) * 1e3)
        full.append((t2 - t1) * 1e3)
    assert res is not None
    return {
        "layers": layers,
        "stages": stages,
        "microbatches": m,
        "solve_ms": statistics.median(solve),
        "plan_ms": statistics.median(full),
        "candidates": res.candidates,
        "exhaustive": res.exhaustive,
        "repeats": repeats,
    }


def compare(
    models: list[str], stages: list[int], batch: int, profile: list[str] | None
) -> list[dict]:
    from dynpipe.models import get_model

    rows = []
    for name in models:
        model = get_model(name)
        for s in stages:
            m = 2 * s
            mb = batch // m
            if profile:
                base = CostModel.from_profile(
                    profile, model=name, microbatch_size=mb, fingerprint=model.fingerprint()
                ).for_devices(s)
            else:
                base = CostModel.from_model(model, microbatch_size=mb, num_devices=s)
            for label, factors in (
                ("clean", [1.0] * s),
                ("dev1 x2.4", [1.0, 2.4] + [1.0] * (s - 2)),
            ):
                cm = base.with_slowdown(factors)
                kw = dict(num_stages=s, schedule="1f1b", microbatches=m)
                ours = make_plan(cm, **kw)
                even = baseline_plan(cm, "even", **kw)
                params = baseline_plan(cm, "parameters", **kw)
                rows.append(
                    {
                        "model": name,
                        "stages": s,
                        "condition": label,
                        "dp": ours.meta["step_ms"],
                        "even": even.meta["step_ms"],
                        "parameters": params.meta["step_ms"],
                        "dp_split": "/".join(str(len(x)) for x in ours.stages),
                        "exhaustive": ours.meta["exhaustive"],
                        "source": cm.meta.get("source"),
                    }
                )
    return rows


def markdown(timing: list[dict], rows: list[dict], machine: str, load: float) -> str:
    lines = [
        f"Measured on {machine} (load average {load:.1f} while measuring: the machine is "
        f"shared); Python {platform.python_version()}, numpy {np.__version__}; "
        f"{time.strftime('%Y-%m-%d')}. Regenerate with `python bench/bench_planner.py`.",
        "",
        "Planning time (median; random heterogeneous instance, one device 2.4x slower, "
        "binding memory limit, 1F1B with 2 x stages microbatches):",
        "",
        "| layers × stages | bottleneck solve ms | full plan ms | candidates simulated | exact |",
        "|---|---|---|---|---|",
    ]
    for t in timing:
        lines.append(
            f"| {t['layers']} × {t['stages']} | {t['solve_ms']:.1f} | {t['plan_ms']:.1f} | "
            f"{t['candidates']} | {'yes' if t['exhaustive'] else 'no'} |"
        )
    src = rows[0]["source"] if rows else "?"
    lines += [
        "",
        f"Simulated step time (costs: {src}; batch 64, 1F1B, 2 x stages microbatches). "
        "Ratios above 1 mean the baseline is slower than our plan:",
        "",
        "| model | stages | condition | dp split | dp step ms | even / dp | parameters / dp | exact |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['stages']} | {r['condition']} | {r['dp_split']} | "
            f"{r['dp']:.3f} | {r['even'] / r['dp']:.3f} | {r['parameters'] / r['dp']:.3f} | "
            f"{'yes' if r['exhaustive'] else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--models", default="vgg16,resnet50,gpt")
    ap.add_argument("--stages", default="2,4,8")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--profile", nargs="+", help="measured profile(s) instead of analytic costs")
    ap.add_argument("--no-write", action="store_true", help="do not touch partitions/README.md")
    args = ap.parse_args(argv)

    machine = cpu_name()
    load = os.getloadavg()[0]
    timing = [time_planner(200, 8, args.repeats), time_planner(1000, 64, max(3, args.repeats // 2))]
    for t in timing:
        print(
            f"{t['layers']}x{t['stages']}: bottleneck {t['solve_ms']:.1f} ms, plan "
            f"{t['plan_ms']:.1f} ms ({t['candidates']} candidates, exact={t['exhaustive']})"
        )
    rows = compare(
        args.models.split(","),
        [int(x) for x in args.stages.split(",")],
        args.batch_size,
        args.profile,
    )
    for r in rows:
        print(
            f"{r['model']:9s} S={r['stages']} {r['condition']:10s} dp {r['dp']:.3f} ms "
            f"[{r['dp_split']}]  even/dp {r['even'] / r['dp']:.3f}  "
            f"parameters/dp {r['parameters'] / r['dp']:.3f}"
        )
    text = markdown(timing, rows, machine, load)
    if not args.no_write:
        replace_section(ROOT / "partitions" / "README.md", "bench", text)
        print("updated partitions/README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
