"""The training loop of one rank: data, engine, run log, progress, checkpoints.

``train(cfg, topo=...)`` expects the process group to exist already (the worker entry point
or a test harness creates it); everything it needs arrives by argument.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dynpipe.errors import UserError
from dynpipe.models import LayeredModel, get_model
from dynpipe.planner.plan import Plan
from dynpipe.runtime.checkpoint import load_checkpoint, save_checkpoint
from dynpipe.runtime.engine import EngineConfig, NonFiniteLoss, PipelineEngine, StepResult
from dynpipe.runtime.health import Heartbeat, StageFailure
from dynpipe.runtime.optim import OptimConfig
from dynpipe.runtime.runlog import RunLog, environment
from dynpipe.runtime.topology import Topology

__all__ = ["TrainConfig", "build_model_and_data", "resolve_plan", "train"]


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs besides the topology.

    model / model_args: zoo name (or ``package.module:factory``) and its keyword config.
    data / data_path: a ``dynpipe.data`` source; real datasets read from ``data_path`` only.
    plan: a plan file; without one, ``stages`` (default: world size) equal-layer stages.
    log: JSONL run-log path (written by the last stage's rank).
    log_every: steps between the gathers of per-stage timings (one small collective).
    save_every / save_dir: checkpoint cadence and folder; resume: checkpoint to resume from.
    """

    model: str = "mlp"
    model_args: dict[str, Any] = field(default_factory=dict)
    data: str = "synthetic"
    data_path: str | None = None
    steps: int = 100
    batch_size: int = 32
    microbatches: int = 4
    schedule: str = "1f1b"
    stages: int | None = None
    plan: str | None = None
    optim: OptimConfig = field(default_factory=OptimConfig)
    bf16: bool = False
    timing: bool = True
    seed: int = 0
    log: str | None = None
    log_every: int = 10
    save_every: int = 0
    save_dir: str | None = None
    resume: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise UserError(f"--steps must be >= 0, got {self.steps}")
        if self.batch_size < 1:
            raise UserError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.log_every < 1:
            raise UserError(f"--log-every must be >= 1, got {self.log_every}")
        if self.save_every and not self.save_dir:
            raise UserError("--save-every needs --save-dir DIR to write checkpoints into")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def build_model_and_data(cfg: TrainConfig) -> tuple[LayeredModel, Any]:
    """The model and its data source, with the model configured to match the data."""
    from dynpipe.data import get_data

    probe = get_data(cfg.data, path=cfg.data_path, seed=cfg.seed)
    kwargs = {**probe.model_kwargs(cfg.model.rpartition(":")[2] or cfg.model), **cfg.model_args}
    kwargs.setdefault("seed", cfg.seed)
    model = get_model(cfg.model, **kwargs)
    data = get_data(cfg.data, model=model, path=cfg.data_path, seed=cfg.seed)
    return model, data


def resolve_plan(cfg: TrainConfig, model: LayeredModel, world_size: int) -> Plan:
    """The run's plan, validated against the model and the world before any collective."""
    if cfg.plan:
        plan = Plan.load(cfg.plan)
        plan = dataclasses.replace(
            plan,
            schedule=cfg.schedule or plan.schedule,
            microbatches=cfg.microbatches or plan.microbatches,
        )
    else:
        plan = Plan.even(
            model, cfg.stages or world_size, schedule=cfg.schedule, microbatches=cfg.microbatches
        )
    plan.validate(model, world_size)
    from dynpipe.runtime.engine import check_batch

    check_batch(plan, cfg.batch_size)
    return plan


class _StepLog:
    """Buffers this rank's per-step timings; every ``log_every`` steps one all-gather hands
    every rank every stage's numbers (the monitor reads them; the writer logs them)."""

    def __init__(self, *, topo: Topology, plan: Plan, log: RunLog | None, batch_size: int):
        self.topo = topo
        self.plan = plan
        self.log = log
        self.batch_size = batch_size
        self.pending: list[StepResult] = []
        self.t_start = time.time()

    def add(self, res: StepResult) -> None:
        self.pending.append(res)

    def flush(self) -> list[dict[str, Any]]:
        if not self.pending:
            return []
        k = len(self.pending)
        mine = torch.tensor(
            [
                [r.timing.fwd_total, r.timing.bwd_total, r.timing.wait_ms, r.step_ms]
                for r in self.pending
            ],
            dtype=torch.float64,
        )
        if self.topo.world_size > 1:
            dev = self.topo.device
            parts = [
                torch.empty(k, 4, dtype=torch.float64, device=dev)
                for _ in range(self.topo.world_size)
            ]
            dist.all_gather(parts, mine.to(dev))
            by_rank = [p.cpu() for p in parts]
        else:
            by_rank = [mine]
        records = []
        for j, res in enumerate(self.pending):
            stages = []
            for s, st in enumerate(self.plan.stages):
                f, b, w, _ = by_rank[st.rank][j].tolist()
                stages.append(
                    {
                        "stage": s,
                        "rank": st.rank,
                        "layers": [st.start, st.stop],
                        "fwd_ms": round(f, 4),
                        "bwd_ms": round(b, 4),
                        "wait_ms": round(w, 4),
                    }
                )
            rec = {
                "step": res.step,
                "wall": round(time.time() - self.t_start, 4),
                "step_ms": round(res.step_ms, 4),
                "loss": res.loss,
                "lr": res.lr,
                "grad_norm": res.grad_norm,
                "samples_per_s": round(self.batch_size / (res.step_ms / 1e3), 3),
                "stages": stages,
            }
            records.append(rec)
            if self.log is not None:
                self.log.write("step", **rec)
        self.pending = []
        return records


def train(
    cfg: TrainConfig,
    *,
    topo: Topology,
    on_step: Callable[[PipelineEngine, StepResult], None] | None = None,
) -> dict[str, Any]:
    """Run ``cfg.steps`` steps on this rank; returns a summary (losses, final step)."""
    torch.manual_seed(cfg.seed)
    model, data = build_model_and_data(cfg)
    plan = resolve_plan(cfg, model, topo.world_size)
    engine = PipelineEngine(
        model,
        plan,
        topo=topo,
        config=EngineConfig(
            batch_size=cfg.batch_size, optim=cfg.optim, bf16=cfg.bf16, timing=cfg.timing
        ),
    )
    start = 0
    if cfg.resume:
        start = _resume(engine, cfg.resume, topo=topo)
    writer = plan.stages[-1].rank == topo.rank
    log = None
    if writer:
        log = RunLog(cfg.log or _default_log_path(cfg), append=bool(cfg.resume))
        log.header(
            config=cfg.to_dict(),
            plan=plan.to_dict(),
            world_size=topo.world_size,
            backend=topo.backend,
            env=environment(topo.device),
            start_step=start,
        )
    steplog = _StepLog(topo=topo, plan=plan, log=log, batch_size=cfg.batch_size)
    bar = _progress(cfg, start) if writer and cfg.progress else None
    beat = Heartbeat(rank=topo.rank, world_size=topo.world_size).start()
    losses: list[float] = []
    step = start
    try:
        for step in range(start, cfg.steps):
            try:
                res = engine.step(step, data.batch(step, cfg.batch_size))
            except NonFiniteLoss:
                raise
            except Exception as exc:
                raise _failure(exc, engine=engine, topo=topo, step=step, beat=beat) from exc
            losses.append(res.loss)
            steplog.add(res)
            if on_step is not None:
                on_step(engine, res)
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                steplog.flush()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(
                    loss=f"{res.loss:.4f}", sps=f"{cfg.batch_size / (res.step_ms / 1e3):.0f}"
                )
            if cfg.save_every and (step + 1) % cfg.save_every == 0:
                _save(engine, cfg, topo=topo, step=step + 1)
                if log is not None:
                    log.event("checkpoint", step=step + 1, path=str(_ckpt_dir(cfg, step + 1)))
        if log is not None:
            log.event("end", step=cfg.steps)
    finally:
        beat.stop()
        if bar is not None:
            bar.close()
        if log is not None:
            log.close()
    return {
        "losses": losses,
        "start": start,
        "steps": cfg.steps,
        "plan": plan,
        "log": str(log.path) if log else None,
    }


def _failure(
    exc: Exception, *, engine: PipelineEngine, topo: Topology, step: int, beat: Heartbeat
) -> StageFailure:
    dead = beat.dead_peers()
    who = (
        ", ".join(
            f"rank {r} (stage {engine.plan.stage_of_rank(r)}) silent for {age:.1f}s"
            for r, age in dead
        )
        or "no peer looks dead"
    )
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return StageFailure(
        f"rank {topo.rank} (stage {engine.stage_index}) failed at step {step} during the "
        f"pipeline step of {engine.plan!r}: {who}; cause: {first_line[:300]}"
    )


def _ckpt_dir(cfg: TrainConfig, step: int) -> Path:
    return Path(cfg.save_dir or "checkpoints") / f"step_{step:08d}"


def _save(engine: PipelineEngine, cfg: TrainConfig, *, topo: Topology, step: int) -> Path:
    meta = {
        "step": step,
        "plan": engine.plan.to_dict(),
        "config": cfg.to_dict(),
        "model": engine.model.name,
        "model_fingerprint": engine.model.fingerprint(),
        "data_position": step,
        "world_size": topo.world_size,
    }
    return save_checkpoint(
        _ckpt_dir(cfg, step),
        model_state=engine.model_state(),
        optim_state=engine.optim_state(),
        meta=meta,
        rank=topo.rank,
    )


def _resume(engine: PipelineEngine, path: str, *, topo: Topology) -> int:
    opt, meta = load_checkpoint(
        path,
        model_state=engine.model_state(),
        held_params=set(engine.named_params),
        rank=topo.rank,
        device=topo.device,
    )
    if meta.get("model_fingerprint") not in (None, engine.model.fingerprint()):
        raise UserError(
            f"checkpoint {path} is for a different layer list of {meta.get('model')} "
            "(fingerprint mismatch); resume with the model config it was written with"
        )
    from dynpipe.runtime.optim import import_state

    import_state(engine.optimizer, engine.named_params, opt)
    return int(meta["step"])


def _default_log_path(cfg: TrainConfig) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = cfg.model.rpartition(":")[2] or cfg.model
    return str(Path("runs") / f"{name}-{stamp}" / "log.jsonl")


def _progress(cfg: TrainConfig, start: int):
    from tqdm import tqdm

    return tqdm(
        total=cfg.steps,
        initial=start,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        mininterval=0.5,
    )
