"""``dynpipe plan``: the step-time-optimal split of a model over pipeline stages.

    dynpipe plan --model gpt --stages 4 -o gpt-4.json                   # analytic costs
    dynpipe plan --model vgg16 --stages 2 --slowdown 1,2.4               # device 1 2.4x slower
    dynpipe plan --model gpt --set seq_len=512 --stages 4 \\
        --profile profiles/h200-bs32.parquet --conditions none,none,gemm@0.5x1,none \\
        --memory-gb 16                 # measured costs (seq_len=512: the gpt that was profiled)
    dynpipe plan --model gpt --set seq_len=512 --stages 4 \\
        --profile profiles/h200-bs32.parquet --predictor predictor/h200.json.gz \\
        --telemetry now.json           # predicted slowdowns; now.json: a tel_* window per stage
    dynpipe plan --model gpt --stages 4 --slowdown 2:3 \\
        --current partitions/gpt-4.json --migration-ms-per-gb 5         # pay for moving layers
    dynpipe plan --model vgg16 --gpus 4 --batch-size 256 --link-gbs 300 \\
        -o partitions/vgg16-4gpu.json          # the dp x pp shape and split for 4 GPUs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from dynpipe.planner.plan import SCHEDULES

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="split a model into pipeline stages (exact DP + schedule simulator)",
        description="Compute the split of a model into pipeline stages that minimises the "
        "simulated step time, within each device's memory, from measured, analytic or "
        "predicted per-layer costs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    p.add_argument("--model", required=True, metavar="NAME", help="zoo name or pkg.mod:factory")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="model config override, e.g. --set depth=4",
    )
    p.add_argument("--stages", type=int, metavar="S", help="pipeline stages (one replica)")
    p.add_argument(
        "--gpus",
        type=int,
        metavar="G",
        help="choose the data x pipeline shape for G GPUs instead of --stages: every dp x pp "
        "with dp * pp = G, its best split, the gradient all-reduce priced over --link-gbs "
        "(--microbatches then counts per replica)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=64,
        metavar="B",
        help="samples per optimizer step (default 64)",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        metavar="M",
        help="microbatches per step (default 2 x stages); must divide --batch-size",
    )
    p.add_argument(
        "--schedule",
        default="1f1b",
        choices=SCHEDULES,
        help="pipeline schedule (default 1f1b); interleaved-1f1b, zb, zbv and dualpipev "
        "give each rank --chunks virtual stages; 2bw (PipeDream-2BW) changes what training "
        "computes",
    )
    p.add_argument(
        "--chunks",
        type=int,
        metavar="V",
        help="virtual stages per rank under a multi-stage schedule (default 2)",
    )
    p.add_argument(
        "--profile",
        nargs="+",
        metavar="PARQUET",
        help="profile dataset(s) with measured layer times (else analytic costs)",
    )
    p.add_argument(
        "--conditions",
        metavar="C0,C1,...",
        help="profiled condition per stage device (default none = clean)",
    )
    p.add_argument(
        "--predictor",
        metavar="JSON",
        help="learned slowdown predictor, e.g. predictor/h200.json.gz; needs --telemetry",
    )
    p.add_argument(
        "--telemetry",
        metavar="JSON",
        help="one tel_* window per stage device (JSON list of objects)",
    )
    p.add_argument(
        "--slowdown",
        metavar="F0,F1,...",
        help="per-device slowdown factors (1,2.4) or device:factor pairs (1:2.4)",
    )
    p.add_argument(
        "--memory-gb", metavar="GB", help="memory per device in GiB: one value or one per stage"
    )
    p.add_argument(
        "--recompute",
        default="none",
        choices=("none", "all", "auto"),
        help="activation recomputation the plan prices: auto recomputes the cheapest layers "
        "that fit each stage in --memory-gb (default: %(default)s)",
    )
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=("adamw", "sgd", "none"),
        help="optimizer whose state the memory model counts (default adamw)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="the dtype of the whole model, weights and activations alike, for analytic costs "
        "(default float32); a run of `dynpipe train --bf16` is --bf16",
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="price a `dynpipe train --bf16` run: bfloat16 layers and activations, float32 "
        "weights, gradients and optimizer state",
    )
    p.add_argument(
        "--device-tflops",
        type=float,
        default=100.0,
        help="analytic costs: sustained TFLOP/s per device (default 100)",
    )
    p.add_argument(
        "--mem-bandwidth-gbs",
        type=float,
        default=2000.0,
        help="analytic costs: device memory GB/s (default 2000)",
    )
    p.add_argument(
        "--link-gbs", type=float, default=25.0, help="stage-to-stage link GB/s (default 25)"
    )
    p.add_argument(
        "--link-latency-us",
        type=float,
        default=20.0,
        help="per-transfer link latency in microseconds (default 20)",
    )
    p.add_argument("--current", metavar="PLAN", help="the plan running now (for migration cost)")
    p.add_argument(
        "--migration-ms-per-gb",
        type=float,
        default=0.0,
        help="cost charged per GiB of layer state that changes owner, in ms per "
        "step (amortised); needs --current",
    )
    p.add_argument(
        "--compare", action="store_true", help="also show the even and parameter-balanced splits"
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("-o", "--output", metavar="PATH", help="write the plan JSON here")
    p.set_defaults(func=run)


def _memory(text: str | None, stages: int) -> list[float] | None:
    from dynpipe.errors import UserError

    if not text:
        return None
    try:
        vals = [float(x) * 2**30 for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(
            f"cannot parse --memory-gb {text!r}; give GiB like 16 or 16,16,8,16"
        ) from None
    if len(vals) == 1:
        vals = vals * stages
    if len(vals) != stages:
        raise UserError(
            f"--memory-gb has {len(vals)} values for {stages} stages; give 1 or {stages}"
        )
    return vals


def _telemetry(path: str, stages: int) -> list[dict[str, Any]]:
    from pathlib import Path

    from dynpipe.errors import UserError

    p = Path(path)
    if not p.is_file():
        raise UserError(f"telemetry file {p} does not exist; write one tel_* object per stage")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"telemetry file {p} is not JSON ({exc})") from None
    if isinstance(data, dict):
        data = data.get("devices", data)
    if (
        not isinstance(data, list)
        or len(data) != stages
        or not all(isinstance(w, dict) for w in data)
    ):
        n = len(data) if isinstance(data, list) else 1
        raise UserError(
            f"telemetry file {p} has {n} window(s) for {stages} stages; give a JSON list of "
            f"{stages} objects of tel_* readings, one per stage device"
        )
    return data


def _costs(args: argparse.Namespace, model: Any, mb: int) -> Any:
    from dataclasses import replace

    from dynpipe.errors import UserError
    from dynpipe.planner.costs import CostModel, parse_slowdown

    s = args.stages
    if args.bf16 and args.dtype != "float32":
        raise UserError(
            f"--bf16 computes in bfloat16 with float32 weights; --dtype {args.dtype} makes the "
            "weights that dtype too: give one of them"
        )
    dtype = "bfloat16" if args.bf16 else args.dtype
    link = dict(bandwidth=args.link_gbs * 1e9, latency_ms=args.link_latency_us / 1e3)
    if args.profile:
        conds = args.conditions.split(",") if args.conditions else ["none"]
        if len(conds) not in (1, s):
            raise UserError(f"--conditions has {len(conds)} entries for {s} stages; give 1 or {s}")
        from dynpipe.planner.profile_costs import check_profile_model
        from dynpipe.profiler.schema import load_profiles

        profile = load_profiles(args.profile)  # read once: the check and the costs share it
        check_profile_model(
            profile,
            model=model.name,
            layer_names=model.layer_names,
            param_counts=[
                sum(p.numel() for p in model.build_layer(i, device="meta").parameters())
                for i in range(len(model))
            ],
        )
        cm = CostModel.from_profile(
            profile,
            model=model.name,
            microbatch_size=mb,
            conditions=conds,
            optimizer=args.optimizer,
            fingerprint=model.fingerprint(),
            **link,
        ).for_devices(s)
    else:
        if args.conditions:
            raise UserError("--conditions selects profiled conditions; it needs --profile")
        cm = CostModel.from_model(
            model,
            microbatch_size=mb,
            dtype=dtype,
            num_devices=s,
            flops_per_s=args.device_tflops * 1e12,
            mem_bytes_per_s=args.mem_bandwidth_gbs * 1e9,
            optimizer=args.optimizer,
            **link,
        )
    if args.predictor:
        if not args.telemetry:
            raise UserError("--predictor needs --telemetry (one tel_* window per stage device)")
        try:
            from dynpipe.predictor import load_predictor, predict_layer_times, prepare_layers
        except (ModuleNotFoundError, ImportError) as exc:
            raise UserError(f"--predictor needs dynpipe.predictor ({exc})") from None
        import torch

        from dynpipe.models.stats import layer_stats

        pred = load_predictor(args.predictor)
        # A predictor of layers' work (feature schema 3) counts it from the model itself.
        described = (
            prepare_layers(pred, model, batch_size=mb, dtype=getattr(torch, dtype))
            if pred.schema.uses_work
            else layer_stats(model, batch_size=mb, dtype=getattr(torch, dtype))
        )
        fwd, bwd = predict_layer_times(
            pred,
            layers=described,
            alone_fwd_ms=cm.fwd_ms,
            alone_bwd_ms=cm.bwd_ms,
            telemetry=_telemetry(args.telemetry, s),
            batch_size=mb,
        )
        meta = {
            **cm.meta,
            "source": f"{cm.meta.get('source')}+predictor",
            "predictor": str(args.predictor),
        }
        cm = replace(cm, fwd_ms=fwd, bwd_ms=bwd, meta=meta)
    elif args.telemetry:
        raise UserError("--telemetry is read by --predictor; give both")
    if args.bf16:
        cm = _float32_weights(cm)
    if args.slowdown:
        cm = cm.with_slowdown(parse_slowdown(args.slowdown, s))
    return cm


def _float32_weights(cm: Any) -> Any:
    """``cm`` with its parameters counted at 4 bytes each: autocast computes in bfloat16
    but keeps float32 weights, so their gradients and the optimizer's state are float32
    too. Costs taken at 2 bytes a parameter (analytic at bfloat16, or a bfloat16 profile)
    would put half the weights' memory in the plan and let it exceed the device."""
    from dataclasses import replace

    import numpy as np

    width = {"float32": 4, "bfloat16": 2, "float16": 2}.get(str(cm.meta.get("dtype")), 4)
    if width == 4:
        return cm
    meta = {**cm.meta, "weights_dtype": "float32"}
    return replace(cm, param_bytes=np.asarray(cm.param_bytes) * (4 / width), meta=meta)


def run(args: argparse.Namespace) -> int:
    from dynpipe.errors import UserError
    from dynpipe.models import get_model
    from dynpipe.models.cli import parse_overrides
    from dynpipe.planner.make import baseline_plan, make_plan
    from dynpipe.planner.plan import MULTI_SCHEDULES, Plan
    from dynpipe.planner.report import format_comparison, format_plan, format_schedules
    from dynpipe.planner.virtual import make_virtual_plan, schedule_table

    try:
        model = get_model(args.model, **parse_overrides(args.overrides))
    except (ValueError, TypeError) as exc:
        raise UserError(str(exc)) from None
    if (args.stages is None) == (args.gpus is None):
        raise UserError(
            "give --stages S (one pipeline) or --gpus G (the dp x pp shape for G GPUs), not "
            f"{'both' if args.stages is not None else 'neither'}"
        )
    if args.gpus is not None:
        return _shape(args, model)
    s = args.stages
    if not 1 <= s <= len(model):
        raise UserError(f"--stages {s}: {model.name} has {len(model)} layers; use 1–{len(model)}")
    m = args.microbatches or 2 * s
    if m < 1 or args.batch_size < 1 or args.batch_size % m:
        raise UserError(
            f"--batch-size {args.batch_size} does not split into {m} equal microbatches; "
            f"use a multiple of {m} (e.g. {m * max(1, args.batch_size // m or 1)})"
        )
    if args.migration_ms_per_gb and not args.current:
        raise UserError("--migration-ms-per-gb prices moves away from a plan; give --current")
    costs = _costs(args, model, args.batch_size // m)
    if args.recompute == "auto" and not args.memory_gb:
        raise UserError(
            "--recompute auto fits each stage into its device's memory; give it with "
            "--memory-gb GB (one value or one per stage)"
        )
    costs = dataclasses.replace(costs, recompute=args.recompute)
    if args.schedule == "2bw":
        # Its second copy of the weights travels and is priced as optimizer state.
        costs = dataclasses.replace(costs, opt_mult=costs.opt_mult + 1)
    current = Plan.load(args.current).validate(model) if args.current else None
    memory = _memory(args.memory_gb, s)
    chunks = args.chunks or 2
    schedules = schedule_table(costs, pp=s, microbatches=m, chunks=chunks)
    if args.schedule in MULTI_SCHEDULES:
        for flag in ("current", "memory_gb"):
            if getattr(args, flag):
                raise UserError(
                    f"--{flag.replace('_', '-')} is priced for one stage per rank; plan "
                    f"--schedule {args.schedule} without it"
                )
        plan = make_virtual_plan(costs, pp=s, chunks=chunks, schedule=args.schedule, microbatches=m)
    else:
        plan = make_plan(
            costs,
            num_stages=s,
            schedule=args.schedule,
            microbatches=m,
            memory_bytes=memory,
            current=current,
            migration_ms_per_byte=args.migration_ms_per_gb / 2**30,
        )
    plan.meta["schedules"] = schedules
    plan.meta.update(
        batch_size=args.batch_size, model_config=json.loads(json.dumps(model.config, default=str))
    )
    if args.json:
        print(plan.to_json())
    else:
        print(
            f"{model.name}: {len(model)} layers on {s} stages, batch {args.batch_size} in "
            f"{m} microbatches of {args.batch_size // m}"
        )
        print(format_plan(plan))
        print()
        print("predicted step time per schedule (best split of each):")
        print(format_schedules(schedules))
        if args.compare:
            others = [
                baseline_plan(
                    costs,
                    k,
                    num_stages=s,
                    schedule=args.schedule,
                    microbatches=m,
                    memory_bytes=memory,
                )
                for k in ("even", "parameters")
            ]
            print()
            print(format_comparison([plan, *others]))
    if args.output:
        path = plan.save(args.output)
        if not args.json:
            print(f"wrote {path}")
    return 0


def _shape(args: argparse.Namespace, model: Any) -> int:
    """``--gpus``: rank every dp x pp shape, print the table, write the best one's plan."""
    import dataclasses

    from dynpipe.errors import UserError
    from dynpipe.planner.make import annotate
    from dynpipe.planner.report import format_plan, format_shapes
    from dynpipe.planner.shape import choose_shape

    for flag in ("slowdown", "predictor", "telemetry", "current"):
        if getattr(args, flag):
            raise UserError(
                f"--{flag} describes the devices of one pipeline; with --gpus every device is "
                "taken clean: plan with --stages for a given pipeline"
            )
    if args.conditions and len(args.conditions.split(",")) > 1:
        raise UserError("--gpus takes one --conditions entry (every device alike)")
    if args.gpus < 1:
        raise UserError(f"--gpus must be >= 1, got {args.gpus}")
    if args.schedule not in ("gpipe", "1f1b"):
        raise UserError(
            f"--gpus ranks dp x pp shapes under gpipe or 1f1b; --schedule {args.schedule} "
            "runs one pipeline: plan it with --stages"
        )
    memory = _memory(args.memory_gb, 1)
    one = argparse.Namespace(**{**vars(args), "stages": 1})
    shapes = choose_shape(
        lambda mb: _costs(one, model, mb),
        gpus=args.gpus,
        batch_size=args.batch_size,
        num_layers=len(model),
        microbatches=args.microbatches,
        schedule=args.schedule,
        memory_bytes=None if memory is None else memory[0],
    )
    best = shapes[0]
    if not best.fits:
        why = "; ".join(f"{c.dp}x{c.pp}: {c.note or 'does not fit memory'}" for c in shapes)
        raise UserError(f"no dp x pp shape of {args.gpus} GPUs can run {model.name}: {why}")
    costs = _costs(one, model, best.microbatch_size)
    plan = annotate(
        costs,
        best.bounds,
        schedule=args.schedule,
        microbatches=best.microbatches,
        method="shape",
        memory_bytes=None if memory is None else memory[0],
        meta={
            "gpus": args.gpus,
            "pipeline_ms": round(best.pipeline_ms, 6),
            "reduce_ms": round(best.reduce_ms, 6),
            "step_ms": round(best.step_ms, 6),
            "shapes": [
                {
                    "dp": c.dp,
                    "pp": c.pp,
                    "split": [b - a for a, b in c.bounds],
                    "step_ms": None if not c.bounds else round(c.step_ms, 6),
                    "pipeline_ms": None if not c.bounds else round(c.pipeline_ms, 6),
                    "reduce_ms": None if not c.bounds else round(c.reduce_ms, 6),
                    "fits": c.fits,
                    "note": c.note,
                }
                for c in shapes
            ],
        },
    )
    plan = dataclasses.replace(plan, dp=best.dp)
    plan.meta.update(
        batch_size=args.batch_size, model_config=json.loads(json.dumps(model.config, default=str))
    )
    if args.json:
        print(plan.to_json())
    else:
        print(
            f"{model.name}: {len(model)} layers on {args.gpus} GPUs, batch {args.batch_size}; "
            f"best shape {best.dp} replicas x {best.pp} stages, {best.microbatches} microbatches "
            f"of {best.microbatch_size} per replica"
        )
        print(format_shapes(shapes))
        print()
        print(format_plan(plan))
    if args.output:
        path = plan.save(args.output)
        if not args.json:
            print(f"wrote {path}")
    return 0
