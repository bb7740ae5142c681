"""``dynpipe train``: launcher on the command line, worker under torchrun."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

__all__ = [
    "ADAPT_FLAGS",
    "OPTIM_FLAGS",
    "add_train_args",
    "config_from_args",
    "preflight",
    "register",
]


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
    (
        "pipeline",
        (
            "plan",
            "stages",
            "dp",
            "schedule",
            "microbatches",
            "bf16",
            "fp16",
            "recompute",
            "memory_gb",
            "compile",
            "compile_backend",
            "timing",
            "gc_every",
        ),
    ),
    ("optimisation", ("steps", "batch_size", "seed")),
    ("adaptation", ("scenario", "predictor", "telemetry")),
    (
        "logs and checkpoints",
        (
            "log",
            "tensorboard",
            "log_every",
            "save_every",
            "save_dir",
            "keep_checkpoints",
            "resume",
            "max_restarts",
            "progress",
        ),
    ),
    ("evaluation", ("eval_every", "eval_batches")),
    (
        "freezing (changes what training computes)",
        (
            "freeze",
            "freeze_every",
            "freeze_threshold",
            "freeze_alpha",
            "freeze_patience",
            "autodp",
        ),
    ),
)
# Set by hand (``--model-arg``), or config dataclasses of their own.
_NOT_FLAGS = ("model_args", "optim", "adapt")
# Flag names older than the fields they set (the rest are --field-name).
OPTIM_FLAGS = {"name": "--optimizer", "schedule": "--lr-schedule", "warmup_steps": "--warmup"}
ADAPT_FLAGS = {"mode": "--adapt", "horizon_steps": "--horizon", "core": "--adapt-core"}


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
        help="workers to start on this node (default: the plan's stage count times its replicas)",
    )
    g.add_argument("--device", default="auto", help="auto, cpu or cuda (one GPU per rank)")
    g.add_argument(
        "--pin-cores",
        action="store_true",
        help="CPU runs: pin each worker to its own core (local rank modulo the "
        "cores available), one compute thread each",
    )
    g.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        metavar="N",
        help="CPU runs: torch compute threads per worker, the same whatever --nproc, so a "
        "run on N workers is bit-identical to one process; OMP_NUM_THREADS overrides it "
        "(default: %(default)s)",
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


def preflight(cfg, model, plan, *, check_resume: bool = True, device: str = "cpu") -> None:
    """Check every input a run reads besides the model and plan before any process group
    exists: the predictor and its feature schema, the scenario, the checkpoint to resume,
    the precision and the memory the run's recomputation plans with, ``--compile``'s torch
    and backend."""
    from dynpipe.runtime.memory import check_run_memory

    check_run_memory(cfg, model, plan, device=device)
    if cfg.tensorboard:
        from dynpipe.analysis.tensorboard import require_tensorboard

        require_tensorboard()
    if getattr(cfg, "compile", False):
        from dynpipe.runtime.compiled import check_backend

        check_backend(cfg.compile_backend)
    if cfg.predictor:
        from dynpipe.devices import TELEMETRY_COLUMNS
        from dynpipe.predictor import load_predictor

        pred = load_predictor(cfg.predictor)
        pred.schema.check_telemetry(
            TELEMETRY_COLUMNS, what=f"the telemetry dynpipe train samples (for {cfg.predictor})"
        )
    if cfg.scenario:
        from dynpipe.runtime.scenario import load_scenario

        load_scenario(cfg.scenario, num_stages=plan.num_stages, dp=plan.dp, device=device)
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
        if info.step >= cfg.steps:
            raise UserError(
                f"checkpoint {info.path} is at step {info.step} and --steps is {cfg.steps}: "
                f"nothing to train; give --steps above {info.step}"
            )
        if info.meta.get("model_fingerprint") not in (None, model.fingerprint()):
            raise UserError(
                f"checkpoint {info.path} is for a different layer list of "
                f"{info.meta.get('model')} (fingerprint mismatch); resume with the model config "
                "it was written with"
            )
        from dynpipe.runtime.optim import check_resumed_optim

        saved = (info.meta.get("config") or {}).get("optim")
        changed = check_resumed_optim(saved, cfg.optim, where=f"checkpoint {info.path}")
        if changed:  # allowed (a new learning rate is a choice), but said
            print(
                f"dynpipe train: resuming {info.path} with other optimizer settings: "
                + ", ".join(changed),
                file=sys.stderr,
            )


def _launcher(cfg, args: argparse.Namespace) -> int:
    """Validate everything that needs no process group, then start the workers."""
    from dynpipe.errors import UserError
    from dynpipe.runtime.prepare import build_model_and_data, checkpoint_dir, resolve_plan

    model, _ = build_model_and_data(cfg)
    if args.nproc is not None and args.nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {args.nproc}")
    if args.cpu_threads < 1:
        raise UserError(f"--cpu-threads must be >= 1, got {args.cpu_threads}")
    nproc = args.nproc
    if nproc is None:
        if cfg.plan:
            from dynpipe.planner.plan import Plan

            plan = Plan.load(cfg.plan)
            nproc = plan.num_stages * (cfg.dp or plan.dp)
        else:
            nproc = (cfg.stages or 1) * (cfg.dp or 1)
    plan = resolve_plan(cfg, model, nproc)  # a mismatch is reported here, before any worker
    from dynpipe.runtime.topology import resolve_device

    preflight(cfg, model, plan, device=resolve_device(args.device))
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
        from dynpipe.runtime.prepare import default_log_path

        words += ["--log", default_log_path(cfg)]
        cfg = dataclasses.replace(cfg, log=words[-1])
    # The restart baseline relaunches the workers after each decision: let the agent do so.
    restarts = cfg.max_restarts + (max(1, cfg.steps) if cfg.adapt.mode == "restart" else 0)
    return launch_local(
        words,
        nproc=nproc,
        entry=forked_worker,
        max_restarts=restarts,
        checkpoint_dir=checkpoint_dir(cfg),
        log=cfg.log,
    )


def forked_worker(argv: list[str], exits: str) -> None:
    """One worker forked by the launcher's fork server: ``dynpipe train argv`` with the
    agent's RANK/WORLD_SIZE environment, exiting with the command's status (2 for bad
    input, 128 + N after signal N), which it also records for the launcher."""
    from dynpipe.errors import UserError
    from dynpipe.runtime.launch import record_exit

    parser = argparse.ArgumentParser(prog="dynpipe")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", *argv])
    args.argv = ["train", *argv]
    try:
        code = int(args.func(args) or 0)
    except UserError as exc:
        print(f"dynpipe train: error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 128 + 2  # the launcher reports the stop
    sys.stdout.flush()
    sys.stderr.flush()
    record_exit(exits, code)
    if code:
        raise SystemExit(code)


def _share_cores() -> None:
    """Give each worker of this node its share of the cores for torch's CPU threads, unless
    ``OMP_NUM_THREADS`` sets them. Torch's default is every core in every process: N
    workers then run N x cores threads, and a small CPU op waits for threads the others
    hold. On 4 x H100 (64 cores) two ranks that began to load batches after a reshape took
    0.5 s to make four of gpt's token batches (a few ms on one free core), which the next
    step waited for; with this and the batches made once per rank (``train``), the stall
    was gone."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if "OMP_NUM_THREADS" in os.environ or local <= 1:
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // local))


def _pin_threads(threads: int) -> None:
    """CPU runs: the same number of compute threads in every worker, whatever their count.
    A matrix product splits its reduction by thread, so one process on every core and two
    on one core each differ in the last bit (1e-7 relative on mlp from step 3); with the
    count fixed, a pipelined CPU run is bit-identical to one process. ``OMP_NUM_THREADS``,
    where set, is the user's choice and is read by torch itself."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(threads)


def _worker(cfg, args: argparse.Namespace) -> int:
    from dynpipe.errors import UserError
    from dynpipe.runtime.prepare import build_model_and_data, resolve_plan
    from dynpipe.runtime.signals import Stopped, StopRequest, bind_to_parent
    from dynpipe.runtime.topology import Topology, destroy, init_distributed
    from dynpipe.runtime.train import train

    stop = StopRequest().install()
    topo = Topology.from_env(device=args.device, timeout_s=args.timeout)
    stop.rank = topo.rank
    if topo.run_id is not None:
        bind_to_parent()  # the agent that started us dies: so do we
    quiet = topo.rank != topo.world_size - 1
    if args.pin_cores and hasattr(os, "sched_setaffinity"):
        import torch

        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[topo.local_rank % len(cores)]})
        torch.set_num_threads(1)
    elif topo.device.type == "cpu":
        _pin_threads(args.cpu_threads)
    else:
        _share_cores()
    try:
        model, _ = build_model_and_data(cfg)
        plan = resolve_plan(cfg, model, topo.world_size)  # before any collective
        preflight(cfg, model, plan, check_resume=False, device=str(topo.device))
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
        if getattr(exc, "quiet", False):
            return StageFailure.peer_exit_code  # a peer failed first and printed why
        print(f"dynpipe train: rank {topo.rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return int(getattr(exc, "exit_code", 1))
    finally:
        destroy()
