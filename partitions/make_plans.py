"""Regenerate the shipped plans: vgg16, resnet50 and gpt at 2, 4 and 8 stages.

    python partitions/make_plans.py                                   # analytic costs
    python partitions/make_plans.py --profile profiles/h100.parquet   # measured costs

Each plan is written to ``partitions/<model>-<stages>.json`` with its cost source in
``meta.costs`` (``analytic`` until GPU profiles exist). The comparison table in
``partitions/README.md`` (between the ``plans`` markers) is rewritten from the same numbers:
our plan against the equal-layer and the parameter-balanced (DeepSpeed default) splits,
all scored by the same simulator on the same costs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = ("vgg16", "resnet50", "gpt")
STAGES = (2, 4, 8)


def profiled_config(name: str, profiles: list[str] | None) -> dict:
    """The model config a profile was measured with (its metadata records it)."""
    from dynpipe.profiler.schema import read_metadata

    for path in profiles or []:
        setup = read_metadata(path).get("setup") or {}
        if isinstance(setup, dict) and name in setup.get("models", {}):
            return dict(setup["models"][name])
    return {}


def costs_for(model, *, stages: int, microbatch: int, args: argparse.Namespace):
    from dynpipe.planner.costs import CostModel

    if args.profile:
        return CostModel.from_profile(
            args.profile,
            model=model.name,
            microbatch_size=microbatch,
            fingerprint=model.fingerprint(),
        ).for_devices(stages)
    return CostModel.from_model(model, microbatch_size=microbatch, num_devices=stages)


def main(argv: list[str] | None = None) -> int:
    from dynpipe.models import get_model
    from dynpipe.planner.make import baseline_plan, make_plan
    from dynpipe.planner.report import replace_section

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", nargs="+", help="profile dataset(s); default: analytic costs")
    ap.add_argument("--batch-size", type=int, default=64, help="samples per step (default 64)")
    ap.add_argument(
        "--memory-gb",
        type=float,
        default=78.0,
        help="memory per device, GiB (default 78: an 80 GB card less its context)",
    )
    ap.add_argument("--out", type=Path, default=HERE, help="output directory")
    args = ap.parse_args(argv)

    rows = []
    for name in MODELS:
        model = get_model(name, **profiled_config(name, args.profile))
        for s in STAGES:
            m = 2 * s  # enough microbatches to keep the 1F1B bubble near (S-1)/(3S-1)
            mb = args.batch_size // m
            costs = costs_for(model, stages=s, microbatch=mb, args=args)
            kw = dict(
                num_stages=s, schedule="1f1b", microbatches=m, memory_bytes=args.memory_gb * 2**30
            )
            plan = make_plan(costs, **kw)
            plan.meta.update(
                batch_size=args.batch_size,
                model_config=model.config,
                generated_by="partitions/make_plans.py",
            )
            plan.validate(model, world_size=s)
            path = plan.save(args.out / f"{name}-{s}.json")
            even = baseline_plan(costs, "even", **kw)
            params = baseline_plan(costs, "parameters", **kw)
            ours = plan.meta["step_ms"]
            rows.append(
                f"| {name} | {s} | {m}×{mb} | "
                f"{'/'.join(str(len(st)) for st in plan.stages)} | "
                f"{'/'.join(str(len(st)) for st in even.stages)} | "
                f"{'/'.join(str(len(st)) for st in params.stages)} | "
                f"{ours:.3f} | {even.meta['step_ms'] / ours:.3f} | "
                f"{params.meta['step_ms'] / ours:.3f} | {plan.meta['bubble']:.1%} | "
                f"{plan.meta['bottleneck_stage']} | "
                f"{max(st.mem_bytes for st in plan.stages) / 2**30:.2f} | "
                f"{'yes' if plan.meta['exhaustive'] else 'no'} |"
            )
            print(f"{path.name}: {plan!r} step {ours:.3f} ms", file=sys.stderr)
    src = plan.meta["costs"]
    if args.profile:
        what = (
            f"measured profile {', '.join(args.profile)} ({src.get('device_name')}, condition none)"
        )
    else:
        what = (
            f"**analytic** roofline ({src['flops_per_s'] / 1e12:g} TFLOP/s, "
            f"{src['mem_bytes_per_s'] / 1e9:g} GB/s, {src['overhead_ms']} ms per layer "
            f"and phase; links {src['link_bandwidth'] / 1e9:g} GB/s + "
            f"{src['link_latency_ms'] * 1e3:g} µs) — not measured"
        )
    table = "\n".join(
        [
            f"Costs: {what}. Batch {args.batch_size} per step, 1F1B, memory limit "
            f"{args.memory_gb:g} GiB per device, AdamW state counted.",
            "",
            "| model | stages | microbatches×size | dp layers/stage | even | parameters | "
            "dp step ms | even / dp | parameters / dp | dp bubble | bottleneck stage | "
            "dp peak GiB | exact |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    replace_section(args.out / "README.md", "plans", table)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    sys.exit(main())
