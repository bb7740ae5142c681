"""``dynpipe train``: launcher on the command line, worker under torchrun."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["ADAPT_FLAGS", "OPTIM_FLAGS", "add_train_args", "config_from_args", "register"]


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


# TrainConfig's fields by help section; any other field lands at the end, ungrouped.
_GROUPS = (
    ("model and data", ("model", "data", "data_path", "data_workers", "device_batches")),
    ("pipeline", ("plan", "stages", "schedule", "microbatches", "bf16", "timing")),
    ("optimisation", ("steps", "batch_size", "seed")),
    ("adaptation", ("scenario", "predictor", "telemetry")),
    ("logs and checkpoints", ("log", "log_every", "save_every", "save_dir", "resume", "progress")),
    ("evaluation", ("eval_every", "eval_batches")),
)
# Set by hand (``--model-arg``), or config dataclasses of their own.
_NOT_FLAGS = ("model_args", "optim", "adapt")
# Flag names older than the fields they set (the rest are --field-name).
OPTIM_FLAGS = {"name": "--optimizer", "schedule": "--lr-schedule", "warmup_steps": "--warmup"}
ADAPT_FLAGS = {"mode": "--adapt", "horizon_steps": "--horizon"}


def add_train_args(p: argparse.ArgumentParser) -> None:
    """Every field of TrainConfig, OptimConfig and AdaptConfig as a flag (``dynpipe.cliargs``:
    names, types, defaults and help come from the dataclasses), and the launcher's own."""
    from dynpipe.cliargs import add_config_args
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.optim import OptimConfig

    defaults = TrainConfig()
    groups = {}
    for title, names in _GROUPS:
        groups[title] = g = p.add_argument_group(title)
        add_config_args(g, TrainConfig, fields=names)
    placed = {n for _, names in _GROUPS for n in names}
    add_config_args(p, TrainConfig, exclude=(*placed, *_NOT_FLAGS))
    groups["model and data"].add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="model config, e.g. --model-arg depth=4 (repeatable)",
    )
    g = groups["pipeline"]
    g.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="workers to start on this node (default: the plan's stage count)",
    )
    g.add_argument("--device", default="auto", help="auto, cpu or cuda (one GPU per rank)")
    g.add_argument(
        "--pin-cores",
        action="store_true",
        help="CPU runs: pin each worker to its own core (local rank modulo the "
        "cores available), one compute thread each",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds before a blocking collective or P2P wait fails (default: %(default)s)",
    )
    # total_steps follows --steps: the learning-rate decay ends with the run.
    add_config_args(
        groups["optimisation"],
        OptimConfig,
        flags=OPTIM_FLAGS,
        exclude=("total_steps",),
        defaults=defaults.optim,
    )
    add_config_args(groups["adaptation"], AdaptConfig, flags=ADAPT_FLAGS, defaults=defaults.adapt)


def config_from_args(args: argparse.Namespace):
    """The TrainConfig the flags of ``add_train_args`` describe."""
    from dynpipe.cliargs import config_kwargs
    from dynpipe.models.cli import parse_overrides
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.optim import OptimConfig

    train = config_kwargs(args, TrainConfig)
    return TrainConfig(
        **train,
        model_args=parse_overrides(args.model_arg, option="--model-arg"),
        optim=OptimConfig(**config_kwargs(args, OptimConfig), total_steps=train["steps"]),
        adapt=AdaptConfig(**config_kwargs(args, AdaptConfig)),
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
