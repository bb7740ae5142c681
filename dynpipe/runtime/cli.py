"""``dynpipe train``: launcher on the command line, worker under torchrun."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["config_from_args", "register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model split into pipeline stages (one process per stage)",
        description="Train a model split into pipeline stages, one process per stage. On the "
        "command line it starts --nproc workers through torchrun's agent; under torchrun "
        "(RANK set) it is one worker.",
    )
    add_train_args(p)
    p.set_defaults(func=run)


def add_train_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="mlp", help="zoo name or package.module:factory")
    g.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="model config, e.g. --model-arg depth=4 (repeatable)",
    )
    g.add_argument(
        "--data",
        default="synthetic",
        help="synthetic, digits, cifar10, imagefolder, text or pystdlib (this Python's "
        "standard library sources as bytes, for gpt/bert)",
    )
    g.add_argument("--data-path", default=None, help="local dataset path (never downloaded)")
    g.add_argument(
        "--data-workers",
        type=int,
        default=None,
        metavar="N",
        help="processes loading batches ahead on the first and last stage "
        "(0: in the training process; default: up to 4 on CUDA, 0 on CPU)",
    )
    g.add_argument(
        "--device-batches",
        type=int,
        default=0,
        metavar="N",
        help="make N batches once, keep them on the device and cycle them (step s trains "
        "on batch s mod N): measures the GPUs without the loader (benchmarks); default 0, "
        "every step its own batch",
    )
    g = p.add_argument_group("pipeline")
    g.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="workers to start on this node (default: the plan's stage count)",
    )
    g.add_argument("--plan", default=None, help="plan JSON (from `dynpipe plan`)")
    g.add_argument(
        "--stages",
        type=int,
        default=None,
        help="without --plan: equal-layer stages (default: world size)",
    )
    g.add_argument(
        "--schedule",
        choices=("gpipe", "1f1b"),
        default=None,
        help="pipeline schedule (default: the plan's, else 1f1b)",
    )
    g.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="microbatches per step (default: the plan's, else 4)",
    )
    g.add_argument("--device", default="auto", help="auto, cpu or cuda (one GPU per rank)")
    g.add_argument(
        "--pin-cores",
        action="store_true",
        help="CPU runs: pin each worker to its own core (local rank modulo the "
        "cores available), one compute thread each",
    )
    g.add_argument("--bf16", action="store_true", help="bfloat16 autocast on GPU")
    g.add_argument(
        "--no-timing",
        dest="timing",
        action="store_false",
        help="turn the per-microbatch stage timers off",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds before a blocking collective or P2P wait fails",
    )
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=100)
    g.add_argument("--batch-size", type=int, default=32)
    g.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    g.add_argument("--lr", type=float, default=0.05)
    g.add_argument("--momentum", type=float, default=0.9)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--warmup", type=int, default=0, help="linear warm-up steps")
    g.add_argument("--lr-schedule", choices=("constant", "cosine", "linear"), default="constant")
    g.add_argument("--clip-grad", type=float, default=0.0, help="global-norm clip (0 = off)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("adaptation")
    g.add_argument(
        "--adapt",
        choices=("static", "measured", "adaptive", "restart", "sweep"),
        default="static",
        help="static: never repartition; measured: from per-layer times measured on each "
        "device; adaptive: plus the predictor for layers a device does not hold; restart: "
        "adaptive's decisions applied by checkpoint+relaunch; sweep: every split in turn "
        "(benchmarks)",
    )
    g.add_argument("--scenario", default=None, help="interference scenario TOML")
    g.add_argument("--predictor", default=None, help="trained slowdown predictor (.joblib)")
    g.add_argument("--monitor-every", type=int, default=5, help="steps per monitoring window")
    g.add_argument(
        "--min-gain",
        type=float,
        default=0.05,
        help="smallest relative step-time gain worth a repartition",
    )
    g.add_argument(
        "--horizon",
        type=int,
        default=100,
        help="steps over which a gain must pay back the migration pause",
    )
    g.add_argument(
        "--sweep-windows",
        type=int,
        default=3,
        help="--adapt sweep: windows each split is held (the first settles)",
    )
    g.add_argument(
        "--sweep-plans",
        type=int,
        default=12,
        help="--adapt sweep with more than 2 stages: splits visited per pass",
    )
    g.add_argument(
        "--no-telemetry",
        dest="telemetry",
        action="store_false",
        help="do not sample device telemetry",
    )
    g = p.add_argument_group("logs and checkpoints")
    g.add_argument(
        "--log", default=None, help="run log path (default runs/<model>-<time>/log.jsonl)"
    )
    g.add_argument(
        "--log-every", type=int, default=10, help="steps between gathers of per-stage timings"
    )
    g.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0 = off)")
    g.add_argument("--save-dir", default=None)
    g.add_argument("--resume", default=None, help="checkpoint folder to resume from")
    g.add_argument("--no-progress", dest="progress", action="store_false")
    g.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="evaluate on the held-out split every N steps and after the last (0: never); "
        "logs `eval` records: loss, top-1 accuracy, perplexity for gpt/bert",
    )
    g.add_argument(
        "--eval-batches",
        type=int,
        default=None,
        metavar="N",
        help="batches (of --batch-size) per evaluation (default: the held-out split once, "
        "at most 50; 10 for synthetic)",
    )


def config_from_args(args: argparse.Namespace):
    from dynpipe.models.cli import parse_overrides
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.optim import OptimConfig
    from dynpipe.runtime.train import TrainConfig

    optim = OptimConfig(
        name=args.optimizer,
        lr=args.lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup,
        schedule=args.lr_schedule,
        total_steps=args.steps,
        clip_grad=args.clip_grad,
    )
    return TrainConfig(
        model=args.model,
        model_args=parse_overrides(args.model_arg, option="--model-arg"),
        data=args.data,
        data_path=args.data_path,
        data_workers=args.data_workers,
        device_batches=args.device_batches,
        steps=args.steps,
        batch_size=args.batch_size,
        microbatches=args.microbatches,
        schedule=args.schedule,
        stages=args.stages,
        plan=args.plan,
        optim=optim,
        bf16=args.bf16,
        timing=args.timing,
        seed=args.seed,
        log=args.log,
        log_every=args.log_every,
        save_every=args.save_every,
        save_dir=args.save_dir,
        resume=args.resume,
        progress=args.progress,
        adapt=AdaptConfig(
            mode=args.adapt,
            monitor_every=args.monitor_every,
            min_gain=args.min_gain,
            horizon_steps=args.horizon,
            sweep_windows=args.sweep_windows,
            sweep_plans=args.sweep_plans,
        ),
        scenario=args.scenario,
        predictor=args.predictor,
        telemetry=args.telemetry,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
    )


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _worker(cfg, args)
    return _launcher(cfg, args)


def _launcher(cfg, args: argparse.Namespace) -> int:
    """Validate everything that needs no process group, then start the workers."""
    from dynpipe.errors import UserError
    from dynpipe.runtime.train import build_model_and_data, resolve_plan

    model, _ = build_model_and_data(cfg)
    if args.nproc is not None and args.nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {args.nproc}")
    nproc = args.nproc
    if nproc is None:
        if cfg.plan:
            from dynpipe.planner.plan import Plan

            nproc = Plan.load(cfg.plan).num_stages
        else:
            nproc = cfg.stages or 1
    resolve_plan(cfg, model, nproc)  # a mismatch is reported here, before any worker starts
    if args.device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < nproc:
            raise UserError(
                f"{nproc} workers need {nproc} GPUs but {torch.cuda.device_count()} are visible; "
                f"use --nproc {torch.cuda.device_count()} with a matching plan, or --device cpu"
            )
    from dynpipe.runtime.launch import launch_local

    words = list(args.argv)
    words = words[words.index("train") + 1 :]
    if cfg.log is None:
        # One log path for every worker and every relaunch (the default is timestamped, and
        # the restart baseline keeps its checkpoint beside the log).
        from dynpipe.runtime.train import default_log_path

        words += ["--log", default_log_path(cfg)]
    # The restart baseline relaunches the workers after each decision: let the agent do so.
    restarts = max(1, cfg.steps) if cfg.adapt.mode == "restart" else 0
    return launch_local(words, nproc=nproc, max_restarts=restarts)


def _worker(cfg, args: argparse.Namespace) -> int:
    from dynpipe.errors import UserError
    from dynpipe.runtime.topology import Topology, destroy, init_distributed
    from dynpipe.runtime.train import build_model_and_data, resolve_plan, train

    topo = Topology.from_env(device=args.device, timeout_s=args.timeout)
    quiet = topo.rank != topo.world_size - 1
    if args.pin_cores and hasattr(os, "sched_setaffinity"):
        import torch

        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[topo.local_rank % len(cores)]})
        torch.set_num_threads(1)
    try:
        model, _ = build_model_and_data(cfg)
        resolve_plan(cfg, model, topo.world_size)  # before any collective
        init_distributed(topo)
        train(cfg, topo=topo)
        return 0
    except SystemExit as exc:  # RestartRequested: checkpoint written, relaunch wanted
        return int(exc.code or 0)
    except UserError as exc:
        # Every rank sees the same bad input; one of them says so.
        if not quiet:
            print(f"dynpipe train: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from dynpipe.runtime.health import StageFailure
        from dynpipe.runtime.migrate import MigrationError

        if not isinstance(exc, (StageFailure, MigrationError)):
            import traceback

            traceback.print_exc()  # not a known failure mode: the stack is what helps
        print(f"dynpipe train: rank {topo.rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        destroy()
