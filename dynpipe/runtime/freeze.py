"""``--freeze``: freeze converged leading layers (PipeTransformer's idea), and shrink the
pipeline onto fewer ranks when the frozen prefix leaves a stage nothing to train.

**This changes what training computes**: frozen layers stop learning. It is opt-in, every
freeze is logged (``freeze`` events, ``changes_training: true``), and the README says so.

The rule (``frozen_prefix``), checked every ``freeze_every`` steps on numbers every rank
shares: each layer's gradient norm, the root mean square over the window's steps (before
clipping), is compared with the previous window's. Walking from the first layer not yet
frozen, a layer whose norm changed by less than ``freeze_threshold`` (relative) has
converged and joins the frozen prefix; the walk stops at the first layer that has not, so
only a prefix is ever frozen (a layer is frozen only if every layer before it is). As in
PipeTransformer's AutoFreeze, one check freezes at most ``freeze_alpha`` of the layers
still training (at least one), and the last layer always trains.

A frozen layer holds no optimizer state and computes no backward: its parameters stop
requiring gradients, and the frozen prefix is kept inside the first stage (whose input is
data, which needs no gradient), so autograd never enters it. When the prefix grows past the
first stage's layers, the first stage's range is extended before freezing (the same live,
checksummed migration as any repartition); a stage left with nothing moves to the next
rank or becomes idle, so the pipeline shrinks onto fewer ranks (an elastic plan). Later
moves that would take the prefix out of the first stage are not made.

Replicated (``--autodp`` reshaped the run, or launched it with ``--dp``): a rank cannot go
idle, so every stage keeps a layer (``keep_prefix_in_stages``); a freeze that would leave
one none is capped to the longest prefix that leaves each a layer, and the log says so
(``freeze_capped``) - until a reshape to fewer stages makes room. The gradient norms are
replica 0's (every replica holds the same averaged gradients).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from dynpipe.errors import UserError
from dynpipe.planner.plan import Plan
from dynpipe.runtime.engine import PipelineEngine
from dynpipe.runtime.runlog import RunLog
from dynpipe.runtime.topology import slowest

__all__ = [
    "FreezeRule",
    "Freezer",
    "frozen_prefix",
    "keep_prefix_in_stages",
    "keep_prefix_on_first",
]


@dataclass(frozen=True)
class FreezeRule:
    """every: steps per window; threshold: relative change of a layer's gradient norm
    between windows under which it has converged; alpha: the largest fraction of the
    layers still training one check may freeze."""

    every: int = 20
    threshold: float = 0.05
    alpha: float = 0.5

    def __post_init__(self) -> None:
        if self.every < 1 or self.threshold <= 0 or not 0 < self.alpha <= 1:
            raise UserError(
                f"--freeze-every must be >= 1, --freeze-threshold > 0 and --freeze-alpha in "
                f"(0, 1]; got {self.every}, {self.threshold} and {self.alpha}"
            )


def frozen_prefix(
    now: np.ndarray, *, prev: np.ndarray | None, frozen: int, rule: FreezeRule
) -> int:
    """The frozen prefix's new length after a window whose per-layer gradient norms are
    ``now`` (``prev``: the window before; None: nothing to compare yet)."""
    n = len(now)
    if prev is None:
        return frozen
    most = min(n - 1, frozen + max(1, math.floor(rule.alpha * (n - frozen))))
    k = frozen
    while k < most:
        a, b = float(prev[k]), float(now[k])
        if not (np.isfinite(a) and np.isfinite(b)):
            break
        # A layer with no gradient at all (no parameters) has nothing left to learn.
        if not (a == 0 and b == 0) and (a <= 0 or abs(b - a) / a >= rule.threshold):
            break
        k += 1
    return k


def keep_prefix_on_first(
    wide: tuple[tuple[int, int], ...], *, frozen: int
) -> tuple[tuple[int, int], ...]:
    """``wide`` (one range per rank, empty: idle) with the first active rank holding at least
    layers ``[0, frozen + 1)``: the frozen prefix and one layer that trains. Later ranks give
    up what that takes from them; one left with nothing is idle."""
    out, at, first = [], 0, True
    for a, b in wide:
        if b <= a:
            out.append((at, at))
            continue
        stop = max(b, frozen + 1) if first else max(b, at)
        first = False
        out.append((at, stop))
        at = stop
    return tuple(out)


def keep_prefix_in_stages(
    bounds: tuple[tuple[int, int], ...], *, frozen: int
) -> tuple[tuple[int, int], ...] | None:
    """``bounds`` (one range per stage, all held: a replicated plan) with the first stage
    holding at least ``[0, frozen + 1)`` and every later stage still at least one layer,
    boundaries moved no further than that takes; None if the stages cannot all keep one."""
    n, stages = bounds[-1][1], len(bounds)
    if frozen + stages > n:
        return None
    out, at = [], 0
    for s, (_, b) in enumerate(bounds):
        lo = frozen + 1 if s == 0 else at + 1
        stop = min(max(b, lo), n - (stages - 1 - s))
        out.append((at, stop))
        at = stop
    return tuple(out)


class Freezer:
    """Runs the rule on every rank at window ends and applies it (collective)."""

    def __init__(self, *, rule: FreezeRule, log: RunLog | None) -> None:
        self.rule, self.log = rule, log
        self.prev: np.ndarray | None = None

    def check(self, engine: PipelineEngine, *, step: int, adapter=None, autodp=None) -> int | None:
        """After ``step`` (a window's last): the window's gradient norms from every rank,
        the rule, and, if the prefix grows, the move and the freeze. Returns the new frozen
        length, or None when nothing changed. ``autodp``: told each move's pause."""
        sq, steps = engine.take_grad_sq()
        if engine.mesh.replica != 0:
            # Every replica holds the same averaged gradients: replica 0's are counted once.
            sq = torch.zeros_like(sq)
        sq = sq.to(engine.topo.device)
        if engine.topo.world_size > 1:
            dist.all_reduce(sq)  # each layer's sum lives on the one rank that holds it
        sq = sq.cpu()
        now = np.sqrt(sq.numpy() / max(steps, 1))
        prev, self.prev = self.prev, now
        k = frozen_prefix(now, prev=prev, frozen=engine.frozen, rule=self.rule)
        if engine.topo.world_size > 1:
            # Every rank read the same norms; the verdict is still taken from one rank, so
            # ranks can never freeze different layers.
            t = torch.tensor([k], dtype=torch.int64, device=engine.topo.device)
            dist.broadcast(t, src=0)
            k = int(t.item())
        if k <= engine.frozen:
            return None
        world = engine.topo.world_size
        plan = engine.plan
        wanted = k
        if plan.dp > 1:
            # No rank may go idle: every stage keeps a layer, the prefix is capped to that.
            k = min(k, plan.num_layers - plan.num_stages)
            if k <= engine.frozen:
                if self.log is not None:
                    self.log.event(
                        "freeze_capped",
                        step=step + 1,
                        wanted=wanted,
                        frozen=engine.frozen,
                        shape=[plan.dp, plan.num_stages],
                        reason=f"{plan.dp} replicas of {plan.num_stages} stages: each stage "
                        "keeps a layer that trains",
                    )
                return None
            now_b = tuple(plan.bounds)
            want_b = keep_prefix_in_stages(now_b, frozen=k)
            assert want_b is not None
        else:
            now_b = plan.wide_bounds(world)
            want_b = keep_prefix_on_first(now_b, frozen=k)
        moved = None
        if want_b != now_b:
            from dynpipe.runtime.migrate import repartition

            meta = {**plan.meta, "method": "freeze", "decided_at": step + 1}
            kw = {"schedule": plan.schedule, "microbatches": plan.microbatches, "meta": meta}
            if plan.dp > 1:
                new_plan = dataclasses.replace(
                    Plan.from_bounds(engine.model, list(want_b), ranks=plan.ranks, **kw),
                    dp=plan.dp,
                    shares=plan.shares,
                    dropped=plan.dropped,
                )
            else:
                new_plan = Plan.from_wide_bounds(engine.model, want_b, **kw)
            stats = repartition(engine, new_plan)
            moved = [repr(t) for t in stats.transfers]
            # Each rank timed its own part: every rank's policy learns the slowest's.
            pause_ms = slowest((stats.transfer_s + stats.rebuild_s) * 1e3, topo=engine.topo)
            if adapter is not None:
                adapter.policy.applied(step=step + 1, pause_ms=pause_ms, moved_bytes=0)
            if autodp is not None:
                autodp.measured(pause_ms)
        old = engine.frozen
        engine.freeze(k)
        if self.log is not None:
            names = engine.model.layer_names
            extra = {"wanted": wanted} if wanted != k else {}
            self.log.event(
                "freeze",
                step=step + 1,
                frozen=k,
                layers=list(names[old:k]),
                changes_training=True,
                grad_norms=[round(float(x), 6) for x in now[: k + 1]],
                threshold=self.rule.threshold,
                plan=engine.plan.to_dict(),
                transfers=moved,
                idle=engine.plan.idle_ranks(world) if plan.dp == 1 else [],
                **extra,
            )
        return k
