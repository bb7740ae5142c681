"""The training loop of one rank: data, engine, run log, progress, checkpoints.

``train(cfg, topo=...)`` expects the process group to exist already (the worker entry point
or a test harness creates it); everything it needs arrives by argument.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from dynpipe.data.loader import BatchStream, CyclicBatches
from dynpipe.errors import UserError
from dynpipe.models import LayeredModel
from dynpipe.models.cut import cut_model_meta
from dynpipe.planner.costs import CostModel
from dynpipe.planner.diff import diff
from dynpipe.planner.plan import Plan, split_label
from dynpipe.runtime.adapt.loop import Adapter
from dynpipe.runtime.adapt.make import activation_bytes, make_policy, warm_bytes
from dynpipe.runtime.adapt.policy import Policy
from dynpipe.runtime.adapt.window import Window
from dynpipe.runtime.autodp import AutoDP
from dynpipe.runtime.checkpoint import (
    CheckpointCorrupt,
    find_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_marker,
)
from dynpipe.runtime.checkpointer import Checkpointer, SaveRecord
from dynpipe.runtime.collect import StepCollector
from dynpipe.runtime.config import TrainConfig
from dynpipe.runtime.engine import EngineConfig, NonFiniteLoss, PipelineEngine, StepResult
from dynpipe.runtime.health import (
    Heartbeat,
    StageFailure,
    find_oom,
    out_of_memory,
    read_progress,
)
from dynpipe.runtime.mesh import Mesh, init_mesh, init_meshes
from dynpipe.runtime.prepare import (
    build_model_and_data,
    checkpoint_dir,
    default_log_path,
    resolve_plan,
)
from dynpipe.runtime.records import (
    LayerTimes,
    ReplicaTiming,
    StageTiming,
    Step,
    Telemetry,
    read_log,
)
from dynpipe.runtime.runlog import RunLog, code_revision, environment
from dynpipe.runtime.signals import Stopped, StopRequest
from dynpipe.runtime.topology import Topology, slowest

__all__ = [
    "RESTART_EXIT",
    "RestartRequested",
    "build_model_and_data",
    "checkpoint_dir",
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


@dataclass
class _Gathered:
    """One window as every rank sees it after the gather: step records, the sampled step's
    per-layer timings (replica 0's, and with replicas every replica's), per-rank telemetry
    and free device memory."""

    records: list[dict]
    layers: dict[str, Any] | None
    telemetry: list[dict[str, float]]
    free_bytes: list[float]
    replica_layers: list[dict[str, Any] | None] | None = None
    # Probing rank (idle, or light: ``PipelineEngine.step``) -> (layer, fwd_ms, bwd_ms).
    probes: dict[int, tuple[int, float, float]] | None = None


# Per step and rank: forward, backward, wait, step, reduce, between-steps and update
# milliseconds.
_TIMES = 7


class _StepLog:
    """Buffers this rank's per-step timings; every window one all-gather hands every rank
    every stage's numbers, every layer's sampled timings and every device's telemetry (the
    adaptation loop reads them, the writer logs them).

    Every rank builds the same records from what the gather brought: the policy runs on
    every rank, and only a window that is the same on all of them keeps their policies'
    state the same, so that any rank's decision is the job's. ``clock_rank``: the rank whose
    step times are the job's (the log's writer, whose clock the log has always recorded);
    each rank's own differs, by when its part of a step starts and by the policy's host
    time where it outlasts the device.
    """

    def __init__(
        self,
        *,
        topo: Topology,
        plan: Plan,
        log: RunLog | None,
        batch_size: int,
        clock_rank: int,
        mesh: Mesh | None = None,
    ):
        self.topo = topo
        self.clock_rank = clock_rank
        self.plan = plan
        self.log = log
        self.batch_size = batch_size
        self.mesh = mesh or Mesh.single(rank=topo.rank, world_size=topo.world_size)
        self.pending: list[StepResult] = []
        self.t_start = time.time()
        # Records carry every replica's timings (``replicas``) with replicas, and for one
        # pipeline whose policy is the replica policy (``--reshape``: a run of one replica).
        self.replicated = self.mesh.dp > 1
        # What this rank reports as its stage's free memory (default: the device's).
        self.free: Callable[[], float] | None = None

    def add(self, res: StepResult) -> None:
        self.pending.append(res)

    def _layer_row(self) -> list[float]:
        """``[6L + 2]``: this rank's per-layer fwd/bwd ms (NaN for layers it does not hold)
        from the window's last sampled step, then that step's stage medians, then the host's
        fwd/bwd times to issue the layers, then the device's alone (GPU; NaN on CPU): the
        slots of ``_LAYER_FIELDS``."""
        n = self.plan.num_layers
        row = [float("nan")] * (6 * n + 2)
        sampled = [r.timing.layers for r in self.pending if r.timing.layers is not None]
        stage = self.plan.stage_of_rank(self.mesh.pp_rank)
        if not sampled or stage is None:
            return row
        lt, st = sampled[-1], self.plan.stages[stage]
        row[2 * n], row[2 * n + 1] = lt.stage_fwd_ms, lt.stage_bwd_ms
        for name, at in _layer_slots(n):
            times = getattr(lt, name)
            if times is not None:  # host and device times: GPU only
                row[at + st.start : at + st.stop] = times
        return row

    def flush(self, telemetry: dict[str, float] | None = None) -> _Gathered | None:
        """Gather and log the pending steps."""
        if not self.pending:
            return None
        from dynpipe.devices.columns import TELEMETRY_COLUMNS

        k, n = len(self.pending), self.plan.num_layers
        row = [
            v
            for r in self.pending
            for v in (
                r.timing.fwd_total,
                r.timing.bwd_total,
                r.timing.wait_ms,
                r.step_ms,
                r.timing.reduce_ms,
                r.between_ms,
                r.timing.update_ms,
            )
        ]
        tel = telemetry or {}
        row += [float(tel.get(c, float("nan"))) for c in TELEMETRY_COLUMNS]
        row += self._layer_row()
        # The window's last probe (an idle or light rank's): layer, fwd ms, bwd ms.
        probed = [r.probe for r in self.pending if r.probe is not None]
        row += list(probed[-1]) if probed else [float("nan")] * 3
        row.append(self.free() if self.free is not None else _free_bytes(self.topo))
        mine = torch.tensor(row, dtype=torch.float64)
        if self.topo.world_size > 1:
            dev = self.topo.device
            parts = [torch.empty_like(mine, device=dev) for _ in range(self.topo.world_size)]
            dist.all_gather(parts, mine.to(dev))
            by_rank = [p.cpu() for p in parts]
        else:
            by_rank = [mine]
        nt = len(TELEMETRY_COLUMNS)
        times = [p[: _TIMES * k].view(k, _TIMES) for p in by_rank]
        tels = [
            dict(zip(TELEMETRY_COLUMNS, p[_TIMES * k : _TIMES * k + nt].tolist(), strict=True))
            for p in by_rank
        ]
        layer_rows = [p[_TIMES * k + nt : -4].tolist() for p in by_rank]
        probe_rows = [p[-4:-1].tolist() for p in by_rank]
        free = [float(p[-1]) for p in by_rank]
        steps = []
        clock = times[self.clock_rank]
        for j, res in enumerate(self.pending):
            replicas = [self._replica(times, r, j) for r in range(self.mesh.dp)]
            step_ms = float(clock[j, 3])  # the job's step time, the same on every rank
            # The job waits for its last rank to start: the longest time between steps.
            between = max(float(t[j, 5]) for t in times)
            rec = Step(
                step=res.step,
                # When this step ended here: seconds since this process started training, and
                # the epoch time (which a relaunched run shares with the launch before it).
                wall=round(res.end_time - self.t_start, 4),
                t_end=round(res.end_time, 4),
                step_ms=round(step_ms, 4),
                between_ms=round(between, 4),
                loss=res.loss,
                lr=res.lr,
                grad_norm=res.grad_norm,
                samples_per_s=round(self.batch_size / (step_ms / 1e3), 3),
                stages=replicas[0].stages,
                replicas=tuple(replicas) if self.replicated else (),
            )
            steps.append(rec)
            if self.log is not None:
                self.log.record(rec)
        probes = {}
        for r, (i, f, b) in enumerate(probe_rows if self.mesh.dp == 1 else []):
            if i == i and f == f and b == b:
                probes[r] = (int(i), f, b)
        per_replica = [self._layers(layer_rows, n, r) for r in range(self.mesh.dp)]
        layers = per_replica[0]
        if self.log is not None and layers is not None:
            extra = {}
            if self.replicated:
                extra["replicas"] = tuple(x or {} for x in per_replica)
            if probes:
                extra["probes"] = tuple(
                    (r, i, round(f, 4), round(b, 4)) for r, (i, f, b) in sorted(probes.items())
                )
            self.log.record(LayerTimes(step=self.pending[-1].step, **layers, **extra))
        if self.log is not None and telemetry is not None:
            self.log.record(
                Telemetry(
                    step=self.pending[-1].step,
                    devices=tuple({k2: _finite(v) for k2, v in t.items()} for t in tels),
                )
            )
        # The adaptation loop reads the window's steps as plain dicts.
        records = [rec.to_dict() for rec in steps]
        self.pending = []
        return _Gathered(
            records=records,
            layers=layers,
            telemetry=tels,
            free_bytes=free,
            replica_layers=per_replica if self.replicated else None,
            probes=probes,
        )

    def _replica(self, times: list[torch.Tensor], replica: int, j: int) -> ReplicaTiming:
        """Step ``j`` of the window on ``replica``'s stages."""
        stages, busy, reduce = [], 0.0, 0.0
        for s, st in enumerate(self.plan.stages):
            rank = self.mesh.global_rank(st.rank, replica)
            f, b, w, _, red, _, upd = times[rank][j].tolist()
            busy, reduce = max(busy, f + b), max(reduce, red)
            stages.append(
                StageTiming(
                    stage=s,
                    rank=rank,
                    layers=(st.start, st.stop),
                    fwd_ms=round(f, 4),
                    bwd_ms=round(b, 4),
                    wait_ms=round(w, 4),
                    update_ms=round(upd, 4) if upd == upd else None,
                )
            )
        dropped = replica in self.plan.dropped
        return ReplicaTiming(
            replica=replica,
            microbatches=0 if dropped else self.plan.replica_microbatches[replica],
            compute_ms=round(busy, 4),
            reduce_ms=round(reduce, 4),
            dropped=dropped,
            stages=tuple(stages),
        )

    def _layers(self, rows: list[list[float]], n: int, replica: int = 0) -> dict[str, Any] | None:
        """Every layer's sampled time in ``replica`` from the rank that holds it (None if none
        sampled)."""
        got = {name: [float("nan")] * n for name, _ in _layer_slots(n)}
        sf, sb = [], []
        for st in self.plan.stages:
            row = rows[self.mesh.global_rank(st.rank, replica)]
            for name, at in _layer_slots(n):
                got[name][st.start : st.stop] = row[at + st.start : at + st.stop]
            sf.append(row[2 * n])
            sb.append(row[2 * n + 1])
        if all(v != v for v in got["fwd_ms"]):
            return None
        r4 = lambda xs: [_finite(v) for v in xs]  # noqa: E731
        out = {
            "fwd_ms": r4(got["fwd_ms"]),
            "bwd_ms": r4(got["bwd_ms"]),
            "stage_fwd_ms": r4(sf),
            "stage_bwd_ms": r4(sb),
        }
        for kind in ("launch", "device"):  # GPU only: the host's and the device's times
            if any(v == v for v in got[f"{kind}_fwd_ms"]):
                out[f"{kind}_fwd_ms"] = r4(got[f"{kind}_fwd_ms"])
                out[f"{kind}_bwd_ms"] = r4(got[f"{kind}_bwd_ms"])
        return out


def _layer_slots(n: int) -> tuple[tuple[str, int], ...]:
    """Where each per-layer field of ``LayerTiming`` sits in a rank's gathered row of ``n``
    layers (``_StepLog._layer_row``): the stage medians take the two slots after the first
    pair."""
    return (
        ("fwd_ms", 0),
        ("bwd_ms", n),
        ("launch_fwd_ms", 2 * n + 2),
        ("launch_bwd_ms", 3 * n + 2),
        ("device_fwd_ms", 4 * n + 2),
        ("device_bwd_ms", 5 * n + 2),
    )


def _free_bytes(topo: Topology) -> float:
    """Device memory this rank's stage could still take: the device's free memory plus what
    this process's allocator holds unused (NaN on CPU, where no limit is planned)."""
    if not topo.is_cuda:
        return float("nan")
    free, _total = torch.cuda.mem_get_info(topo.device)
    cached = torch.cuda.memory_reserved(topo.device) - torch.cuda.memory_allocated(topo.device)
    return float(free + cached)


def _window(
    got: _Gathered, plan: Plan, *, telemetry: bool, world_size: int, replicated: bool = False
) -> Window:
    """The window the policy reads; ``replicated``: with every replica's part (a run of the
    replica policy in one pipeline has one), which replicated plans always have."""
    extra: dict[str, Any] = {}
    if plan.dp == 1:
        # Idle ranks' probes and light ranks' (``PipelineEngine.step``).
        extra = {"idle": tuple(plan.idle_ranks(world_size)), "probes": got.probes or None}
    if plan.dp > 1 or replicated:
        extra = {
            "shares": plan.replica_microbatches,
            "dropped": plan.dropped,
            "replica_layers": got.replica_layers,
        }
    return Window.from_records(
        got.records,
        bounds=plan.bounds,
        ranks=plan.ranks,
        microbatches=plan.microbatches,
        schedule=plan.schedule,
        layers=got.layers,
        telemetry=got.telemetry if telemetry else None,
        memory_bytes=got.free_bytes,
        **extra,
    )


def _finite(v: float) -> float | None:
    return None if v != v else round(v, 4)  # NaN -> null in JSON


def _auto_workers(topo: Topology) -> int:
    if not topo.is_cuda:
        return 0
    # Ranks of this host share its cores; a 224x224 batch of 64 takes ~40 ms of one core.
    per_rank = (os.cpu_count() or 2) // max(torch.cuda.device_count(), 1)
    return max(1, min(4, per_rank - 1))


def _restart(
    adapter: Adapter,
    new_plan: Plan,
    step: int,
    decide_ms: float,
    *,
    cfg: TrainConfig,
    initial_plan: Plan,
    ckpt: Checkpointer,
) -> NoReturn:
    """The restart baseline: checkpoint under the old plan, then exit to be relaunched."""
    extra = {"restart_plan": new_plan.to_dict(), "decided_time": time.time()}
    _save(
        ckpt,
        adapter.engine,
        cfg,
        topo=adapter.topo,
        step=step,
        reason="restart",
        initial_plan=initial_plan,
        adapter=adapter,
        extra=extra,
        block=True,
    )
    if adapter.log is not None:
        adapter.log.event(
            "restart", step=step, new_plan=new_plan.to_dict(), decide_ms=round(decide_ms, 3)
        )
        adapter.log.close()
    raise RestartRequested()


def _checkpointer(cfg: TrainConfig, topo: Topology) -> Checkpointer | None:
    root = checkpoint_dir(cfg)
    if root is None:
        return None
    return Checkpointer(
        root,
        rank=topo.rank,
        keep=cfg.keep_checkpoints,
        run_id=topo.run_id,
        timeout_s=topo.timeout_s,
    )


def _resume_candidates(cfg: TrainConfig, topo: Topology) -> list[tuple[Path, bool]]:
    """Checkpoints to resume from, in order of preference, each with whether the run
    continues under the plan and adaptation state saved in it (automatic resumes do)."""
    out: list[tuple[Path, bool]] = []
    root = checkpoint_dir(cfg)
    if topo.restart_attempt > 0 and root is not None:
        # A relaunch continues its own run: the newest checkpoint this run published.
        done, _ = list_checkpoints(root)
        out += [(i.path, True) for i in reversed(done) if i.run_id == topo.run_id]
    mode = cfg.resume or ("auto" if cfg.max_restarts else None)
    if mode == "auto" and root is not None:
        done, _ = list_checkpoints(root)
        out += [(i.path, True) for i in reversed(done)]
    elif mode and mode != "auto":
        out.append((find_checkpoint(mode), False))
    seen: set[Path] = set()
    return [(p, a) for p, a in out if not (p in seen or seen.add(p))]


def _checkpoint_plan(meta: dict[str, Any], model: LayeredModel, world_size: int) -> Plan | None:
    """The plan a checkpoint's run was under (the restart baseline's: the one it decided)."""
    try:
        plan = Plan.from_dict(meta.get("restart_plan") or meta["plan"])
        plan.validate(model, world_size, elastic=True)
        return plan
    except (UserError, KeyError, TypeError):
        return None  # saved for another world size: the command line's plan then


def _open(
    cfg: TrainConfig,
    model: LayeredModel,
    plan: Plan,
    topo: Topology,
    *,
    mesh: Mesh | None = None,
    meshes: dict[int, Mesh] | None = None,
) -> tuple[PipelineEngine, int, dict[str, Any] | None, list[tuple[str, str]]]:
    """The engine, the first step to run, the automatic resume's checkpoint meta (None on a
    fresh start or a ``--resume PATH``), and the checkpoints skipped as unusable.

    ``mesh``: the run's replicas; a checkpoint's plan for another number of replicas is not
    resumed under (the command line's plan is), unless ``meshes`` holds every shape's mesh
    (``--autodp``: a run that changed shape resumes in the shape it saved)."""

    def build(p: Plan) -> PipelineEngine:
        return PipelineEngine(
            model,
            p,
            topo=topo,
            config=EngineConfig(
                batch_size=cfg.batch_size,
                optim=cfg.optim,
                bf16=cfg.bf16,
                timing=cfg.timing,
                fp16=cfg.fp16,
                recompute=cfg.recompute,
                memory_bytes=_stage_memory(cfg, topo),
                compile=cfg.compile_backend if cfg.compile else None,
            ),
            mesh=meshes[p.dp] if meshes is not None else mesh,
        )

    engine: PipelineEngine | None = None
    skipped: list[tuple[str, str]] = []
    candidates = _resume_candidates(cfg, topo)
    for i, (path, automatic) in enumerate(candidates):
        try:
            meta = read_marker(path).meta
            want = (_checkpoint_plan(meta, model, topo.world_size) if automatic else None) or plan
            if want.dp != plan.dp and (meshes is None or want.dp not in meshes):
                want = plan
            if automatic and meta.get("frozen"):
                want = _holding_prefix(want, model, frozen=int(meta["frozen"]), topo=topo)
            if engine is None or engine.plan != want:
                engine = build(want)
            if automatic and meta.get("frozen"):
                engine.freeze(int(meta["frozen"]))  # its optimizer state was not saved
            start = _resume(engine, path, topo=topo)
            return engine, start, (meta if automatic else None), skipped
        except CheckpointCorrupt as exc:
            if not automatic or i + 1 == len(candidates):
                raise
            skipped.append((str(path), str(exc)))  # an older checkpoint may still be good
    if engine is None or engine.plan != plan:
        engine = build(plan)
    return engine, 0, None, skipped


def _memory_plan(engine: PipelineEngine, *, topo: Topology) -> list[dict[str, Any]]:
    """Per rank: its stage, the layers it recomputes, its predicted peak and its limit."""
    import torch.distributed as dist

    gib = lambda b: None if b is None else round(float(b) / 1024**3, 4)  # noqa: E731
    mine = {
        "rank": topo.rank,
        "stage": engine.stage_index,
        "recomputed": list(engine.recomputed),
        "predicted_peak_gib": gib(engine.predicted_peak_bytes),
        "limit_gib": gib(engine.config.memory_bytes),
    }
    if topo.world_size == 1 or not dist.is_initialized():
        return [mine]
    every: list[Any] = [None] * topo.world_size
    dist.all_gather_object(every, mine)
    return every


def _room(engine: PipelineEngine, topo: Topology) -> float:
    """--recompute auto: the free memory this rank reports, so that the policy's budget for
    its stage (what the model says the stage holds without recomputation, plus this) is the
    limit the stage itself chooses its recomputed layers under. The device's free memory
    would overstate a stage whose recomputation already saves memory."""
    limit, costs = engine.config.memory_bytes, engine._mem_costs
    if limit is None or costs is None:
        return _free_bytes(topo)
    if engine.idle:
        return float(limit)
    from dynpipe.planner.evaluate import in_flight
    from dynpipe.planner.recompute import choose_recompute

    plan, s = engine.plan, engine.stage_index
    st = plan.stages[s]
    k = in_flight(plan.schedule, num_stages=plan.num_stages, microbatches=plan.microbatches)
    kept = choose_recompute(
        costs, device=0, start=st.start, stop=st.stop, in_flight=int(k[s]), mode="none"
    )
    return float(limit) - kept.peak_bytes


def _stage_memory(cfg: TrainConfig, topo: Topology) -> float | None:
    """What this rank's stage may hold, for --recompute auto (None otherwise)."""
    if cfg.recompute != "auto":
        return None
    from dynpipe.runtime.memory import device_memory_bytes

    return device_memory_bytes(topo.device, memory_gb=cfg.memory_gb)


def _holding_prefix(plan: Plan, model: LayeredModel, *, frozen: int, topo: Topology) -> Plan:
    """``plan`` with its first stage holding the frozen prefix and a layer that trains (a
    checkpoint with frozen layers resumed under another plan than its own)."""
    if plan.stages[0].stop > frozen:
        return plan
    from dynpipe.runtime.freeze import keep_prefix_in_stages, keep_prefix_on_first

    kw = {"schedule": plan.schedule, "microbatches": plan.microbatches, "meta": plan.meta}
    if plan.dp == 1:
        wide = keep_prefix_on_first(plan.wide_bounds(topo.world_size), frozen=frozen)
        return Plan.from_wide_bounds(model, wide, **kw)
    bounds = keep_prefix_in_stages(tuple(plan.bounds), frozen=frozen)
    if bounds is None:
        raise UserError(
            f"the checkpoint froze {frozen} of {plan.num_layers} layers, which leaves "
            f"{plan.num_layers - frozen} for {plan.num_stages} stages of {plan.dp} replicas; "
            f"resume with --dp {topo.world_size} (or --autodp, in the shape it was saved in)"
        )
    return dataclasses.replace(
        Plan.from_bounds(model, list(bounds), ranks=plan.ranks, **kw), dp=plan.dp
    )


def _link_bandwidth(
    cfg: TrainConfig,
    model: LayeredModel,
    *,
    topo: Topology,
    microbatch_size: int,
    log: RunLog | None,
) -> float | None:
    """The links' measured bandwidth in the cost model's float32 bytes, for the modes that
    plan from costs (a collective: every rank's ``cfg`` names the same mode)."""
    if cfg.adapt.mode not in ("measured", "adaptive", "restart") or topo.world_size == 1:
        return None
    from dynpipe.runtime.links import measure_bandwidth

    act = activation_bytes(model, microbatch_size=microbatch_size)
    # Activations travel in bfloat16 under --bf16 on CUDA: a float32 byte of the model
    # costs half a byte on the wire.
    wire = 0.5 if (cfg.bf16 or cfg.fp16) and topo.is_cuda else 1.0
    bw = measure_bandwidth(topo, nbytes=int(act * wire))
    if bw is None:
        return None
    if log is not None:
        log.event("links", bandwidth_gbs=round(bw / 1e9, 3), message_bytes=int(act * wire))
    return bw / wire


def train(
    cfg: TrainConfig,
    *,
    topo: Topology,
    on_step: Callable[[PipelineEngine, StepResult], None] | None = None,
    policy: Policy | None = None,
    stop: StopRequest | None = None,
) -> dict[str, Any]:
    """Run ``cfg.steps`` steps on this rank; returns a summary (losses, final step).

    ``policy``: the adaptation policy (default: the one ``cfg.adapt`` names; tests and
    benchmarks inject their own). Every rank must be given an equivalent one.
    ``stop``: signals seen by this worker; when one arrives, every rank stops at the same
    step, after a final checkpoint if the run has a checkpoint folder (``Stopped`` is raised).
    """
    torch.manual_seed(cfg.seed)
    if cfg.compile:
        from dynpipe.runtime.compiled import check_backend

        check_backend(cfg.compile_backend)
    model, data = build_model_and_data(cfg)
    plan = resolve_plan(cfg, model, topo.world_size)
    ckpt = _checkpointer(cfg, topo)
    # The mesh of the run's replicas (collective); every plan of the run keeps its dp,
    # unless --autodp or --reshape may change it: then every shape's mesh is made now.
    meshes = init_meshes(topo) if cfg.autodp or cfg.adapt.reshape else None
    if meshes is not None and cfg.adapt.reshape:
        _warm_groups(meshes, topo=topo)
    mesh = meshes[plan.dp] if meshes is not None else init_mesh(topo, dp=plan.dp)
    engine, start, meta, skipped = _open(cfg, model, plan, topo, mesh=mesh, meshes=meshes)
    plan, mesh = engine.plan, engine.mesh
    initial_plan = (
        Plan.from_dict(meta["initial_plan"]) if meta and meta.get("initial_plan") else plan
    )
    writer = mesh.replica == 0 and engine.is_last
    # Replica 0's last stage writes the log: its place is its global rank. The same process
    # writes it for the whole run (whatever later plans make of its rank), and its clock
    # times every rank's windows (``_StepLog``).
    writer_rank = plan.stages[-1].rank
    assert writer == (topo.rank == writer_rank), (topo.rank, writer_rank)
    progress_key = f"dynpipe/progress/{topo.run_id}" if topo.run_id else None
    log = None
    if writer:
        log_path = cfg.log or default_log_path(cfg)
        lost = (
            _steps_lost(progress_key, log_path, start, topo=topo) if topo.restart_attempt else None
        )
        sinks = ()
        if cfg.tensorboard:
            from dynpipe.analysis.tensorboard import TensorBoardSink

            sinks = (TensorBoardSink(cfg.tensorboard),)
        log = RunLog(
            log_path, append=bool(cfg.resume or topo.restart_attempt or start), sinks=sinks
        )
        log.header(
            config=cfg.to_dict(),
            plan=plan.to_dict(),
            world_size=topo.world_size,
            backend=topo.backend,
            env=environment(topo.device),
            revision=code_revision(),
            start_step=start,
        )
        if plan.schedule == "2bw":
            # Said in the log itself: the run is not the synchronous one (runtime.twobw).
            log.event(
                "weight_versions",
                step=start,
                changes_training=True,
                versions=2,
                rule="W(t+1) = W(t) - opt(grad f(W(t-1)))",
                flush=True,
            )
        for path, why in skipped:
            log.event("checkpoint_skipped", path=path, reason=why)
        planned = meta is not None and "restart_plan" in meta and not (lost and lost["steps_lost"])
        if planned:
            log.event(
                "resumed",
                step=start,
                pause_ms=round((time.time() - meta["decided_time"]) * 1e3, 3),
            )
        elif lost is not None:
            log.event("recovered", attempt=topo.restart_attempt, step=start, **lost)
    if cfg.recompute is not None or topo.is_cuda:
        # Every rank's recomputed layers and predicted peak, for the log (a collective).
        stages = _memory_plan(engine, topo=topo)
        if log is not None:
            log.event("memory_plan", stages=stages)
    mb = cfg.batch_size // plan.total_microbatches
    injected = policy is not None
    link_bw = None
    if not injected:
        link_bw = _link_bandwidth(cfg, model, topo=topo, microbatch_size=mb, log=log)

    def policy_for(p: Plan) -> Policy | None:
        """The configured policy for plans of ``p``'s shape: the replica policy for
        replicas, and with --reshape for one pipeline over every rank (a shape among the
        others to it); one pipeline's controller else."""
        replicas = p.dp > 1 or (cfg.adapt.reshape and p.num_stages == topo.world_size)
        base = None
        if cfg.recompute == "auto":
            # Splits are priced with the layers each would have to recompute to fit, by the
            # stages' own memory model (on a GPU, its measured activations).
            base = engine._mem_costs or CostModel.from_model(
                model, microbatch_size=mb, num_devices=1
            )
            meta = dict(base.meta)
            if link_bw is not None:
                meta["link_bandwidth"] = float(link_bw)
            base = dataclasses.replace(base, recompute="auto", meta=meta)
        return make_policy(
            cfg.adapt,
            model=model,
            microbatch_size=mb,
            num_ranks=p.num_stages if replicas else topo.world_size,
            predictor=cfg.predictor,
            dp=p.dp,
            replicas=replicas,
            link_bandwidth=link_bw,
            light_probes=topo.device.type == "cuda",
            base=base,
        )

    if not injected:
        policy = policy_for(plan)
    every = cfg.adapt.monitor_every if policy is not None else cfg.log_every
    steplog = _StepLog(
        topo=topo,
        plan=plan,
        log=log,
        batch_size=cfg.batch_size,
        clock_rank=writer_rank,
        mesh=mesh,
    )
    if cfg.recompute == "auto":
        steplog.free = functools.partial(_room, engine, topo)
    adapter = None
    if policy is not None:
        adapter = Adapter(
            policy=policy,
            mode=cfg.adapt.mode,
            engine=engine,
            topo=topo,
            log=log,
            restart=functools.partial(_restart, cfg=cfg, initial_plan=initial_plan, ckpt=ckpt),
            warm_bytes=warm_bytes(model, microbatch_size=mb, cuda=topo.is_cuda),
            # Release / reclaim requests live beside the run log; its writer reads them.
            requests=log.path.parent if log is not None else None,
            request_rank=writer_rank,
        )
        steplog.replicated = adapter.replicated
        if meta is not None and meta.get("adapt_state") is not None:
            adapter.load_state(meta["adapt_state"])
            if "restart_plan" in meta:
                # Each rank's clock saw its own relaunch: every policy learns the slowest's.
                pause_ms = slowest((time.time() - meta["decided_time"]) * 1e3, topo=topo)
                moved = sum(t.nbytes or 0 for t in diff(Plan.from_dict(meta["plan"]), plan))
                policy.applied(step=start, pause_ms=pause_ms, moved_bytes=moved)
    freezer = None
    if cfg.freeze:
        from dynpipe.runtime.freeze import Freezer, FreezeRule

        rule = FreezeRule(
            every=cfg.freeze_every,
            threshold=cfg.freeze_threshold,
            alpha=cfg.freeze_alpha,
            patience=cfg.freeze_patience,
            warmup=cfg.optim.warmup_steps,
        )
        freezer = Freezer(rule=rule, log=log)
        if meta is not None and meta.get("freeze_state") is not None:
            from dynpipe.runtime.freeze import FreezeHistory

            freezer.history = FreezeHistory.from_dict(meta["freeze_state"])
        engine.track_grads = True
        if log is not None:
            log.event(
                "freeze_rule",
                changes_training=True,
                every=rule.every,
                threshold=rule.threshold,
                alpha=rule.alpha,
                patience=rule.patience,
                warmup=rule.warmup,
                frozen=engine.frozen,
            )
    save = functools.partial(
        _save,
        ckpt,
        engine,
        cfg,
        topo=topo,
        initial_plan=initial_plan,
        adapter=adapter,
        freezer=freezer,
    )
    autodp = None
    if cfg.autodp and meshes is not None:
        autodp = _autodp(cfg, model, meshes=meshes, microbatch_size=mb, link_bw=link_bw, log=log)
    if cfg.adapt.reshape and meshes is not None and adapter is not None:
        # The policy's shape moves go through --autodp's reshape (copies, vote, rebuild).
        shaper = autodp or _autodp(
            cfg, model, meshes=meshes, microbatch_size=mb, link_bw=link_bw, log=log
        )

        def reshape_live(new: Plan, first: int, reason: str, decide_ms: float) -> tuple[float, int]:
            shaper.apply(engine, new, step=first, beat=beat, reason=reason, decide_ms=decide_ms)
            return shaper.last_pause_ms, shaper.last_bytes

        adapter.reshape = reshape_live
    evaluator = _evaluator(cfg, model, topo)
    runner = _scenario_runner(cfg, engine=engine, topo=topo, targets=initial_plan.ranks)
    sampler = _sampler(cfg, topo)
    bar = _progress(cfg, start) if writer and cfg.progress else None
    beat = Heartbeat(
        topo=topo,
        progress_key=progress_key if writer else None,
        on_store_lost=stop.store_lost if stop is not None else None,
        store_lost_after_s=topo.timeout_s,
    ).start()
    if adapter is not None:
        adapter.beat = beat
    losses: list[float] = []
    step_ms: list[float] = []
    step = start

    # Middle stages never read a batch: they do not load one either. Under plans of every
    # rank a rank's stage index is the same in every plan of the run (repartitions keep the
    # plan's rank order), so the ranks that load are fixed; a plan that leaves ranks idle
    # can make another rank first or last: it opens a stream at that step (and one that
    # stops loading closes its own). The stream starts at its step like the data itself.
    # Every replica's first and last stage load the whole step's batch and take their share.
    # Batches kept on the device (--device-batches) are made once per rank and kept: made
    # again when a move made the rank load, they held up the step after it (4 x H100,
    # 0.5 s on the two ranks a reshape to DP only made load).
    kept: CyclicBatches | None = None

    def open_stream(at: int) -> BatchStream | CyclicBatches:
        nonlocal kept
        if cfg.device_batches:
            if kept is None:
                kept = CyclicBatches(
                    data, batch_size=cfg.batch_size, count=cfg.device_batches, device=topo.device
                )
            return kept
        workers = cfg.data_workers if cfg.data_workers is not None else _auto_workers(topo)
        return BatchStream(
            data,
            batch_size=cfg.batch_size,
            start=at,
            stop=max(at, cfg.steps),
            workers=workers,
            device=topo.device,
            timeout_s=topo.timeout_s,
        )

    last: _Gathered | None = None  # the last window gathered

    def flush_steps(telemetry: dict[str, float] | None = None) -> _Gathered | None:
        """Gather and log the steps since the last flush under the plan they ran: at a
        window's end, and before a move between windows changes the plan (collective)."""
        steplog.plan, steplog.mesh = engine.plan, engine.mesh
        steplog.replicated = adapter.replicated if adapter is not None else engine.mesh.dp > 1
        return steplog.flush(telemetry)

    if adapter is not None and autodp is not None:

        def unreplicate(released: frozenset[int], at: int) -> bool:
            """A release request while replicated: one pipeline over the other ranks."""
            autodp.to_one_pipeline(engine, released=released, step=at, beat=beat)
            if not injected:
                adapter.policy = _shape_policy(policy_for, engine, adapter)
            return True

        adapter.unreplicate = unreplicate
    stream: BatchStream | CyclicBatches | None = None
    if engine.is_first or engine.is_last:
        stream = open_stream(start)
    elif cfg.device_batches and (cfg.adapt.elastic or cfg.adapt.reshape or cfg.autodp):
        open_stream(start)  # a move may make this rank load: its batches are made now
    # From here the model, the optimizer and the runtime exist: frozen for the collector.
    collector = StepCollector(cfg.gc_every)
    try:
        if runner is not None:
            runner.prepare()
            runner.resume_at(start)
        saved = start  # the step of the last checkpoint started (the resumed one at first)
        for step in range(start, cfg.steps):
            if stop is not None and stop.at_boundary(step, agree=True):
                if stop.consistent:
                    steplog.flush()  # every rank stops here: the steps so far reach the log
                _stop(stop, ckpt, save, log, step=step, saved=saved)
            if runner is not None:
                for rec in runner.apply(step):
                    if log is not None:
                        log.event(rec.pop("event"), **rec)
            loads = engine.is_first or engine.is_last
            if loads and stream is None:
                stream = open_stream(step)
            elif not loads and stream is not None:
                if stream is not kept:
                    stream.close()
                stream = None
            # Every layer is timed on the last step of each window (cfg.timing).
            sample = cfg.timing and ((step + 1) % every == 0 or step + 1 == cfg.steps)
            try:
                res = engine.step(
                    step,
                    stream.batch(step) if stream is not None else None,
                    sample_layers=sample,
                    # The policy reads the last window while the device runs this step.
                    while_device_runs=adapter.think if adapter is not None else None,
                )
            except NonFiniteLoss:
                raise
            except Exception as exc:
                raise _failure(
                    exc, engine=engine, topo=topo, step=step, beat=beat, cfg=cfg
                ) from exc
            losses.append(res.loss)
            step_ms.append(res.step_ms)
            if res.skipped and log is not None:
                log.event("loss_scale_skip", step=step, scale=engine.scaler.scale)
            steplog.add(res)
            if on_step is not None:
                on_step(engine, res)
            if adapter is not None:
                adapter.finish(step, before_move=flush_steps)
            if (step + 1) % every == 0 or step + 1 == cfg.steps:
                got = flush_steps(sampler.window() if sampler else None)
                last = got if got is not None else last
                # A window's move starts a step after it (``Adapter``): only with steps left.
                if adapter is not None and got is not None and step + 2 < cfg.steps:
                    adapter.window(
                        _window(
                            got,
                            engine.plan,
                            telemetry=sampler is not None,
                            world_size=topo.world_size,
                            replicated=adapter.replicated,
                        )
                    )
            if freezer is not None and (step + 1) % cfg.freeze_every == 0 and step + 1 < cfg.steps:
                freezer.check(
                    engine,
                    step=step,
                    losses=losses[-cfg.freeze_every :],
                    adapter=adapter,
                    autodp=autodp,
                )
                if autodp is not None and last is not None:
                    stats = autodp.check(
                        engine,
                        step=step,
                        layers=last.layers,
                        step_ms=float(statistics.median(r["step_ms"] for r in last.records)),
                        free_bytes=last.free_bytes,
                        released=adapter.released if adapter is not None else frozenset(),
                        beat=beat,
                    )
                    if stats is not None and adapter is not None and not injected:
                        adapter.policy = _shape_policy(policy_for, engine, adapter)
            if evaluator is not None and evaluator.due(step):
                evaluator.run(engine, step=step, topo=topo, log=log)
            if bar is not None:
                bar.update(1)
                split = "|".join(str(len(st)) for st in engine.plan.stages)
                bar.set_postfix(loss=f"{res.loss:.4f}", ms=f"{res.step_ms:.0f}", split=split)
            collector.step(step)
            beat.progress(step + 1)
            if cfg.save_every and (step + 1) % cfg.save_every == 0:
                save(step=step + 1, reason="periodic")
                saved = step + 1
            if ckpt is not None:
                _log_saves(log, ckpt.drain())
        if cfg.save_dir and ckpt is not None and saved != cfg.steps:
            # A run with a save folder ends on a checkpoint of its last step, whatever
            # --save-every says: 25 steps saving every 10 left steps 21-25 to train again,
            # and --save-dir alone saved nothing.
            save(step=cfg.steps, reason="final")
            saved = cfg.steps
        if stop is not None and stop.requested:
            _stop(stop, ckpt, save, log, step=cfg.steps, saved=saved)
        final = None
        if ckpt is not None:
            records = ckpt.wait()
            _log_saves(log, records)
            final = str(records[-1].path) if records else None
        if log is not None:
            log.event("end", step=cfg.steps, plan=engine.plan.to_dict())
        if writer:
            if bar is not None:
                bar.close()  # its last line first (closing twice is harmless)
            _say_done(start, cfg.steps, step_ms, losses, engine.plan, log, final)
    finally:
        collector.close()
        if stream is not None and stream is not kept:
            stream.close()
        if kept is not None:
            kept.close()
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


def _warm_groups(meshes: dict[int, Mesh], *, topo: Topology) -> None:
    """One tiny all-reduce over each of this rank's groups in every shape, then one tiny
    message each way between neighbours of every pipeline group (collective: every rank
    walks the shapes in the same order). A backend sets a group's communicator up on its
    first use (NCCL: tens to hundreds of milliseconds), and a pair's point-to-point channel
    on its first message; a policy that may reshape (--reshape) would otherwise pay both
    inside a reshape's first step. gpt's first step after its first reshape from one
    pipeline to 2 x 2 on 4 x H200 ran 558-1384 ms against 145 after it (two runs):
    2 x 2's pipelines are the only groups of that run whose first use is
    point-to-point."""
    from dynpipe.runtime.topology import wait_all

    t = torch.zeros(1, device=topo.device)
    for dp in sorted(meshes):
        mesh = meshes[dp]
        for group in (mesh.dp_group, mesh.pp_group):
            if group is not None:
                dist.all_reduce(t, group=group)
        if mesh.pp_group is None or mesh.pp < 2:
            continue
        # Activations go forward and gradients back: each neighbour, both ways.
        place = mesh.pp_rank
        peers = [mesh.global_rank(q) for q in (place - 1, place + 1) if 0 <= q < mesh.pp]
        out = torch.zeros(1, device=topo.device)
        inbox = {g: torch.empty(1, device=topo.device) for g in peers}
        ops = [dist.P2POp(dist.isend, out, g, group=mesh.pp_group) for g in peers]
        ops += [dist.P2POp(dist.irecv, buf, g, group=mesh.pp_group) for g, buf in inbox.items()]
        wait_all(
            dist.batch_isend_irecv(ops), timeout_s=topo.timeout_s, what=f"{dp} x {mesh.pp} warm-up"
        )


def _autodp(
    cfg: TrainConfig,
    model: LayeredModel,
    *,
    meshes: dict[int, Mesh],
    microbatch_size: int,
    link_bw: float | None,
    log: RunLog | None,
) -> AutoDP:
    """--autodp's check, pricing the model at the run's microbatch size and links."""
    from dynpipe.planner.costs import OPTIMIZER_STATE, CostModel

    kw: dict[str, Any] = {"bandwidth": link_bw} if link_bw else {}
    if cfg.optim.name in OPTIMIZER_STATE:
        kw["optimizer"] = cfg.optim.name
    base = CostModel.from_model(model, microbatch_size=microbatch_size, num_devices=1, **kw)
    return AutoDP(
        meshes=meshes,
        base=base,
        min_gain=cfg.adapt.min_gain,
        horizon_steps=cfg.adapt.horizon_steps,
        log=log,
    )


def _shape_policy(
    policy_for: Callable[[Plan], Policy | None], engine: PipelineEngine, adapter: Adapter
) -> Policy:
    """The configured policy for the engine's new shape (a reshape starts its history
    afresh: another shape's measurements say little about this one), told which ranks are
    handed back."""
    policy = policy_for(engine.plan)
    if policy is not None and hasattr(policy, "excluded"):
        policy.excluded = adapter.released
    return policy if policy is not None else adapter.policy


def _evaluator(cfg: TrainConfig, model: LayeredModel, topo: Topology):
    if not cfg.eval_every:
        return None
    from dynpipe.data import get_data
    from dynpipe.runtime.evaluation import Evaluator, eval_batch_count

    held_out = get_data(cfg.data, model=model, path=cfg.data_path, seed=cfg.seed, split="test")
    count = eval_batch_count(held_out, batch_size=cfg.batch_size, batches=cfg.eval_batches)
    workers = cfg.data_workers if cfg.data_workers is not None else _auto_workers(topo)
    return Evaluator(
        source=held_out,
        every=cfg.eval_every,
        steps=cfg.steps,
        batch_size=cfg.batch_size,
        batches=count,
        workers=workers,
    )


def _scenario_runner(
    cfg: TrainConfig, *, engine: PipelineEngine, topo: Topology, targets: list[int]
):
    if not cfg.scenario:
        return None
    from dynpipe.runtime.scenario import ScenarioRunner, load_scenario

    device = f"cuda:{topo.device.index}" if topo.is_cuda else "cpu"
    scenario = load_scenario(
        cfg.scenario, num_stages=engine.plan.num_stages, dp=engine.mesh.dp, device=device
    )
    return ScenarioRunner(
        scenario,
        rank=topo.rank,
        target_ranks=targets,
        device=device,
        timer=engine.timer,
        dp=engine.mesh.dp,
    )


def _sampler(cfg: TrainConfig, topo: Topology):
    if not cfg.telemetry:
        return None
    from dynpipe.devices.telemetry import TelemetrySampler

    device = f"cuda:{topo.device.index}" if topo.is_cuda else "cpu"
    return TelemetrySampler(device).start()


def _failure(
    exc: Exception,
    *,
    engine: PipelineEngine,
    topo: Topology,
    step: int,
    beat: Heartbeat,
    cfg: TrainConfig,
) -> StageFailure:
    oom = find_oom(exc)
    if oom is not None:
        # Not a peer's fault: say what to lower, and tell the peers before they fail too.
        names = {f.name for f in dataclasses.fields(cfg)}
        failure = out_of_memory(
            oom,
            rank=topo.rank,
            stage=engine.stage_index,
            num_stages=engine.plan.num_stages,
            step=step,
            batch_size=cfg.batch_size,
            microbatches=engine.plan.total_microbatches,
            schedule=engine.plan.schedule,
            device=topo.device,
            lower=("--recompute",) if "recompute" in names else (),
        )
        beat.failed(str(failure))
        return failure
    dead = beat.dead_peers()
    told = beat.peer_failures()
    pp = engine.mesh.pp
    who = (
        ", ".join(
            f"rank {r} (stage {engine.plan.stage_of_rank(r % pp)}"
            + (f" of replica {r // pp}" if engine.mesh.dp > 1 else "")
            + f") silent for {age:.1f}s"
            for r, age in dead
        )
        or "no peer looks dead"
    )
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if told:
        r = min(told)
        first_line = f"rank {r} failed first: {told[r].split(' (')[0]}"
    return StageFailure(
        f"rank {topo.rank} (stage {engine.stage_index}) failed at step {step} during the "
        f"pipeline step of {engine.plan!r}: {who}; cause: {first_line[:300]}",
        quiet=bool(told),
    )


def _save(
    ckpt: Checkpointer | None,
    engine: PipelineEngine,
    cfg: TrainConfig,
    *,
    topo: Topology,
    step: int,
    reason: str,
    initial_plan: Plan,
    adapter: Adapter | None,
    extra: dict[str, Any] | None = None,
    block: bool = False,
    freezer: Any = None,
) -> Path:
    """Checkpoint this rank's state after ``step`` steps (collective), with what a resume
    needs to continue as this run would have: the plan, the initial plan (scenario targets)
    and the adaptation state."""
    if ckpt is None:
        raise UserError("--save-every needs --save-dir DIR to write checkpoints into")
    meta = {
        **(extra or {}),
        "step": step,
        "reason": reason,
        "plan": engine.plan.to_dict(),
        "initial_plan": initial_plan.to_dict(),
        "adapt_state": adapter.state() if adapter is not None else None,
        "config": cfg.to_dict(),
        "model": engine.model.name,
        "model_fingerprint": engine.model.fingerprint(),
        # What ``dynpipe export`` rebuilds a cut model (hf:, tv:) from; plain JSON.
        **cut_model_meta(engine.model),
        "data_position": step,
        "world_size": topo.world_size,
        "frozen": engine.frozen,  # --freeze: layers [0, frozen) train no more
        # --fp16: the pipeline's one loss scale (equal on every rank).
        "loss_scale": None if engine.scaler is None else engine.scaler.state_dict(),
        # ... and the freeze rule's memory of the last windows, which the next check uses.
        "freeze_state": None if freezer is None else freezer.history.to_dict(),
    }
    # Replicas hold identical copies: replica 0's are written (keys are layer names, so
    # the checkpoint loads under any dp x pp shape, or into one process).
    mine = engine.mesh.replica == 0
    return ckpt.save(
        step=step,
        model_state=engine.model_state() if mine else {},
        optim_state=engine.optim_state() if mine else {},
        meta=meta,
        block=block,
        # Only the optimizer step changes these: their copies may finish during the next step.
        # Under 2bw the stash is overwritten just before the optimizer step (``twobw``).
        params=set(engine.named_params) if engine.versions is None else None,
    )


def _say_done(
    start: int,
    steps: int,
    step_ms: list[float],
    losses: list[float],
    plan: Plan,
    log: RunLog | None,
    checkpoint: str | None,
) -> None:
    """One line on the writing rank once the run is done: what ran, how fast, where the
    records are (nothing else says so with --no-progress)."""
    if not step_ms:
        print(f"dynpipe train: nothing to train: the run starts at step {start} of {steps}")
        return
    parts = [
        f"steps {start}-{steps}",
        f"median step {statistics.median(step_ms):.1f} ms",
        f"last loss {losses[-1]:.4f}",
        f"split {split_label(plan.bounds)}" + (f" x {plan.dp} replicas" if plan.dp > 1 else ""),
    ]
    if log is not None:
        parts.append(f"log {log.path}")
    if checkpoint is not None:
        parts.append(f"checkpoint {checkpoint}")
    print("dynpipe train: done: " + ", ".join(parts), flush=True)


def _log_saves(log: RunLog | None, records: list[SaveRecord]) -> None:
    for r in records:
        if log is not None:
            log.event(
                "checkpoint",
                step=r.step,
                path=str(r.path),
                save_id=r.save_id,
                bytes=r.bytes,
                stall_ms=round(r.stall_ms, 3),
                wait_ms=round(r.wait_ms, 3),
                write_ms=round(r.write_ms, 3),
                marker_sha256=r.marker_sha256,
            )


def _stop(
    stop: StopRequest,
    ckpt: Checkpointer | None,
    save: Callable[..., Path],
    log: RunLog | None,
    *,
    step: int,
    saved: int,
) -> NoReturn:
    """Stop for a signal before ``step``: final checkpoint (unless one of this step is
    already under way), then ``Stopped`` on every rank."""
    path = None
    if ckpt is not None and stop.consistent:
        if saved != step:
            save(step=step, reason=f"stop:{stop.name}", block=True)
        records = ckpt.wait()
        _log_saves(log, records)
        path = str(records[-1].path) if records else None
    if log is not None:
        log.event("stopped", step=step, signal=stop.name, checkpoint=path)
    raise Stopped(stop.signum or 15)


def _steps_lost(
    progress_key: str | None, log_path: str, start: int, *, topo: Topology
) -> dict[str, Any]:
    """How far the run had got before this relaunch, and so how many steps it redoes: from
    the progress the previous attempt published in the launcher's store, else its run log."""
    got = read_progress(progress_key, topo=topo) if progress_key else None
    if got is not None:
        done, when = got
        return {
            "steps_lost": max(0, done - start),
            "reached_step": done,
            "lost_from": "store",
            "down_s": round(time.time() - when, 3),
        }
    done = start
    if Path(log_path).is_file():
        steps = [r.step for r in read_log(log_path).steps]
        done = max(steps, default=start - 1) + 1
    return {"steps_lost": max(0, done - start), "reached_step": done, "lost_from": "log"}


def _resume(engine: PipelineEngine, path: str | Path, *, topo: Topology) -> int:
    meta = read_marker(path).meta
    if meta.get("model_fingerprint") not in (None, engine.model.fingerprint()):
        raise UserError(
            f"checkpoint {path} is for a different layer list of {meta.get('model')} "
            "(fingerprint mismatch); resume with the model config it was written with"
        )
    from dynpipe.runtime.optim import check_resumed_optim

    # The launcher said which settings changed; a torchrun worker checks the kind again.
    check_resumed_optim(
        (meta.get("config") or {}).get("optim"), engine.config.optim, where=f"checkpoint {path}"
    )
    opt, meta = load_checkpoint(
        path,
        model_state=engine.model_state(),
        held_params=set(engine.named_params),
        rank=topo.rank,
        device=topo.device,
    )
    engine.load_optim_state(opt)  # under 2bw, with the newest weight version
    if engine.scaler is not None and meta.get("loss_scale"):
        engine.scaler.load_state_dict(meta["loss_scale"])
    return int(meta["step"])


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
