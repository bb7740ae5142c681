"""``--autodp``: GPUs that freezing frees host more pipeline replicas (PipeTransformer's AutoDP).

``--freeze`` shrinks the work: a frozen layer runs its forward only and the frozen prefix
sits in the first stage, so a pipeline that needed every GPU may run as fast on fewer. With
``--autodp``, at every freeze check (after the freeze itself) the run asks whether another
data x pipeline shape of the same world, with more replicas and fewer stages, would now be
faster, and if so changes shape live, between two steps:

- **The model.** Per-layer costs are those the window just measured where each layer is
  held (per microbatch; a frozen layer's backward is zero), the stage overhead the stages
  measured beyond their layers, the analytic costs scaled to the measured ones for layers
  not timed. The frozen prefix and the first layer that trains are one unit (the first
  stage always holds them), and the planner's shape search (``planner.shape``) finds each
  candidate shape's best split and its step: one replica's simulated pipeline plus the
  gradient all-reduce's tail. Devices are taken to be alike.
- **The shapes.** ``dp' x pp'`` of the world with ``dp'`` above the current replicas, the
  step's microbatches (their count and size never change, so every shape computes the same
  microbatches) divisible by ``dp'``, at least ``pp'`` per replica under 1F1B, and ``pp'`` no
  more than the layers left after the frozen prefix.
- **The rule** is the controller's: the best shape's predicted step must gain at least
  ``min_gain`` over the current plan's (predicted by the same model) and pay the pause
  back within ``horizon_steps``. The pause is predicted as the copies' largest per-rank
  bytes over the link plus the last measured migration pause (one step before any).
- **The move** (``migrate.reshape``): every rank of the new shape gets each layer it lacks
  (parameters and buffers; optimizer state for the layers that train) point to point from a
  rank that holds it now (the least loaded holder: copies, not moves), checksummed, with
  the all-or-nothing vote, and rebuilds its stage at its place in the new shape's mesh,
  made at start-up with every other shape's. Gradients are then averaged over the
  replicas exactly as with ``--dp``: the update is single-process accumulation of the same
  microbatches, summed per replica and then across replicas.

Growing back (fewer replicas) is not done for speed here: frozen layers never thaw. (The
replica policy's ``--reshape`` changes shape for speed in both directions, through the same
``apply``.) A release
request while replicated takes the run back to one pipeline over the other ranks
(``to_one_pipeline``), through the same copies.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dynpipe.errors import UserError
from dynpipe.planner.costs import CostModel
from dynpipe.planner.diff import Transfer
from dynpipe.planner.plan import Plan, split_label
from dynpipe.planner.shape import evaluate_shape, reduce_tail_ms
from dynpipe.runtime.adapt.policy import predicted_step_ms

if TYPE_CHECKING:
    from dynpipe.runtime.engine import PipelineEngine
    from dynpipe.runtime.health import Heartbeat
    from dynpipe.runtime.mesh import Mesh
    from dynpipe.runtime.migrate import MigrationStats
    from dynpipe.runtime.runlog import RunLog

__all__ = [
    "AutoDP",
    "ShapeVerdict",
    "candidate_shapes",
    "check_autodp",
    "collapse_frozen",
    "copy_plan",
    "copy_sizes",
    "decide_shape",
    "held_ranges",
    "measured_costs",
]

Bounds = tuple[tuple[int, int], ...]


def candidate_shapes(
    world_size: int,
    *,
    dp: int,
    total_microbatches: int,
    schedule: str,
    units: int,
) -> list[tuple[int, int]]:
    """``(dp', pp')`` shapes of the world a run of ``dp`` replicas may reshape to: more
    replicas, the step's microbatches split evenly among them (at least ``pp'`` each under
    1F1B), and no more stages than ``units`` (the layers after the frozen prefix, the
    prefix and the first layer that trains counting as one)."""
    out = []
    for d in range(dp + 1, world_size + 1):
        p = world_size // d
        if world_size % d or total_microbatches % d or p > units:
            continue
        if schedule == "1f1b" and total_microbatches // d < p:
            continue
        out.append((d, p))
    return out


def check_autodp(
    *, world_size: int, dp: int, microbatches: int, schedule: str, num_layers: int
) -> None:
    """One-line errors for a run that could never change shape (before any process group):
    one rank, or no shape with more replicas that splits the step's microbatches."""
    if world_size < 2:
        raise UserError(
            f"--autodp hosts more pipeline replicas on ranks that freezing frees; a run of "
            f"{world_size} rank has none to free: launch with --nproc 2 or more, or drop --autodp"
        )
    pp = world_size // dp

    def grows(m: int) -> bool:
        """Microbatches ``m`` per replica run now and leave a shape to grow to."""
        if schedule == "1f1b" and m < pp:
            return False
        kw = {"schedule": schedule, "units": num_layers - 1}
        return bool(candidate_shapes(world_size, dp=dp, total_microbatches=dp * m, **kw))

    if grows(microbatches):
        return
    if dp == world_size:
        raise UserError(
            f"--autodp on {world_size} ranks as {dp} x 1: every rank is a replica already, no "
            f"shape has more; drop --autodp, or launch with a --dp below {world_size}"
        )
    near = sorted(
        range(1, 8 * max(microbatches, world_size) + 1), key=lambda m: (abs(m - microbatches), m)
    )
    fix = next((m for m in near if grows(m)), None)
    more = [
        f"{d} x {world_size // d}" for d in range(dp + 1, world_size + 1) if world_size % d == 0
    ]
    need = " (at least pp per replica under 1F1B)" if schedule == "1f1b" else ""
    total = dp * microbatches
    raise UserError(
        f"--autodp on {world_size} ranks as {dp} x {pp}: no shape with more replicas "
        f"({', '.join(more)}) splits the step's {total} microbatch{'es' * (total > 1)} "
        f"evenly{need}; "
        + (f"use --microbatches {fix}" if fix is not None else "launch on another --nproc")
    )


def measured_costs(
    base: CostModel,
    *,
    layers: dict[str, Any] | None,
    plan: Plan,
    frozen: int,
) -> CostModel:
    """``base`` (one device row) with the window's measured per-layer times where a layer
    was timed, the analytic ones scaled to the measured elsewhere, a frozen layer's
    backward zero, and the stages' measured overhead (their timer beyond their layers, the
    median over stages) on every stage."""
    n = base.num_layers
    f0, b0 = base.fwd_ms[0].copy(), base.bwd_ms[0].copy()
    fwd, bwd = np.full(n, np.nan), np.full(n, np.nan)
    of = ob = 0.0
    if layers is not None:
        fwd = np.array([np.nan if v is None else float(v) for v in layers["fwd_ms"]])
        bwd = np.array([np.nan if v is None else float(v) for v in layers["bwd_ms"]])
        over_f, over_b = [], []
        for s, (a, b) in enumerate(plan.bounds):
            sf = layers["stage_fwd_ms"][s] if s < len(layers["stage_fwd_ms"]) else None
            sb = layers["stage_bwd_ms"][s] if s < len(layers["stage_bwd_ms"]) else None
            if sf is not None and np.isfinite(fwd[a:b]).all():
                over_f.append(max(0.0, float(sf) - float(fwd[a:b].sum())))
            if sb is not None and np.isfinite(bwd[a:b]).all():
                over_b.append(max(0.0, float(sb) - float(bwd[a:b].sum())))
        of = float(np.median(over_f)) if over_f else 0.0
        ob = float(np.median(over_b)) if over_b else 0.0
    # A frozen layer's backward reads 0 (no gradient reaches it): no scale from it.
    trains = np.arange(n) >= frozen
    for got, prior, use in ((fwd, f0, np.ones(n, bool)), (bwd, b0, trains)):
        known = np.isfinite(got) & (prior > 0) & use
        scale = float(np.median(got[known] / prior[known])) if known.any() else 1.0
        missing = ~np.isfinite(got)
        got[missing] = prior[missing] * scale
    bwd[:frozen] = 0.0
    return dataclasses.replace(
        base,
        fwd_ms=np.maximum(fwd, 0.0)[None, :],
        bwd_ms=np.maximum(bwd, 0.0)[None, :],
        stage_fwd_ms=np.array([of]),
        stage_bwd_ms=np.array([ob]),
        meta={**base.meta, "source": "measured" if layers is not None else base.meta.get("source")},
    )


def collapse_frozen(costs: CostModel, *, frozen: int) -> CostModel:
    """``costs`` (one device row) with layers ``[0, frozen]`` as one unit: the frozen prefix
    and the first layer that trains, which the first stage always holds together. Its
    gradients are the trainable layer's; the frozen parameters count as state without
    gradients or optimizer state."""
    k = frozen
    if k == 0:
        return costs

    def head(a: np.ndarray, how: str) -> np.ndarray:
        first = a[..., : k + 1].sum(axis=-1, keepdims=True) if how == "sum" else a[..., k : k + 1]
        return np.concatenate([first, a[..., k + 1 :]], axis=-1)

    names = costs.layer_names
    frozen_params = float(costs.param_bytes[:k].sum())
    buffers = head(costs.buffer_bytes, "sum")
    buffers[0] += frozen_params
    return dataclasses.replace(
        costs,
        layer_names=(f"{names[0]}..{names[k]}", *names[k + 1 :]),
        fwd_ms=head(costs.fwd_ms, "sum"),
        bwd_ms=head(costs.bwd_ms, "sum"),
        param_bytes=head(costs.param_bytes, "last"),
        out_bytes=head(costs.out_bytes, "last"),
        act_bytes=head(costs.act_bytes, "last"),
        opt_mult=head(costs.opt_mult, "last"),
        buffer_bytes=buffers,
    )


def held_ranges(plan: Plan, *, world_size: int) -> tuple[tuple[int, int], ...]:
    """The layers every global rank holds under ``plan``, one ``(start, stop)`` per rank
    (empty: idle): a replicated plan's stage ranges repeated per replica, one pipeline's
    ``wide_bounds``."""
    if plan.dp == 1:
        return plan.wide_bounds(world_size)
    pp = world_size // plan.dp
    return tuple(plan.bounds[plan.stage_of_rank(g % pp)] for g in range(world_size))


def copy_plan(
    old: Sequence[tuple[int, int]],
    new: Sequence[tuple[int, int]],
    *,
    names: Sequence[str],
    sizes: Sequence[float] | None = None,
) -> list[Transfer]:
    """Every layer a rank lacks under ``new`` and the rank it copies it from under ``old``
    (both one range per global rank, ``held_ranges``). A layer comes from one of the ranks
    that hold it now, the one with the fewest bytes to send so far, so a new replica's
    layers come from every old replica at once. ``sizes``: bytes per layer."""
    holders: list[list[int]] = [[] for _ in names]
    for g, (a, b) in enumerate(old):
        for i in range(a, b):
            holders[i].append(g)
    load = dict.fromkeys(range(len(old)), 0.0)
    out = []
    for g, (a, b) in enumerate(new):
        for i in range(a, b):
            if g in holders[i]:
                continue
            nb = None if sizes is None else int(sizes[i])
            src = min(holders[i], key=lambda h: (load[h], h))
            load[src] += nb or 1
            out.append(Transfer(i, names[i], src, g, nb))
    return out


def copy_sizes(costs: CostModel, *, frozen: int) -> list[float]:
    """Bytes a copy of each layer carries: parameters and buffers, and optimizer state for
    the layers that train."""
    sizes = costs.state_bytes.copy()
    sizes[:frozen] = costs.param_bytes[:frozen] + costs.buffer_bytes[:frozen]
    return sizes.tolist()


@dataclass(frozen=True)
class ShapeVerdict:
    """One check's answer (plain data, logged as the ``autodp`` event).

    current / proposed: ``(dp, stages)``; current_ms / proposed_ms: the model's step under
    the current plan and the best candidate; pause_ms: the predicted pause of the reshape
    (``copy_bytes`` over the link plus the last measured pause); shapes: every candidate
    with its split and step; take: reshape now.
    """

    step: int
    frozen: int
    current: tuple[int, int]
    current_ms: float
    proposed: tuple[int, int] | None = None
    bounds: Bounds | None = None
    proposed_ms: float = math.inf
    pause_ms: float = 0.0
    copy_bytes: int = 0
    take: bool = False
    reason: str = ""
    shapes: tuple[dict[str, Any], ...] = field(default=(), repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["current"], d["proposed"] = list(self.current), self.proposed and list(self.proposed)
        d["bounds"] = None if self.bounds is None else [list(b) for b in self.bounds]
        for k in ("current_ms", "proposed_ms", "pause_ms"):
            d[k] = round(float(d[k]), 4) if math.isfinite(d[k]) else None
        d["shapes"] = list(self.shapes)
        return d


def decide_shape(
    costs: CostModel,
    *,
    plan: Plan,
    world_size: int,
    frozen: int,
    step: int,
    min_gain: float,
    horizon_steps: int,
    rebuild_ms: float,
    memory_bytes: float | None = None,
) -> ShapeVerdict:
    """Whether to reshape now, and to what (pure; see the module docstring).

    costs: one device row at the run's microbatch size (``measured_costs``), frozen
        backwards zero. rebuild_ms: the pause beyond the wire (the last measured one).
    """
    total = plan.total_microbatches
    k = frozen
    cur_shape = (plan.dp, plan.num_stages)
    if plan.stages[0].stop <= k:
        return ShapeVerdict(step, k, cur_shape, math.inf, reason="frozen prefix off stage 0")
    unit = collapse_frozen(costs, frozen=k)
    # The first stage holds [0, k] as one unit; every later boundary moves down by k.
    cur_bounds = tuple((max(0, a - k), b - k) for a, b in plan.bounds)
    per = plan.microbatches if plan.shares is None else max(plan.replica_microbatches)
    cm = unit.for_devices(plan.num_stages)
    current = predicted_step_ms(cm, cur_bounds, schedule=plan.schedule, microbatches=per)
    current += reduce_tail_ms(unit, bounds=cur_bounds, replicas=plan.dp)
    shapes = candidate_shapes(
        world_size,
        dp=plan.dp,
        total_microbatches=total,
        schedule=plan.schedule,
        units=unit.num_layers,
    )
    verdict = functools.partial(ShapeVerdict, step, k, cur_shape, current)
    if not shapes:
        return verdict(reason="no shape with more replicas fits the step's microbatches")
    seen = []
    best = None
    for d, p in shapes:
        ch = evaluate_shape(
            unit,
            dp=d,
            pp=p,
            schedule=plan.schedule,
            microbatches=total // d,
            memory_bytes=memory_bytes,
        )
        bounds = tuple((a + k if a else 0, b + k) for a, b in ch.bounds)
        seen.append(
            {
                "dp": d,
                "pp": p,
                "split": split_label(bounds),
                "step_ms": round(ch.step_ms, 4) if math.isfinite(ch.step_ms) else None,
                "reduce_ms": round(ch.reduce_ms, 4) if math.isfinite(ch.reduce_ms) else None,
                "fits": ch.fits,
            }
        )
        if ch.fits and (best is None or ch.step_ms < best[1]):
            best = ((d, p), ch.step_ms, bounds)
    seen_t = tuple(seen)
    if best is None:
        return verdict(reason="no shape with more replicas fits the memory", shapes=seen_t)
    (d, p), ms, bounds = best
    sizes = copy_sizes(costs, frozen=k)
    copies = copy_plan(
        held_ranges(plan, world_size=world_size),
        [bounds[g % p] for g in range(world_size)],
        names=costs.layer_names,
        sizes=sizes,
    )
    per_rank: dict[int, float] = {}
    for t in copies:
        per_rank[t.src] = per_rank.get(t.src, 0.0) + (t.nbytes or 0)
        per_rank[t.dst] = per_rank.get(t.dst, 0.0) + (t.nbytes or 0)
    bw = float(costs.meta.get("link_bandwidth", 25e9))
    wire_ms = max(per_rank.values(), default=0.0) / bw * 1e3
    pause = wire_ms + rebuild_ms
    nbytes = int(sum(t.nbytes or 0 for t in copies))
    verdict = functools.partial(
        verdict,
        proposed=(d, p),
        bounds=bounds,
        proposed_ms=ms,
        pause_ms=pause,
        copy_bytes=nbytes,
        shapes=seen_t,
    )
    gain = current - ms
    if gain < min_gain * current:
        return verdict(reason=f"gain {gain / current:.1%} below {min_gain:.1%}")
    if gain * horizon_steps <= pause:
        return verdict(
            reason=f"gain {gain:.2f} ms/step does not pay {pause:.1f} ms within "
            f"{horizon_steps} steps"
        )
    return verdict(
        take=True,
        reason=f"predicted {current:.2f} -> {ms:.2f} ms/step as {d} x {p}",
    )


class AutoDP:
    """The check at freeze checks and the reshape it decides, on every rank (collective).

    meshes: this rank's mesh in every shape of the world, made at start-up
        (``mesh.init_meshes``). base: the model's cost model (one device row) at the run's
        microbatch size, links at their measured bandwidth where known. min_gain /
        horizon_steps: the controller's rule (``AdaptConfig``).
    """

    def __init__(
        self,
        *,
        meshes: dict[int, Mesh],
        base: CostModel,
        min_gain: float,
        horizon_steps: int,
        log: RunLog | None,
    ) -> None:
        self.meshes, self.base, self.log = meshes, base, log
        self.min_gain, self.horizon_steps = min_gain, horizon_steps
        self.pause_ms: float | None = None  # the last measured migration pause
        self.verdicts: list[ShapeVerdict] = []
        # The last reshape's pause (the slowest rank's) and bytes copied (``apply``).
        self.last_pause_ms, self.last_bytes = 0.0, 0

    def measured(self, pause_ms: float) -> None:
        """A migration of this run (a freeze's, a reshape) paused this long."""
        p = float(pause_ms)
        self.pause_ms = p if self.pause_ms is None else 0.5 * (self.pause_ms + p)

    def check(
        self,
        engine: PipelineEngine,
        *,
        step: int,
        layers: dict[str, Any] | None,
        step_ms: float,
        free_bytes: Sequence[float] | None = None,
        released: frozenset[int] = frozenset(),
        beat: Heartbeat | None = None,
    ) -> MigrationStats | None:
        """After ``step`` (a freeze check's; the freeze is applied): reshape if it pays.
        ``layers``: the window's per-layer times (``_StepLog``'s); ``step_ms``: its median
        step. Returns the reshape's stats, or None."""
        if engine.frozen == 0:
            return None
        t0 = time.perf_counter()
        world = engine.topo.world_size
        if released:
            verdict = ShapeVerdict(
                step + 1,
                engine.frozen,
                (engine.plan.dp, engine.plan.num_stages),
                math.inf,
                reason=f"ranks {sorted(released)} are handed back: every shape needs them all",
            )
        else:
            costs = measured_costs(self.base, layers=layers, plan=engine.plan, frozen=engine.frozen)
            verdict = decide_shape(
                costs,
                plan=engine.plan,
                world_size=world,
                frozen=engine.frozen,
                step=step + 1,
                min_gain=self.min_gain,
                horizon_steps=self.horizon_steps,
                rebuild_ms=self._agreed_pause(engine, default=step_ms),
                memory_bytes=self._memory(engine, free_bytes),
            )
        taken = self._agree(verdict, engine)
        self.verdicts.append(verdict)
        if self.log is not None:
            self.log.event("autodp", **{**verdict.to_dict(), "take": taken is not None})
        if taken is None:
            return None
        d, bounds = taken
        cur = engine.plan
        plan = Plan.from_bounds(
            engine.model,
            list(bounds),
            schedule=cur.schedule,
            microbatches=cur.total_microbatches // d,
            meta={**cur.meta, "method": "autodp", "decided_at": step + 1},
        )
        decide_ms = (time.perf_counter() - t0) * 1e3
        return self.apply(
            engine,
            dataclasses.replace(plan, dp=d),
            step=step + 1,
            beat=beat,
            reason=verdict.reason,
            decide_ms=decide_ms,
            predicted={
                "current_ms": verdict.to_dict()["current_ms"],
                "proposed_ms": verdict.to_dict()["proposed_ms"],
                "predicted_pause_ms": round(verdict.pause_ms, 3),
            },
        )

    def to_one_pipeline(
        self,
        engine: PipelineEngine,
        *,
        released: frozenset[int],
        step: int,
        beat: Heartbeat | None = None,
    ) -> MigrationStats:
        """Back to one pipeline over the ranks not ``released`` (a release request while
        replicated): equal layer counts on them, the frozen prefix in the first stage; the
        released ranks hold nothing."""
        from dynpipe.runtime.freeze import keep_prefix_on_first

        world = engine.topo.world_size
        ranks = [r for r in range(world) if r not in released]
        n = engine.plan.num_layers
        q, extra = divmod(n, len(ranks))
        wide, at = [], 0
        for r in range(world):
            size = (q + (ranks.index(r) < extra)) if r in ranks else 0
            wide.append((at, at + size))
            at += size
        wide_t = keep_prefix_on_first(tuple(wide), frozen=engine.frozen)
        cur = engine.plan
        plan = Plan.from_wide_bounds(
            engine.model,
            wide_t,
            schedule=cur.schedule,
            microbatches=cur.total_microbatches,
            meta={**cur.meta, "method": "autodp:release", "decided_at": step},
        )
        return self.apply(
            engine,
            plan,
            step=step,
            beat=beat,
            reason=f"release of ranks {sorted(released)}: one pipeline over ranks {ranks}",
        )

    def apply(
        self,
        engine: PipelineEngine,
        plan: Plan,
        *,
        step: int,
        reason: str,
        beat: Heartbeat | None = None,
        decide_ms: float = 0.0,
        predicted: dict[str, Any] | None = None,
    ) -> MigrationStats:
        """Reshape to ``plan`` (collective), log it, and learn its pause."""
        import torch
        import torch.distributed as dist

        from dynpipe.runtime.migrate import reshape

        world = engine.topo.world_size
        old, old_pp = engine.plan, engine.mesh.pp
        copies = copy_plan(
            held_ranges(old, world_size=world),
            held_ranges(plan, world_size=world),
            names=engine.model.layer_names,
            sizes=copy_sizes(self.base, frozen=engine.frozen),
        )
        mesh = self.meshes[plan.dp]
        stats = reshape(engine, plan, mesh=mesh, copies=copies, beat=beat)
        pause_ms = decide_ms + (stats.transfer_s + stats.rebuild_s) * 1e3
        sent = torch.tensor([stats.bytes_sent], dtype=torch.int64, device=engine.topo.device)
        slowest = torch.tensor([pause_ms], dtype=torch.float64, device=engine.topo.device)
        if world > 1:
            dist.all_reduce(sent)  # every rank knows what it sent; the sum is what moved
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the job waits for the last rank
        pause_ms = float(slowest.item())
        self.measured(pause_ms)
        self.last_pause_ms, self.last_bytes = pause_ms, int(sent.item())
        if self.log is not None:
            self.log.event(
                "reshape",
                step=step,
                old_shape=[old.dp, old_pp],
                new_shape=[plan.dp, mesh.pp],
                old_stages=old.num_stages,
                new_stages=plan.num_stages,
                idle=plan.idle_ranks(world) if plan.dp == 1 else [],
                old_plan=old.to_dict(),
                new_plan=plan.to_dict(),
                frozen=engine.frozen,
                reason=reason,
                copies=[repr(t) for t in stats.transfers],
                bytes=int(sent.item()),
                decide_ms=round(decide_ms, 3),
                transfer_ms=round(stats.transfer_s * 1e3, 3),
                rebuild_ms=round(stats.rebuild_s * 1e3, 3),
                pause_ms=round(pause_ms, 3),
                # The writing rank's parts of its own pause, as a repartition logs them.
                **stats.parts_ms(),
                **(predicted or {}),
            )
        if engine.topo.rank == 0:
            import sys

            print(
                f"dynpipe: step {step}: reshaped {old.dp} x {old_pp} -> {plan.dp} x {mesh.pp} "
                f"({reason}); {int(sent.item())} bytes copied, paused {pause_ms:.1f} ms",
                file=sys.stderr,
                flush=True,
            )
        return stats

    def _agreed_pause(self, engine: PipelineEngine, *, default: float) -> float:
        """The last measured pause, the slowest rank's (each rank timed its own part of a
        freeze's migration), so every rank decides on the same number; ``default`` before
        any (collective)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([-1.0 if self.pause_ms is None else self.pause_ms], dtype=torch.float64)
        if engine.topo.world_size > 1:
            t = t.to(engine.topo.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        got = float(t.item())
        return default if got < 0 else got

    def _memory(self, engine: PipelineEngine, free: Sequence[float] | None) -> float | None:
        """The bytes one rank may hold in any shape: the least, over ranks, of what its
        device has free plus the state it holds now (None where unknown: CPU)."""
        if free is None or not np.isfinite(np.asarray(free, dtype=float)).any():
            return None
        held = held_ranges(engine.plan, world_size=engine.topo.world_size)
        static = self.base.static_bytes
        room = [
            f + float(static[a:b].sum())
            for f, (a, b) in zip(free, held, strict=True)
            if np.isfinite(f)
        ]
        return min(room) if room else None

    def _agree(self, verdict: ShapeVerdict, engine: PipelineEngine) -> tuple[int, Bounds] | None:
        """Rank 0's verdict, broadcast: ranks never reshape differently."""
        import torch
        import torch.distributed as dist

        world = engine.topo.world_size
        t = torch.zeros(world + 4, dtype=torch.int64)
        if verdict.take and verdict.bounds is not None and verdict.proposed is not None:
            cuts = [a for a, _ in verdict.bounds] + [verdict.bounds[-1][1]]
            t[0], t[1], t[2] = 1, verdict.proposed[0], len(verdict.bounds)
            t[3 : 3 + len(cuts)] = torch.tensor(cuts)
        if world > 1:
            t = t.to(engine.topo.device)
            dist.broadcast(t, src=0)
            t = t.cpu()
        if int(t[0]) == 0:
            return None
        d, s = int(t[1]), int(t[2])
        cuts = [int(x) for x in t[3 : 4 + s].tolist()]
        return d, tuple(itertools.pairwise(cuts))
