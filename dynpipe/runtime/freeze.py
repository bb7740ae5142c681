"""``--freeze``: freeze converged leading layers (PipeTransformer's idea), and shrink the
pipeline onto fewer ranks when the frozen prefix leaves a stage nothing to train.

**This changes what training computes**: frozen layers stop learning. It is opt-in, every
freeze is logged (``freeze`` events, ``changes_training: true``), and docs/elastic.md says so.

The rule (``loss_plateaued`` and ``frozen_prefix``), checked every ``freeze_every`` steps
on numbers every rank shares: each window's mean training loss (the global mean every
rank already has) and each layer's gradient norm (the root mean square over the window's
steps, before clipping). A check decides on the last ``patience + 1`` windows
(``FreezeHistory``, saved in checkpoints):

1. *The model has stopped learning*: the least-squares trend of the window losses, even at
   its upper bound (two standard errors), falls by less than ``threshold`` times the
   fastest fall seen over any such span. Nothing is frozen before that.
2. *Which layers*: walking from the first layer not yet frozen, a layer whose gradient
   norm's trend over the same windows is under ``threshold`` of its mean joins the frozen
   prefix; the walk stops at the first that is not, so only a prefix is ever frozen (a
   layer is frozen only if every layer before it is). As in PipeTransformer, one check
   freezes at most ``alpha`` of the layers still training (at least one), and the last
   layer always trains.

Windows that overlap the learning rate's warm-up are not counted.

Why each part. The rule before this one froze a layer when its gradient norm changed by
less than 5% since the last window. Trained from scratch under warm-up and cosine decay,
a layer's gradient norm stops changing long before the layer has learned what it will:
on the GPU (gpt 12 x 768, 800 steps) everything but the head was frozen by step 460 and
held-out accuracy ended at 54.3% against 74.2%; on the CPU (``bench/freeze_rule.py``,
gpt 6 x 128) every layer's norm moved by 0-14% from window to window from step 160 on,
up and down, while held-out accuracy rose from 39% to 51% by step 600; the norms even rise
slowly as the rate decays. A layer's gradient norm is not a convergence test here, and
normalising its change does not make it one: against the layer's first counted change
instead of the last window's norm, the same walk would have frozen the first layer at
step 280 and three at step 340 of that run, on window-to-window noise. So:

- The loss decides *whether*: freezing costs accuracy exactly while the model still
  learns, and the loss says so directly. Its rate is measured against the run's own
  fastest rate, so the threshold needs no knowledge of the loss's scale or the schedule;
  a fine-tuned or converged model plateaus and freezes, a model trained from scratch
  whose loss still falls at a tenth of its early rate does not.
- A fit over ``patience + 1`` windows, not a difference of the last two, and its upper
  bound, not its value: window-to-window noise (a few percent on the norms, about 1% on
  the loss, more in bf16 where launches differ in the fourth digit from step 1) decided
  the old rule (one GPU launch froze at step 100, the next at 300). The standard error
  makes a short or noisy span decide nothing rather than something.
- The gradient norms then decide *which* (PipeTransformer's and AutoFreeze's signal, kept
  for the order): a layer whose gradient still trends is still being reshaped; the prefix
  walk keeps what must hold for the pipeline (frozen layers in the first stage).
- The training loss, not a held-out one: every rank has it at no cost (a held-out pass
  at every check would cost forwards and need held-out data), and with a fresh batch
  every step it estimates the held-out loss. Over repeated data it can keep falling
  after the held-out loss stopped: then the rule freezes later, never earlier.
- Not in warm-up: a rising learning rate moves the loss and every norm with it.
- The alpha cap: a freeze is never undone, so the prefix grows in steps.

``patience = 1`` with a huge ``threshold`` freezes as fast as alpha allows from the
second counted window (what the exactness tests use).

Measured (``bench/freeze_rule.py``, CPU; docs/results/elastic.md has the table): a gpt trained from
scratch, or trained on, to the end of a cosine schedule froze nothing and lost nothing
(the old rule lost 7.6 and 2.6 points of held-out accuracy); on an mlp that converges it
skipped the backward of 43% of the layer-steps at one held-out sample's difference (the
old rule: 4.8 points).

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
from collections.abc import Sequence
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
    "FreezeHistory",
    "FreezeRule",
    "Freezer",
    "frozen_prefix",
    "keep_prefix_in_stages",
    "keep_prefix_on_first",
    "loss_plateaued",
]


@dataclass(frozen=True)
class FreezeRule:
    """every: steps per window; threshold: the relative rate per window under which the
    model's loss has stopped falling (against its fastest fall) and a layer's gradient norm
    is flat (against its mean); alpha: the largest fraction of the layers still training
    one check may freeze; patience: windows the trends are fitted over (a check decides on
    the last ``patience + 1`` windows); warmup: the learning rate's warm-up steps, which no
    window counted may overlap."""

    every: int = 20
    threshold: float = 0.05
    alpha: float = 0.5
    patience: int = 10
    warmup: int = 0

    def __post_init__(self) -> None:
        if (
            self.every < 1
            or self.threshold <= 0
            or not 0 < self.alpha <= 1
            or self.patience < 1
            or self.warmup < 0
        ):
            raise UserError(
                f"--freeze-every must be >= 1, --freeze-threshold > 0, --freeze-alpha in "
                f"(0, 1] and --freeze-patience >= 1; got {self.every}, {self.threshold}, "
                f"{self.alpha} and {self.patience}"
            )

    def counts(self, step: int) -> bool:
        """Whether the window that ends with ``step`` (0-based) counts: none of its steps is
        in the learning rate's warm-up, where the loss and the norms follow the ramp."""
        return step + 1 - self.every >= self.warmup


@dataclass
class FreezeHistory:
    """The rule's memory, plain data (saved in checkpoints): the last windows' mean training
    loss and per-layer gradient norms (oldest first, at most ``patience + 1``), and the
    fastest fall of the loss per window seen over any span so far."""

    losses: list[float] = dataclasses.field(default_factory=list)
    norms: list[list[float]] = dataclasses.field(default_factory=list)
    best_rate: float = 0.0

    def add(self, *, loss: float, norms: np.ndarray, rule: FreezeRule) -> None:
        """Count one window (its mean loss, its layers' RMS gradient norms)."""
        keep = rule.patience + 1
        self.losses = [*self.losses, float(loss)][-keep:]
        self.norms = [*self.norms, [float(x) for x in norms]][-keep:]
        if len(self.losses) == keep:
            rate = -_slope(np.asarray(self.losses))
            if np.isfinite(rate):
                self.best_rate = max(self.best_rate, rate)

    def to_dict(self) -> dict:
        return {"losses": self.losses, "norms": self.norms, "best_rate": self.best_rate}

    @classmethod
    def from_dict(cls, d: dict) -> FreezeHistory:
        return cls(
            losses=[float(x) for x in d["losses"]],
            norms=[[float(x) for x in row] for row in d["norms"]],
            best_rate=float(d["best_rate"]),
        )


def _slope(y: np.ndarray) -> float:
    """Least-squares slope of ``y`` per index (per window): over several windows it is far
    less noisy than the difference of the last two."""
    return _trend(y)[0]


def _trend(y: np.ndarray) -> tuple[float, float]:
    """Least-squares slope of ``y`` per index and its standard error (0 for two points,
    which a line fits exactly)."""
    x = np.arange(len(y), dtype=np.float64) - (len(y) - 1) / 2
    sxx = float((x * x).sum())
    slope = float((x * (y - y.mean())).sum() / sxx)
    if len(y) < 3:
        return slope, 0.0
    resid = y - y.mean() - slope * x
    return slope, math.sqrt(float((resid * resid).sum()) / (len(y) - 2) / sxx)


def loss_plateaued(history: FreezeHistory, *, rule: FreezeRule) -> bool:
    """Whether the model's loss, fitted over the last ``patience + 1`` windows, falls by
    less than ``threshold`` times the fastest it fell over any such span, even at the fit's
    upper bound (two standard errors): the loss's noise from window to window must not pass
    for a plateau. A loss that has never fallen (fastest 0) has stopped if it does not
    fall now either: the model is not learning."""
    if len(history.losses) < rule.patience + 1:
        return False
    slope, se = _trend(np.asarray(history.losses))
    rate = -slope + 2 * se
    return bool(np.isfinite(rate)) and rate <= rule.threshold * history.best_rate


def frozen_prefix(history: FreezeHistory, *, frozen: int, rule: FreezeRule) -> int:
    """The frozen prefix's new length after the window just added to ``history``."""
    n = len(history.norms[-1]) if history.norms else 0
    if not loss_plateaued(history, rule=rule):
        return frozen
    norms = np.asarray(history.norms, dtype=np.float64)  # windows x layers
    most = min(n - 1, frozen + max(1, math.floor(rule.alpha * (n - frozen))))
    k = frozen
    while k < most:
        g = norms[:, k]
        if not np.isfinite(g).all():
            break
        # A layer with no gradient at all (no parameters) has nothing left to learn.
        if not (g == 0).all():
            mean = float(g.mean())
            if mean <= 0 or abs(_slope(g)) >= rule.threshold * mean:
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
        self.history = FreezeHistory()

    def check(
        self,
        engine: PipelineEngine,
        *,
        step: int,
        losses: Sequence[float],
        adapter=None,
        autodp=None,
    ) -> int | None:
        """After ``step`` (a window's last): the window's gradient norms from every rank,
        the rule, and, if the prefix grows, the move and the freeze. ``losses``: the
        window's steps' losses (the global mean, the same on every rank). Returns the new
        frozen length, or None when nothing changed. ``autodp``: told each move's pause."""
        sq, steps = engine.take_grad_sq()
        if engine.mesh.replica != 0:
            # Every replica holds the same averaged gradients: replica 0's are counted once.
            sq = torch.zeros_like(sq)
        sq = sq.to(engine.topo.device)
        if engine.topo.world_size > 1:
            dist.all_reduce(sq)  # each layer's sum lives on the one rank that holds it
        sq = sq.cpu()
        now = np.sqrt(sq.numpy() / max(steps, 1))
        if not self.rule.counts(step) or not losses:
            return None
        self.history.add(loss=float(np.mean(losses)), norms=now, rule=self.rule)
        k = frozen_prefix(self.history, frozen=engine.frozen, rule=self.rule)
        if engine.topo.world_size > 1:
            # Every rank read the same norms; the verdict is still taken from one rank, so
            # ranks can never freeze different layers.
            t = torch.tensor([k], dtype=torch.int64, device=engine.topo.device)
            dist.broadcast(t, src=0)
            k = int(t.item())
        if engine.model.ties:
            from dynpipe.runtime.ties import freeze_limit

            # A tied parameter's copies train together: the prefix stops before the first.
            capped = freeze_limit(engine.model, k)
            if capped < k and capped <= engine.frozen and self.log is not None:
                self.log.event(
                    "freeze_capped",
                    step=step + 1,
                    wanted=k,
                    frozen=engine.frozen,
                    reason="the prefix would freeze one copy of a tied parameter",
                )
            k = capped
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
                losses=[round(x, 6) for x in self.history.losses],
                best_rate=round(self.history.best_rate, 6),
                plan=engine.plan.to_dict(),
                transfers=moved,
                idle=engine.plan.idle_ranks(world) if plan.dp == 1 else [],
                **extra,
            )
        return k
