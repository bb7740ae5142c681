"""``dynpipe train``: launcher on the command line, worker under torchrun."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

__all__ = ["config_from_args", "preflight", "register"]


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
        "--data", default="synthetic", help="synthetic, digits, cifar10, imagefolder or text"
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
    g.add_argument(
        "--predictor",
        default=None,
        help="trained slowdown predictor (.json from `dynpipe predictor fit`; "
        "--adapt adaptive or restart)",
    )
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
    g.add_argument(
        "--save-dir",
        default=None,
        help="checkpoint folder: every save a fresh ckpt-<step>-<id> subfolder, published "
        "atomically",
    )
    g.add_argument(
        "--keep-checkpoints",
        type=int,
        default=3,
        metavar="N",
        help="published checkpoints kept in --save-dir (default 3; older ones are deleted)",
    )
    g.add_argument(
        "--resume",
        default=None,
        help="checkpoint folder (or a --save-dir: its newest) to resume from under this "
        "command's plan; 'auto': the newest in --save-dir under its own plan and adaptation "
        "state, or a fresh start when there is none",
    )
    g.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="relaunch the workers up to N times when one dies, each time resuming from the "
        "run's newest checkpoint (needs --save-every and --save-dir; implies --resume auto)",
    )
    g.add_argument("--no-progress", dest="progress", action="store_false")


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
        keep_checkpoints=args.keep_checkpoints,
        resume=args.resume,
        max_restarts=args.max_restarts,
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
    )


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from dynpipe.runtime.train import RESTART_EXIT

        rc = _worker(cfg, args)
        if rc not in (0, RESTART_EXIT):
            # A failed or stopped worker exits now: a background checkpoint write blocked on a
            # dead peer must not hold the process (and the agent's relaunch) until it times out.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
        return rc
    return _launcher(cfg, args)


def preflight(cfg, model, plan, *, check_resume: bool = True) -> None:
    """Check every input a run reads besides the model and plan before any process group
    exists: the predictor and its feature schema, the scenario, the checkpoint to resume."""
    if cfg.predictor:
        from dynpipe.predictor import load_predictor
        from dynpipe.profiler.schema import TELEMETRY_COLUMNS

        pred = load_predictor(cfg.predictor)
        pred.schema.check_telemetry(
            TELEMETRY_COLUMNS, what=f"the telemetry dynpipe train samples (for {cfg.predictor})"
        )
    if cfg.scenario:
        from dynpipe.runtime.scenario import load_scenario

        load_scenario(cfg.scenario, num_stages=plan.num_stages)
    if check_resume and cfg.resume and cfg.resume != "auto":
        from dynpipe.errors import UserError
        from dynpipe.runtime.checkpoint import check_checkpoint

        layers = model.build_range(0, len(model), device="meta")  # shapes only, no memory
        shapes = {
            f"{name}.{k}": tuple(v.shape)
            for name, layer in layers.items()
            for k, v in layer.state_dict().items()
        }
        info = check_checkpoint(cfg.resume, model_shapes=shapes)
        if info.meta.get("model_fingerprint") not in (None, model.fingerprint()):
            raise UserError(
                f"checkpoint {info.path} is for a different layer list of "
                f"{info.meta.get('model')} (fingerprint mismatch); resume with the model config "
                "it was written with"
            )


def _launcher(cfg, args: argparse.Namespace) -> int:
    """Validate everything that needs no process group, then start the workers."""
    from dynpipe.errors import UserError
    from dynpipe.runtime.train import build_model_and_data, checkpoint_dir, resolve_plan

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
    plan = resolve_plan(cfg, model, nproc)  # a mismatch is reported here, before any worker
    preflight(cfg, model, plan)
    if args.device.startswith("cuda"):
        import torch

        n = torch.cuda.device_count()
        if n == 0:
            raise UserError(
                "--device cuda was asked for but no CUDA device is visible here; use --device "
                "cpu (or --device auto, which picks the GPUs when there are some)"
            )
        if n < nproc:
            raise UserError(
                f"{nproc} workers need {nproc} GPUs but {n} are visible; use --nproc {n} with "
                "a matching plan, or --device cpu"
            )
    from dynpipe.runtime.launch import launch_local

    words = list(args.argv)
    words = words[words.index("train") + 1 :]
    if cfg.log is None:
        # One log path for every worker and every relaunch (the default is timestamped, and
        # the restart baseline keeps its checkpoint beside the log).
        from dynpipe.runtime.train import default_log_path

        words += ["--log", default_log_path(cfg)]
        cfg = dataclasses.replace(cfg, log=words[-1])
    # The restart baseline relaunches the workers after each decision: let the agent do so.
    restarts = cfg.max_restarts + (max(1, cfg.steps) if cfg.adapt.mode == "restart" else 0)
    return launch_local(
        words, nproc=nproc, max_restarts=restarts, checkpoint_dir=checkpoint_dir(cfg)
    )


def _worker(cfg, args: argparse.Namespace) -> int:
    from dynpipe.errors import UserError
    from dynpipe.runtime.signals import Stopped, StopRequest, bind_to_parent
    from dynpipe.runtime.topology import Topology, destroy, init_distributed
    from dynpipe.runtime.train import build_model_and_data, resolve_plan, train

    stop = StopRequest().install()
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        bind_to_parent()  # the agent that started us dies: so do we
    topo = Topology.from_env(device=args.device, timeout_s=args.timeout)
    quiet = topo.rank != topo.world_size - 1
    if args.pin_cores and hasattr(os, "sched_setaffinity"):
        import torch

        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[topo.local_rank % len(cores)]})
        torch.set_num_threads(1)
    try:
        model, _ = build_model_and_data(cfg)
        plan = resolve_plan(cfg, model, topo.world_size)  # before any collective
        preflight(cfg, model, plan, check_resume=False)
        init_distributed(topo)
        train(cfg, topo=topo, stop=stop)
        return 0
    except Stopped as exc:  # stopped for a signal: the launcher says so, in one line
        return int(exc.code)
    except SystemExit as exc:  # RestartRequested: checkpoint written, relaunch wanted
        return int(exc.code or 0)
    except UserError as exc:
        if stop.requested:
            return 128 + (stop.signum or 15)
        # Every rank sees the same bad input; one of them says so.
        if not quiet:
            print(f"dynpipe train: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from dynpipe.runtime.checkpoint import CheckpointError
        from dynpipe.runtime.health import StageFailure
        from dynpipe.runtime.migrate import MigrationError

        if stop.requested and not isinstance(exc, (StageFailure, MigrationError)):
            # A peer that stopped first closed its connections: a consequence of the stop.
            # (A failed step is reported: the agent also signals the survivors of a crash.)
            return 128 + (stop.signum or 15)

        if not isinstance(exc, (StageFailure, MigrationError, CheckpointError)):
            import traceback

            traceback.print_exc()  # not a known failure mode: the stack is what helps
        print(f"dynpipe train: rank {topo.rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        destroy()
