"""What a run is, decided before any process group: its model and data, its plan checked
against the world, and where its log and checkpoints go.

The launcher validates a command line with these before it starts a worker, and every
worker starts from them; kept apart from the training loop so the launcher does not import
torch's pipelining machinery (1.5 s of CPU on a 2-core VM, on the path to the first step).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from dynpipe.errors import UserError
from dynpipe.models import LayeredModel, get_model
from dynpipe.planner.plan import MULTI_SCHEDULES, Plan, check_batch
from dynpipe.runtime.config import TrainConfig

__all__ = [
    "build_model_and_data",
    "checkpoint_dir",
    "default_log_path",
    "resolve_plan",
]


def build_model_and_data(cfg: TrainConfig) -> tuple[LayeredModel, Any]:
    """The model and its data source, with the model configured to match the data."""
    from dynpipe.data import get_data

    probe = get_data(cfg.data, path=cfg.data_path, seed=cfg.seed, model_args=cfg.model_args)
    kwargs = {**probe.model_kwargs(cfg.model.rpartition(":")[2] or cfg.model), **cfg.model_args}
    kwargs.setdefault("seed", cfg.seed)
    model = get_model(cfg.model, **kwargs)
    data = get_data(cfg.data, model=model, path=cfg.data_path, seed=cfg.seed)
    return model, data


def resolve_plan(cfg: TrainConfig, model: LayeredModel, world_size: int) -> Plan:
    """The run's plan, validated against the model and the world before any collective."""
    from dynpipe.runtime.mesh import check_dp

    # A plan file's schedule, microbatches and replicas hold unless the command line
    # overrides them.
    if cfg.plan:
        plan = Plan.load(cfg.plan)
        dp = cfg.dp or plan.dp
        if cfg.dp is not None:
            check_dp(dp, world_size=world_size)  # else the plan's own check below names its shape
        plan = dataclasses.replace(
            plan,
            schedule=cfg.schedule or plan.schedule,
            microbatches=cfg.microbatches or plan.microbatches,
            dp=dp,
            # Shares are counts for the plan's replicas and microbatches: kept only for those.
            shares=plan.shares
            if (dp, cfg.microbatches or plan.microbatches) == (plan.dp, plan.microbatches)
            else None,
            dropped=plan.dropped if dp == plan.dp else (),
        )
    else:
        dp = cfg.dp or 1
        pp = check_dp(dp, world_size=world_size)
        schedule = cfg.schedule or "1f1b"
        plan = Plan.even(
            model,
            cfg.stages or pp,
            schedule=schedule,
            microbatches=cfg.microbatches or 4,
            chunks=cfg.chunks or (2 if schedule in MULTI_SCHEDULES else 1),
        )
        if dp > 1:
            plan = dataclasses.replace(plan, dp=dp)
    if plan.schedule in MULTI_SCHEDULES and cfg.adapt.mode != "static":
        # The adaptation core prices moves per rank of one stage; migration itself moves
        # layers between virtual stages exactly (tests/test_schedules.py).
        raise UserError(
            f"--schedule {plan.schedule} runs with --adapt static (the controller does not "
            f"price virtual stages yet, and this run asks for --adapt {cfg.adapt.mode}); add "
            "--adapt static, or use --schedule 1f1b"
        )
    from dynpipe.runtime.twobw import check_2bw_run

    check_2bw_run(
        schedule=plan.schedule,
        fp16=cfg.fp16,
        freeze=cfg.freeze,
        autodp=cfg.autodp,
        reshape=cfg.adapt.reshape,
    )
    # With --elastic a plan may leave ranks idle from the start (a GPU held back until the
    # controller finds it worth using); the idle ranks probe their devices like any other.
    plan.validate(model, world_size, elastic=cfg.adapt.elastic and plan.dp == 1)
    check_batch(plan, cfg.batch_size)
    if cfg.adapt.reshape:
        _check_reshape(cfg, plan, world_size=world_size, num_layers=len(model))
    if cfg.autodp:
        from dynpipe.runtime.autodp import check_autodp

        check_autodp(
            world_size=world_size,
            dp=plan.dp,
            microbatches=plan.microbatches,
            schedule=plan.schedule,
            num_layers=len(model),
        )
    return plan


# The modes whose replica policy may change the data x pipeline shape (--reshape).
_RESHAPING = ("measured", "adaptive", "restart")


def _check_reshape(cfg: TrainConfig, plan: Plan, *, world_size: int, num_layers: int) -> None:
    """One-line errors for a --reshape run that could not work: a mode without the replica
    policy, one pipeline that leaves ranks idle or changes its stage count (--elastic:
    the replica policy's shapes use every rank), or no other shape to move to."""
    from dynpipe.runtime.adapt.replicas import shape_options

    shape = f"{plan.dp} x {plan.num_stages}"
    if cfg.adapt.mode not in _RESHAPING:
        raise UserError(
            f"--reshape lets the replica policy change the run's data x pipeline shape; this "
            f"run is {shape} with --adapt {cfg.adapt.mode}: use --adapt "
            f"{' or '.join(_RESHAPING)}, or drop --reshape"
        )
    if plan.dp == 1 and (plan.num_stages != world_size or cfg.adapt.elastic):
        raise UserError(
            f"--reshape moves among shapes that use all {world_size} ranks; this run is one "
            f"pipeline of {plan.num_stages} stages"
            + (" with --elastic" if cfg.adapt.elastic else "")
            + f": launch it over every rank (--stages {world_size}, or a plan of "
            f"{world_size} stages) without --elastic, or drop --reshape"
        )
    options = shape_options(
        world_size, total=plan.total_microbatches, schedule=plan.schedule, num_layers=num_layers
    )
    if not [s for s in options if s != (plan.dp, plan.num_stages)]:
        need = " (at least pp per replica under 1F1B)" if plan.schedule == "1f1b" else ""
        raise UserError(
            f"--reshape on {world_size} ranks as {shape}: no other shape splits the step's "
            f"{plan.total_microbatches} microbatches evenly among its replicas{need}; choose "
            f"--microbatches so that {plan.dp} x microbatches is a multiple of {world_size} "
            "(every shape fits it), or drop --reshape"
        )


def _restart_dir(cfg: TrainConfig) -> Path:
    """Where the restart baseline's checkpoints go: ``--save-dir``, else beside the log."""
    if cfg.save_dir:
        return Path(cfg.save_dir)
    return Path(cfg.log or default_log_path(cfg)).parent / "restart"


def checkpoint_dir(cfg: TrainConfig) -> Path | None:
    """The folder a run's checkpoints go to (None: it writes none)."""
    return _restart_dir(cfg) if (cfg.save_dir or cfg.adapt.mode == "restart") else None


def default_log_path(cfg: TrainConfig) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = cfg.model.rpartition(":")[2] or cfg.model
    return str(Path("runs") / f"{name}-{stamp}" / "log.jsonl")
