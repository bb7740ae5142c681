"""The training loop of one rank: data, engine, run log, progress, checkpoints.

``train(cfg, topo=...)`` expects the process group to exist already (the worker entry point
or a test harness creates it); everything it needs arrives by argument.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dynpipe.data.loader import BatchStream
from dynpipe.errors import UserError
from dynpipe.models import LayeredModel, get_model
from dynpipe.planner.plan import Plan
from dynpipe.runtime.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from dynpipe.runtime.controller import AdaptConfig, Controller, Decision, Monitor
from dynpipe.runtime.engine import EngineConfig, NonFiniteLoss, PipelineEngine, StepResult
from dynpipe.runtime.health import Heartbeat, StageFailure
from dynpipe.runtime.optim import OptimConfig
from dynpipe.runtime.runlog import RunLog, environment
from dynpipe.runtime.topology import Topology

__all__ = [
    "RESTART_EXIT",
    "RestartRequested",
    "TrainConfig",
    "build_model_and_data",
    "default_log_path",
    "resolve_plan",
    "train",
]

# Exit status of a worker that checkpointed to be relaunched under a new plan (restart mode).
RESTART_EXIT = 3


class RestartRequested(SystemExit):
    """Raised by every rank after the restart baseline's checkpoint is written."""

    def __init__(self) -> None:
        super().__init__(RESTART_EXIT)


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs besides the topology.

    model / model_args: zoo name (or ``package.module:factory``) and its keyword config.
    data / data_path: a ``dynpipe.data`` source; real datasets read from ``data_path`` only.
    data_workers: processes loading batches ahead on the first and last stage's ranks
        (0: in the training process); None: on CUDA up to 4, within this host's cores per
        rank; 0 on CPU, where workers would take cores from the stages.
    plan: a plan file; without one, ``stages`` (default: world size) equal-layer stages.
    log: JSONL run-log path (written by the last stage's rank).
    log_every: steps between the gathers of per-stage timings (one small collective).
    save_every / save_dir: checkpoint cadence and folder; resume: checkpoint to resume from.
    adapt: repartitioning policy (``static`` never repartitions); its ``monitor_every``
        replaces ``log_every`` when adapting, since one gather serves both.
    scenario: interference scenario file; predictor: trained slowdown predictor (adaptive).
    telemetry: sample device telemetry in a side thread and gather it with stage times.
    """

    model: str = "mlp"
    model_args: dict[str, Any] = field(default_factory=dict)
    data: str = "synthetic"
    data_path: str | None = None
    data_workers: int | None = None
    steps: int = 100
    batch_size: int = 32
    microbatches: int | None = None
    schedule: str | None = None
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
    adapt: AdaptConfig = field(default_factory=lambda: AdaptConfig(mode="static"))
    scenario: str | None = None
    predictor: str | None = None
    telemetry: bool = True

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise UserError(f"--steps must be >= 0, got {self.steps}")
        if self.batch_size < 1:
            raise UserError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.data_workers is not None and self.data_workers < 0:
            raise UserError(f"--data-workers must be >= 0, got {self.data_workers}")
        if self.log_every < 1:
            raise UserError(f"--log-every must be >= 1, got {self.log_every}")
        if self.adapt.mode == "restart" and not (self.save_dir or self.log):
            raise UserError(
                "--adapt restart needs --save-dir or --log: relaunched workers must "
                "find the checkpoint in a folder every worker agrees on"
            )
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
    # A plan file's schedule and microbatches hold unless the command line overrides them.
    if cfg.plan:
        plan = Plan.load(cfg.plan)
        plan = dataclasses.replace(
            plan,
            schedule=cfg.schedule or plan.schedule,
            microbatches=cfg.microbatches or plan.microbatches,
        )
    else:
        plan = Plan.even(
            model,
            cfg.stages or world_size,
            schedule=cfg.schedule or "1f1b",
            microbatches=cfg.microbatches or 4,
        )
    plan.validate(model, world_size)
    from dynpipe.runtime.engine import check_batch

    check_batch(plan, cfg.batch_size)
    return plan


class _StepLog:
    """Buffers this rank's per-step timings; every window one all-gather hands every rank
    every stage's numbers and every device's telemetry (the monitor reads them, the writer
    logs them)."""

    def __init__(self, *, topo: Topology, plan: Plan, log: RunLog | None, batch_size: int):
        self.topo = topo
        self.plan = plan
        self.log = log
        self.batch_size = batch_size
        self.pending: list[StepResult] = []
        self.t_start = time.time()

    def add(self, res: StepResult) -> None:
        self.pending.append(res)

    def flush(self, telemetry: dict[str, float] | None = None) -> tuple[list[dict], list[dict]]:
        """Gather and log the pending steps; returns step records and per-rank telemetry."""
        if not self.pending:
            return [], []
        from dynpipe.profiler.schema import TELEMETRY_COLUMNS

        k = len(self.pending)
        row = [
            v
            for r in self.pending
            for v in (r.timing.fwd_total, r.timing.bwd_total, r.timing.wait_ms, r.step_ms)
        ]
        tel = telemetry or {}
        row += [float(tel.get(c, float("nan"))) for c in TELEMETRY_COLUMNS]
        mine = torch.tensor(row, dtype=torch.float64)
        if self.topo.world_size > 1:
            dev = self.topo.device
            parts = [torch.empty_like(mine, device=dev) for _ in range(self.topo.world_size)]
            dist.all_gather(parts, mine.to(dev))
            by_rank = [p.cpu() for p in parts]
        else:
            by_rank = [mine]
        times = [p[: 4 * k].view(k, 4) for p in by_rank]
        tels = [dict(zip(TELEMETRY_COLUMNS, p[4 * k :].tolist(), strict=True)) for p in by_rank]
        records = []
        for j, res in enumerate(self.pending):
            stages = []
            for s, st in enumerate(self.plan.stages):
                f, b, w, _ = times[st.rank][j].tolist()
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
        if self.log is not None and telemetry is not None:
            self.log.write(
                "telemetry",
                step=self.pending[-1].step,
                devices=[{k2: _finite(v) for k2, v in t.items()} for t in tels],
            )
        self.pending = []
        return records, tels


def _finite(v: float) -> float | None:
    return None if v != v else round(v, 4)  # NaN -> null in JSON


class _Adapter:
    """Monitor + controller + (restart or live) repartitioning, run at window boundaries."""

    def __init__(
        self, cfg: TrainConfig, *, engine: PipelineEngine, topo: Topology, log: RunLog | None
    ) -> None:
        from dynpipe.planner.costs import CostModel

        self.cfg, self.engine, self.topo, self.log = cfg, engine, topo, log
        self.adapt = cfg.adapt
        self.initial_plan = engine.plan
        self.beat: Heartbeat | None = None
        plan = engine.plan
        if self.adapt.mode == "static":
            return
        mb = cfg.batch_size // plan.microbatches
        costs = CostModel.from_model(engine.model, microbatch_size=mb, num_devices=plan.num_stages)
        predictor = prepared = None
        if cfg.predictor and self.adapt.mode in ("adaptive", "restart"):
            from dynpipe.models.stats import layer_stats
            from dynpipe.predictor import load_predictor, prepare_layers

            predictor = load_predictor(cfg.predictor)
            if hasattr(predictor.estimator, "set_predict_threads"):
                predictor.estimator.set_predict_threads(1)
            prepared = prepare_layers(
                predictor, layer_stats(engine.model, batch_size=mb), batch_size=mb
            )
        self.controller = Controller(
            costs=costs, config=self.adapt, predictor=predictor, prepared_layers=prepared
        )
        self.monitor = Monitor(plan.num_stages, ewma=self.adapt.ewma, jump=self.adapt.jump)
        self.settle = self.adapt.settle_windows
        self._calib: list[dict] = []  # step records of the calibration windows so far
        self._calib_windows = 0
        self._last_repartition: dict | None = None  # to log the first step under a new plan
        # (step ms before the last move, its predicted gain, the plan it left)
        self._judge: tuple[float, float, Plan] | None = None
        warm_ms = None
        if self.adapt.mode in ("measured", "adaptive"):
            from dynpipe.runtime.migrate import warm_links

            # On GPUs also one message the size of the largest layer's state (capped).
            warm = int(min(costs.state_bytes.max(), 64 << 20)) if topo.is_cuda else 0
            warm_ms = round(
                warm_links(topo.device, timeout_s=topo.timeout_s, warm_bytes=warm) * 1e3, 3
            )
        if log is not None:
            log.event(
                "adapt_mode",
                mode=self.adapt.mode,
                using=self.controller.mode_used,
                description=self.controller.describe(),
                links_warmed_ms=warm_ms,
            )

    def window(self, step: int, records: list[dict], tels: list[dict]) -> Decision | None:
        """Feed one window (ending after ``step``); repartition if the controller says so."""
        if self.adapt.mode == "static" or not records:
            return None
        if self._last_repartition is not None:
            self._log_first_step(records)
        if self.settle > 0:
            self.settle -= 1
            return None
        plan = self.engine.plan
        fwd, bwd = _stage_medians(records, plan.num_stages)
        self.monitor.update(fwd, bwd)
        if not self.controller.calibrated:
            # Clean costs from the medians over several windows' steps: one window of a
            # GPU that is still ramping its clocks or tuning kernels would bias every later
            # slowdown estimate of that device.
            self._calib += records
            self._calib_windows += 1
            if self._calib_windows < self.adapt.calibrate_windows:
                return None
            self.controller.calibrate(plan, *_stage_medians(self._calib, plan.num_stages))
            if self.log is not None:
                self.log.event("calibrated", step=step, steps=len(self._calib))
            self._calib = []
            return None
        if self.monitor.windows < 2:
            # One window under a new plan is too little to judge it by: a stage left with one
            # or two layers gives a noisy slowdown estimate, and acting on it makes plans flap.
            return None
        if self._judge is not None:
            revert = self._judge_move(step, records)
            if revert is not None:
                return None
        else:
            self.controller.quiet_window()
        t0 = time.perf_counter()
        telemetry = tels if self.controller.mode_used != "measured" else None
        decision = self.controller.decide(
            step=step + 1,
            plan=plan,
            fwd_step_ms=self.monitor.fwd,
            bwd_step_ms=self.monitor.bwd,
            telemetry=telemetry,
        )
        new_plan = self._agree(decision.plan if decision.repartition else None)
        decide_ms = (time.perf_counter() - t0) * 1e3
        if self.log is not None:
            self.log.event("decision", **decision.to_dict())
        if new_plan is None:
            return decision
        predicted = round(1 - decision.proposed_ms / max(decision.current_ms, 1e-9), 4)
        self._apply(new_plan, step=step, records=records, decide_ms=decide_ms)
        self._judge = (_median_step(records), predicted, plan)
        return decision

    def _judge_move(self, step: int, records: list[dict]) -> Plan | None:
        """The new plan's first trusted window: did the last move pay, as measured?

        A move that made steps clearly slower is undone at once: the plan before it was
        measured to be better, whatever the speed model believed. Returns the plan reverted
        to, if any.
        """
        assert self._judge is not None
        before, predicted, previous = self._judge
        self._judge = None
        after = _median_step(records)
        paid = self.controller.judge(before, after, predicted)
        # Slower by the minimum gain or more: beyond what one window's noise does here.
        worse = after > before * (1 + self.adapt.min_gain)
        t0 = time.perf_counter()
        # Every rank holds the same gathered numbers; the writer's verdict is still broadcast.
        target = self._agree(previous if worse and self.adapt.mode != "restart" else None)
        if self.log is not None:
            self.log.event(
                "judged",
                step=step,
                before_ms=before,
                after_ms=after,
                predicted_gain=predicted,
                achieved_gain=round(1 - after / max(before, 1e-9), 4),
                paid=paid,
                reverted=target is not None,
                trust=round(self.controller.trust, 4),
            )
        if target is not None:
            self._apply(
                target, step=step, records=records, decide_ms=(time.perf_counter() - t0) * 1e3
            )
        return target

    def _apply(self, new_plan: Plan, *, step: int, records: list[dict], decide_ms: float) -> None:
        """Move to ``new_plan`` after ``step`` (live, or by relaunch in restart mode)."""
        if self.adapt.mode == "restart":
            self._restart(new_plan, step=step + 1, decide_ms=decide_ms)
        from dynpipe.runtime.migrate import repartition

        old = self.engine.plan
        stats = repartition(self.engine, new_plan, beat=self.beat)
        pause_ms = decide_ms + (stats.transfer_s + stats.rebuild_s) * 1e3
        self.controller.applied(step + 1, pause_ms)
        self.monitor.reset(new_plan.num_stages)
        self.settle = self.adapt.settle_windows
        moved = self._bytes(stats)  # collective: every rank takes part
        if self.log is not None:
            self.log.event(
                "repartition",
                step=step + 1,
                mode=self.controller.mode_used,
                old_plan=old.to_dict(),
                new_plan=new_plan.to_dict(),
                transfers=[repr(t) for t in stats.transfers],
                bytes=moved,
                decide_ms=round(decide_ms, 3),
                transfer_ms=round(stats.transfer_s * 1e3, 3),
                rebuild_ms=round(stats.rebuild_s * 1e3, 3),
                pause_ms=round(pause_ms, 3),
                **{
                    f"{k}_ms": round(getattr(stats, f"{k}_s") * 1e3, 3)
                    for k in ("pack", "wire", "unpack", "build", "engine")
                },
            )
        self._last_repartition = {"step": step + 1, "before_ms": _median_step(records)}

    def _log_first_step(self, records: list[dict]) -> None:
        """The first step under a new plan, next to the steps before and after it: what the
        repartition cost beyond its logged pause (new buffers, the schedule's first run)."""
        info, self._last_repartition = self._last_repartition, None
        first = next((r for r in records if r["step"] == info["step"]), None)
        if first is None or self.log is None:
            return
        rest = [r for r in records if r["step"] != info["step"]]
        self.log.event(
            "first_step",
            step=info["step"],
            first_step_ms=first["step_ms"],
            before_ms=info["before_ms"],
            after_ms=_median_step(rest) if rest else None,
        )

    def _bytes(self, stats) -> int:
        # Every rank knows only what it sent; the sum over ranks is the bytes moved.
        t = torch.tensor([stats.bytes_sent], dtype=torch.int64, device=self.topo.device)
        if self.topo.world_size > 1:
            dist.all_reduce(t)
        return int(t.item())

    def _agree(self, plan: Plan | None) -> Plan | None:
        """The writer's decision, broadcast: ranks never act on different plans."""
        if self.topo.world_size == 1:
            return plan
        cur = self.engine.plan
        n = cur.num_stages
        t = torch.zeros(n + 2, dtype=torch.int64, device=self.topo.device)
        src = cur.stages[-1].rank
        if self.topo.rank == src and plan is not None:
            t[0] = 1
            t[1:] = torch.tensor([st.start for st in plan.stages] + [plan.num_layers])
        dist.broadcast(t, src=src)
        if int(t[0]) == 0:
            return None
        cuts = t[1:].tolist()
        if self.topo.rank == src and plan is not None:
            return plan
        return Plan.from_bounds(
            self.engine.model,
            list(itertools.pairwise(cuts)),
            ranks=cur.ranks,
            schedule=cur.schedule,
            microbatches=cur.microbatches,
            meta={**cur.meta, "method": f"controller:{self.controller.mode_used}"},
        )

    def _restart(self, new_plan: Plan, *, step: int, decide_ms: float) -> None:
        meta_extra = {
            "restart_plan": new_plan.to_dict(),
            "controller": self.controller.state(),
            "initial_plan": self.initial_plan.to_dict(),
            "decided_time": time.time(),
        }
        _save(
            self.engine,
            self.cfg,
            topo=self.topo,
            step=step,
            path=_restart_dir(self.cfg),
            extra=meta_extra,
        )
        if self.log is not None:
            self.log.event(
                "restart", step=step, new_plan=new_plan.to_dict(), decide_ms=round(decide_ms, 3)
            )
            self.log.close()
        raise RestartRequested()


def _auto_workers(topo: Topology) -> int:
    if not topo.is_cuda:
        return 0
    # Ranks of this host share its cores; a 224x224 batch of 64 takes ~40 ms of one core.
    per_rank = (os.cpu_count() or 2) // max(torch.cuda.device_count(), 1)
    return max(1, min(4, per_rank - 1))


def _stage_medians(records: list[dict], num_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-stage median forward and backward ms over the steps of ``records``.

    Medians, not means: one step stalled by something else on the machine must not look
    like a slowed device.
    """
    fwd = [np.median([r["stages"][s]["fwd_ms"] for r in records]) for s in range(num_stages)]
    bwd = [np.median([r["stages"][s]["bwd_ms"] for r in records]) for s in range(num_stages)]
    return np.array(fwd), np.array(bwd)


def _median_step(records: list[dict]) -> float:
    return round(float(np.median([r["step_ms"] for r in records])), 4)


def _restart_dir(cfg: TrainConfig) -> Path:
    base = Path(cfg.save_dir) if cfg.save_dir else Path(cfg.log or default_log_path(cfg)).parent
    return base / "restart"


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
    initial_plan = plan
    resume, restart_meta = cfg.resume, None
    relaunched = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if relaunched and (_restart_dir(cfg) / "dynpipe.json").is_file():
        # Restart baseline: this process is the relaunch; continue under the decided plan.
        resume = str(_restart_dir(cfg))
        restart_meta = json.loads((Path(find_checkpoint(resume)) / "dynpipe.json").read_text())
        plan = Plan.from_dict(restart_meta["restart_plan"])
        initial_plan = Plan.from_dict(
            restart_meta.get("initial_plan", restart_meta["restart_plan"])
        )
    engine = PipelineEngine(
        model,
        plan,
        topo=topo,
        config=EngineConfig(
            batch_size=cfg.batch_size, optim=cfg.optim, bf16=cfg.bf16, timing=cfg.timing
        ),
    )
    start = 0
    if resume:
        start = _resume(engine, resume, topo=topo)
    writer = plan.stages[-1].rank == topo.rank
    log = None
    if writer:
        log = RunLog(cfg.log or default_log_path(cfg), append=bool(resume))
        log.header(
            config=cfg.to_dict(),
            plan=plan.to_dict(),
            world_size=topo.world_size,
            backend=topo.backend,
            env=environment(topo.device),
            start_step=start,
        )
        if restart_meta is not None:
            log.event(
                "resumed",
                step=start,
                pause_ms=round((time.time() - restart_meta["decided_time"]) * 1e3, 3),
            )
    adapting = cfg.adapt.mode != "static"
    every = cfg.adapt.monitor_every if adapting else cfg.log_every
    steplog = _StepLog(topo=topo, plan=plan, log=log, batch_size=cfg.batch_size)
    adapter = _Adapter(cfg, engine=engine, topo=topo, log=log)
    adapter.initial_plan = initial_plan
    if restart_meta is not None:
        adapter.controller.load_state(restart_meta.get("controller", {}))
        adapter.controller.applied(start, 0.0)
    runner = _scenario_runner(cfg, engine=engine, topo=topo, targets=initial_plan.ranks)
    sampler = _sampler(cfg, topo)
    bar = _progress(cfg, start) if writer and cfg.progress else None
    beat = Heartbeat(rank=topo.rank, world_size=topo.world_size).start()
    adapter.beat = beat
    losses: list[float] = []
    step = start
    # Middle stages never read a batch: they do not load one either. A rank's stage index is
    # the same under every plan of the run (repartitions keep the plan's rank order), so the
    # ranks that load are fixed; the stream resumes at ``start`` like the data itself.
    stream = None
    if engine.is_first or engine.is_last:
        workers = cfg.data_workers if cfg.data_workers is not None else _auto_workers(topo)
        stream = BatchStream(
            data,
            batch_size=cfg.batch_size,
            start=start,
            stop=max(start, cfg.steps),
            workers=workers,
            device=topo.device,
            timeout_s=topo.timeout_s,
        )
    try:
        if runner is not None:
            runner.prepare()
            runner.resume_at(start)
        for step in range(start, cfg.steps):
            if runner is not None:
                for rec in runner.apply(step):
                    if log is not None:
                        log.event(rec.pop("event"), **rec)
            try:
                res = engine.step(step, stream.batch(step) if stream is not None else None)
            except NonFiniteLoss:
                raise
            except Exception as exc:
                raise _failure(exc, engine=engine, topo=topo, step=step, beat=beat) from exc
            losses.append(res.loss)
            steplog.add(res)
            if on_step is not None:
                on_step(engine, res)
            if (step + 1) % every == 0 or step + 1 == cfg.steps:
                steplog.plan = engine.plan
                records, tels = steplog.flush(sampler.window() if sampler else None)
                if step + 1 < cfg.steps:
                    adapter.window(step, records, tels)
            if bar is not None:
                bar.update(1)
                split = "|".join(str(len(st)) for st in engine.plan.stages)
                bar.set_postfix(loss=f"{res.loss:.4f}", ms=f"{res.step_ms:.0f}", split=split)
            if cfg.save_every and (step + 1) % cfg.save_every == 0:
                _save(engine, cfg, topo=topo, step=step + 1)
                if log is not None:
                    log.event("checkpoint", step=step + 1, path=str(_ckpt_dir(cfg, step + 1)))
        if log is not None:
            log.event("end", step=cfg.steps, plan=engine.plan.to_dict())
    finally:
        if stream is not None:
            stream.close()
        beat.stop()
        if sampler is not None:
            sampler.stop()
        if runner is not None:
            runner.close()
        if bar is not None:
            bar.close()
        if log is not None:
            log.close()
    return {
        "losses": losses,
        "start": start,
        "steps": cfg.steps,
        "plan": engine.plan,
        "log": str(log.path) if log else None,
    }


def _scenario_runner(
    cfg: TrainConfig, *, engine: PipelineEngine, topo: Topology, targets: list[int]
):
    if not cfg.scenario:
        return None
    from dynpipe.runtime.scenario import ScenarioRunner, load_scenario

    scenario = load_scenario(cfg.scenario, num_stages=engine.plan.num_stages)
    device = f"cuda:{topo.device.index}" if topo.is_cuda else "cpu"
    return ScenarioRunner(
        scenario, rank=topo.rank, target_ranks=targets, device=device, timer=engine.timer
    )


def _sampler(cfg: TrainConfig, topo: Topology):
    if not cfg.telemetry:
        return None
    from dynpipe.profiler.telemetry import TelemetrySampler

    device = f"cuda:{topo.device.index}" if topo.is_cuda else "cpu"
    return TelemetrySampler(device).start()


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


def _save(
    engine: PipelineEngine,
    cfg: TrainConfig,
    *,
    topo: Topology,
    step: int,
    path: Path | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    meta = {
        **(extra or {}),
        "step": step,
        "plan": engine.plan.to_dict(),
        "config": cfg.to_dict(),
        "model": engine.model.name,
        "model_fingerprint": engine.model.fingerprint(),
        "data_position": step,
        "world_size": topo.world_size,
    }
    return save_checkpoint(
        path or _ckpt_dir(cfg, step),
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


def default_log_path(cfg: TrainConfig) -> str:
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
