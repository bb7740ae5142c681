"""Adaptation across pipeline replicas: batch share, every replica's layers, partial reduce.

With data parallelism a slowed device slows its own replica, and the gradient all-reduce at
the end of every step makes every replica wait for the slowest one. ``ReplicaPolicy`` sees
every replica's window (``Window.replicas``) and keeps, per replica, the per-layer costs on
that replica's own devices (one ``CostEstimates`` each, as the single-pipeline
``Controller`` keeps for its one pipeline). From them it predicts each replica's pipeline
step under any split and any number of microbatches (``predicted_step_ms``); the job's step
is the slowest replica's plus what each stage's gradient all-reduce
(``planner.shape.tail_parts``) and optimizer update (timed on every rank, priced per
device by the parameter bytes it would hold) add past its last backward.

It considers three kinds of move:

- **shift batch share**: microbatches go from the slow replica to the others
  (``best_shares``). Exact: every microbatch still counts once and gradients are divided by
  the step's microbatch count, so the update is the full batch's.
- **move layers of every replica together**: the best split of each replica's own cost
  model and of their element-wise worst, each with its best shares, applied by live
  migration in every replica at once.
- **change the data x pipeline shape** (opt in, ``AdaptConfig.reshape``): another
  ``dp' x pp'`` of the same ranks (one pipeline over all of them, ``1 x world``, and DP
  only, ``world x 1``, included), each with its best split and best batch shares,
  predicted from what every device measures now. A layer on a device costs what the device's current model says (measured where it
  holds the layer, its clean cost times the device's slowdown elsewhere), so a slowed
  device slows the replica or stage it would be in: with DP only its replica bounds the
  step unless shares shift, in ``dp' x pp'`` it is one stage of one replica. Applied
  between two steps by the live reshape (``migrate.reshape``: layers and optimizer state
  copied point to point); its predicted pause adds the copies' largest per-rank bytes over
  the link to the last measured pause. The step's microbatches (count and size) never
  change, so every shape computes the same update. One pipeline is a run of one replica
  for the policy: one replica's estimates, its step the pipeline's alone (no all-reduce
  tail); batch shares do not move there, layers do.
- **partial reduce** (opt in, ``AdaptConfig.partial_reduce``; SD-Pipe's): the slowest
  replica's share is left out of the update. That changes what training computes (the
  step trains on fewer samples), so it is compared by time per counted sample, not per
  step, and logged as partial. A left-out replica computes nothing, so its devices are not
  measured: after ``horizon_steps`` steps its share comes back for a few windows to
  re-measure them, and goes again only if they are still slow.

The rule is the ``Controller``'s: a move is taken when its predicted gain is at least
``min_gain`` (or what the model's last moves fell short of their promise by, if more) and
pays back the measured pause within ``horizon_steps``; a measured step time outranks the
model (a configuration measured clearly faster under the same conditions, in recent
windows, is moved back to; a model's move measured slower under the conditions it was
proposed under is undone on the window that measures it; one measured no better is not
tried again while they hold); and
the model is acted on only as far as it has tracked the measured steps: not before it has
predicted a window of the configuration in force, and not when its estimate moved and the
job's steps did not.

A decision is host work done while the device runs the next step (``loop.Adapter``), but
one that outlasts the device's queue delays the step, so every option is priced from work
done once: each split's pipeline step per microbatch count for all replicas together
(``_Steps``), splits by ``planner.listed.best_bounds`` (``plan_partition``'s split, every
split scored where they are few), one predictor call over every replica's devices and none
for replicas of one stage (whose layers are all measured). Replayed over six committed
4 x H200 dp x pp logs (``bench/replay_replicas.py``), a window's decision takes 4.2 ms
(median, on a CPU host) where pricing each option afresh took 16.3, with the same decisions.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from dynpipe.planner.costs import CostModel
from dynpipe.planner.evaluate import in_flight, stage_costs
from dynpipe.planner.listed import best_bounds
from dynpipe.planner.plan import split_label
from dynpipe.planner.shape import tail_parts
from dynpipe.planner.simulate import step_times
from dynpipe.runtime.adapt.config import AdaptConfig
from dynpipe.runtime.adapt.estimates import CostEstimates
from dynpipe.runtime.adapt.policy import (
    Decision,
    NoiseRules,
    layer_classes,
    moved_bytes,
    planner_costs,
    predicted_slowdowns,
    predicted_step_ms,
    scaled_rows,
)
from dynpipe.runtime.adapt.record import Bounds, PlanMemory
from dynpipe.runtime.adapt.window import Window
from dynpipe.runtime.autodp import candidate_shapes, copy_plan

__all__ = ["ReplicaConfig", "ReplicaPolicy", "best_shares", "shape_options"]

_MISSES = 16  # the model's misses remembered for its tracking error
_SHORTFALLS = 4  # the last model-proposed moves whose shortfall raises the gain needed
_SLOWER = 8  # the last moves measured slower, kept for ``_as_then``


@dataclass(frozen=True)
class ReplicaConfig:
    """What the policy chooses among: the split every replica runs, each replica's batch
    share (microbatches) and the replicas partial reduce leaves out. Its shape is
    ``len(shares)`` replicas of ``len(bounds)`` stages."""

    bounds: Bounds
    shares: tuple[int, ...]
    dropped: tuple[int, ...] = ()

    def __repr__(self) -> str:
        split = split_label(self.bounds)
        drop = f" drop {list(self.dropped)}" if self.dropped else ""
        return f"{split} shares {'/'.join(map(str, self.shares))}{drop}"

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.shares), len(self.bounds)

    @property
    def counted_fraction(self) -> float:
        """Share of the batch whose gradients make the update (1: exact)."""
        kept = sum(n for r, n in enumerate(self.shares) if r not in self.dropped)
        return kept / sum(self.shares)


class _Promise(NamedTuple):
    """A model-proposed move waiting for its verdict on the next trusted window."""

    regime: int  # the conditions it was proposed under
    ratio: float  # its predicted time per batch after over before
    before: float  # the measured time per batch before
    src: ReplicaConfig
    dst: ReplicaConfig
    before_noise: float  # ``Window.step_noise`` of the window that proposed it


def best_shares(
    step_ms: Callable[[int, int], float], *, total: int, low: Sequence[int]
) -> tuple[tuple[int, ...], float]:
    """Microbatches per replica minimising the slowest replica's step, ``max_r
    step_ms(r, m_r)``, with ``sum m_r = total`` and ``m_r >= low[r]``.

    Start every replica at its minimum and hand out the rest one microbatch at a time to
    the replica whose step would then be shortest: for step times that grow with the count
    (a pipeline's do) this greedy choice is optimal.
    """
    shares = [int(x) for x in low]
    if sum(shares) > total:
        raise ValueError(f"minimum shares {shares} exceed {total} microbatches")
    for _ in range(total - sum(shares)):
        r = min(range(len(shares)), key=lambda q: (step_ms(q, shares[q] + 1), q))
        shares[r] += 1
    return tuple(shares), max(step_ms(r, m) for r, m in enumerate(shares))


def shape_options(
    world_size: int, *, total: int, schedule: str, num_layers: int
) -> list[tuple[int, int]]:
    """The ``(dp, pp)`` shapes of ``world_size`` ranks a run of the replica policy may take:
    one pipeline over every rank (``1 x world_size``) and every shape of more replicas, the
    step's ``total`` microbatches split evenly into per-replica counts (a plan's
    ``microbatches``; shares may then shift), at least ``pp`` each under 1F1B, and no more
    stages than layers."""
    # ``--autodp``'s rule from zero replicas: every shape with at least one.
    return candidate_shapes(
        world_size, dp=0, total_microbatches=total, schedule=schedule, units=num_layers
    )


def _with_worst(models: Sequence[CostModel]) -> list[CostModel]:
    """``models`` (one per replica) and, with more than one, their element-wise worst: the
    splits to weigh are each replica's best and the best for the slowest of every layer.
    One replica's model is its own worst."""
    if len(models) < 2:
        return list(models)
    worst = dataclasses.replace(
        models[0],
        fwd_ms=np.max([m.fwd_ms for m in models], axis=0),
        bwd_ms=np.max([m.bwd_ms for m in models], axis=0),
        stage_fwd_ms=np.max([m.stage_fwd_ms for m in models], axis=0),
        stage_bwd_ms=np.max([m.stage_bwd_ms for m in models], axis=0),
    )
    return [*models, worst]


class _Steps:
    """Each replica's predicted pipeline step (``predicted_step_ms``) under ``costs`` (one
    model per replica), by split and microbatch count, computed once per split and count for
    every replica together: each replica's stage costs once per split, then one simulator
    call per count for all of them. The simulator prices every row on its own, so a
    replica's number is exactly the one a call of its own gives."""

    def __init__(self, costs: Sequence[CostModel], schedule: str) -> None:
        self.costs, self.schedule = list(costs), schedule
        self._stages: dict[Bounds, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._rows: dict[tuple[Bounds, int], np.ndarray] = {}

    def __call__(self, bounds: Bounds, r: int, m: int) -> float:
        row = self._rows.get((bounds, m))
        if row is None:
            f, b, c = self._per_stage(bounds)
            row = step_times(f, b, c, schedule=self.schedule, microbatches=m)
            self._rows[(bounds, m)] = row
        return float(row[r])

    def _per_stage(self, bounds: Bounds) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        got = self._stages.get(bounds)
        if got is None:
            # A stage's compute and transfers per microbatch do not depend on the count.
            sc = [stage_costs(cm, bounds, schedule=self.schedule) for cm in self.costs]
            got = (
                np.array([x.fwd_ms for x in sc]),
                np.array([x.bwd_ms for x in sc]),
                np.array([x.comm_ms for x in sc]).reshape(len(sc), len(bounds) - 1),
            )
            self._stages[bounds] = got
        return got


class ReplicaPolicy(NoiseRules):
    """The policy for ``dp`` replicas of an ``S``-stage pipeline (module docstring).

    base: the model's cost model (one device row): the prior per-layer costs, state and
        parameter bytes, the link the all-reduce crosses.
    predictor / prepared: as ``Controller``'s (``adaptive``): per-layer slowdowns predicted
        from each replica's device telemetry, calibrated on what its devices measure.

    ``dp`` may be 1 (``--reshape``: one pipeline over every rank is a shape among the others).
    """

    # It reads every replica's window (``Window.replicas``), one replica's included: the
    # training loop fills them for a run of one pipeline too (``loop.Adapter.replicated``).
    per_replica = True

    def __init__(
        self,
        *,
        base: CostModel,
        config: AdaptConfig,
        num_stages: int,
        dp: int,
        predictor: Any = None,
        prepared: Any = None,
    ) -> None:
        self.config, self.base = config, base
        self.num_stages, self.dp = num_stages, dp
        self.world = dp * num_stages
        self.predictor, self.prepared = predictor, prepared
        use = config.mode in ("adaptive", "restart") and predictor is not None
        self.mode_used = "adaptive" if use else "measured"
        self.est = [self._estimates(num_stages) for _ in range(dp)]
        # Measured time per batch of each configuration held, with its regime.
        self.memory: PlanMemory[ReplicaConfig] = PlanMemory(key=lambda c: c)
        self._stale = 0  # regime labels given to measurements of conditions before a reshape
        self._regimes: dict[tuple[int, ...], int] = {}  # ``regime``'s labels
        self._next_regime = 0
        self.pause_ms: float | None = None
        self.settle = config.settle_windows
        # (configuration, model's step, measured step) of the last trusted window, and the
        # model's recent misses (``tracking_error``), as the Controller keeps them.
        self._seen: tuple[ReplicaConfig, float, float] | None = None
        self._misses: list[float] = []
        # A model-proposed move waiting for its verdict, once applied (``_Promise``).
        self._promise: _Promise | None = None
        self._held_move = False  # the last move was the memory's under held conditions
        self._pending: _Promise | None = None
        # A model-proposed move measured slower under the conditions it was proposed under:
        # the configuration it left, and that configuration's time per batch then.
        self._undo: tuple[ReplicaConfig, float] | None = None
        # Model-proposed moves measured slower than the configuration they left:
        # (from, to, time per batch before, after, the before window's step noise).
        self._slower: list[tuple[ReplicaConfig, ReplicaConfig, float, float, float]] = []
        # Per regime, what the last model-proposed moves judged under it fell short by:
        # promises broken under other conditions say little of the model's view of these
        # (the ``Controller`` clears them on new conditions), but where the same conditions
        # come back, so does what the model's promises were measured to be worth under
        # them. Cleared instead, timers that named two regimes in turn let a 2 x 4 gpt run
        # in the replica simulator take the same 13% promise each time one came back, each
        # measured 1% slower (1.040x static over the run; kept per regime, 1.032x).
        self._shortfalls: dict[int, list[float]] = {}
        self._left_out = 0  # steps a replica's share has been left out (partial reduce)
        self._hold = 0  # windows to wait after bringing a left-out replica back
        # The last move until its first window is in: (first step, pause, pause_ms before).
        self._moved: tuple[int, float, float | None] | None = None
        # What depends on ``base`` alone: its rows for ``p`` devices, each stage's all-reduce
        # and lead for a split over ``d`` replicas, the parameter bytes up to each layer.
        self._bases: dict[int, CostModel] = {}
        self._tails: dict[tuple[Bounds, int], tuple[np.ndarray, ...]] = {}
        self._params = np.concatenate([[0.0], np.cumsum(base.param_bytes, dtype=float)])
        # Per global rank, its optimizer update's measured ms per parameter byte (NaN until
        # it has been timed holding parameters).
        self._rate = np.full(self.world, np.nan)

    def _estimates(self, num_stages: int) -> CostEstimates:
        return CostEstimates(
            prior_fwd=self.base.fwd_ms[0],
            prior_bwd=self.base.bwd_ms[0],
            classes=layer_classes(self.base),
            num_ranks=num_stages,
            window=self.config.average_windows,
            jump=self.config.jump,
        )

    def describe(self) -> str:
        shapes = (
            f"; may change the data x pipeline shape of its {self.world} ranks (one "
            "pipeline and DP only included) live"
            if self.config.reshape
            else ""
        )
        partial = (
            "; partial reduce ON: a straggling replica's share may be left out of the update "
            "(changes the training math)"
            if self.config.partial_reduce
            else ""
        )
        return (
            f"{self.config.mode} across {self.dp} replicas: per-layer costs measured on every "
            "replica's devices; shifts batch share between replicas (exact) or moves the "
            f"layers of every replica together; moves when the gain is >= "
            f"{self.config.min_gain:.0%} and pays back the pause within "
            f"{self.config.horizon_steps} steps{shapes}{partial}"
        )

    # ---- one window ----------------------------------------------------------------------
    @property
    def regime(self) -> int:
        """The conditions of every replica's devices, as one label: each combination of the
        replicas' own regimes has its own, and keeps it when it comes back (a replica's
        regime returns to an earlier one when its devices read as they ran then). Their sum
        is not one: in the replica simulator a 4 x 1 run's clean windows summed to 4, and
        so did its windows under an interferer 150 steps on, whose configurations were then
        compared with the clean ones."""
        key = tuple(e.regime for e in self.est)
        if key not in self._regimes:
            self._regimes[key] = self._next_regime
            self._next_regime += 1
        return self._regimes[key]

    def observe(self, window: Window) -> Decision | None:
        shape = (window.dp, window.num_stages)
        if (
            self.config.reshape
            and window.replicas is not None
            and shape != (self.dp, self.num_stages)
            and shape[0] * shape[1] == self.world
        ):
            # A reshape this policy asked for took effect.
            self._reshaped(*shape, held=self._held_move)
        if window.replicas is None or len(window.replicas) != self.dp:
            raise ValueError(
                f"the replica policy needs a window of {self.dp} replicas, got {window!r}"
            )
        self._move_cost(window)
        if self.settle > 0:
            self.settle -= 1
            return None
        cur = self._config_of(window)
        here = window.median_step_ms / cur.counted_fraction
        for est, sub in zip(self.est, window.replicas, strict=True):
            if sub.microbatches > 0:  # a left-out replica measured nothing
                est.update(sub)
        self._measure_updates(window)
        # A window whose change of conditions is not yet confirmed is kept under no regime
        # (the ``Controller``'s rule): an onset's first window measured the configuration
        # under neither the old conditions nor, for sure, the new ones. Filed under the old,
        # it raises their level and their spread: replayed, a 4 x 1 gpt run on 4 x H200
        # filed that way kept its uneven shares a window past the interferer's end, the
        # even shares' clean 95 ms read as 117 within a 4.6% spread.
        self.memory.add(cur, -1 if any(e.changing for e in self.est) else self.regime, here)
        self._judge(here, window.step_noise)
        return self._decide(window, cur, here)

    def _config_of(self, window: Window) -> ReplicaConfig:
        return ReplicaConfig(
            bounds=window.bounds,
            shares=tuple(window.shares or (window.microbatches,) * self.dp),
            dropped=tuple(window.dropped),
        )

    def _reshaped(self, dp: int, num_stages: int, *, held: bool = False) -> None:
        """The run now has ``dp`` replicas of ``num_stages`` stages (a reshape this policy
        asked for): per-replica estimates for the new places, starting from the clean
        per-layer costs measured so far (a device slowed now then shows as slowed, not as
        its clean speed). What was measured under the conditions in force carries over (the
        reshape changed the shape, not the devices), unless they were changing: a device's
        change not yet confirmed when the reshape was decided (an onset acted on in its
        first window) makes every earlier measurement one of other conditions. Not for the
        memory's reshape to a shape measured faster under these conditions (``held``):
        that move is itself the reading that they hold, and wiping what it read let a
        2 x 2 run on swinging timers in the replica simulator go to 4 x 1 and back 9 times,
        each time forgetting that 4 x 1 had measured slower."""
        calibrated = all(e.calibrated for e in self.est)
        changing = any(e.changing for e in self.est) and not held
        carry: dict[str, Any] = {
            "clean_f": np.median([e.clean_f for e in self.est], axis=0).tolist(),
            "clean_b": np.median([e.clean_b for e in self.est], axis=0).tolist(),
        }
        if calibrated:
            of = float(np.median(np.concatenate([e.clean_of for e in self.est])))
            ob = float(np.median(np.concatenate([e.clean_ob for e in self.est])))
            carry.update(
                clean_of=[of] * num_stages,
                clean_ob=[ob] * num_stages,
                calibrated=True,
                calibrating=False,
            )
        before, clean = self.regime, self._clean_label()
        # Clean conditions read alike in every shape: every device at its clean per-layer
        # costs, which carry over (a slowed device's reading depends on what it holds). The
        # new estimates know them as a regime (1) under the label they had, named again once
        # the devices read as clean again (an interferer's end, ``CostEstimates.returning``).
        # Without it a 2 x 2 run in the replica simulator that reshaped on an onset's first
        # window held one pipeline of 4 stages from the end on, 1.7x the 4 x 1 it had
        # measured clean before. Not needed where the clean conditions are those in force
        # and carry over as such.
        seed = clean if clean is not None and (changing or clean != before) else None
        if seed is not None:
            carry.update(regimes=2, regime_loads={1: [[1.0] * num_stages, 1]})
        self.dp, self.num_stages = dp, num_stages
        self.est = [self._estimates(num_stages) for _ in range(dp)]
        for e in self.est:
            e.load_state(carry)
        self._regimes = {}  # the new estimates' regimes name other places' conditions
        now = self.regime
        relabel: dict[int, int] = {} if changing else {before: now}
        if seed is not None:
            relabel[seed] = seed
            self._regimes[(1,) * dp] = seed

        def label(g: int) -> int:
            if g not in relabel:
                self._stale -= 1  # below every label estimates give: never matched again
                relabel[g] = self._stale
            return relabel[g]

        self.memory.entries = [(c, label(g), t) for c, g, t in self.memory.entries]
        self._shortfalls = {label(g): xs for g, xs in self._shortfalls.items()}
        for name in ("_promise", "_pending"):
            got = getattr(self, name)
            if got is not None:
                setattr(self, name, got._replace(regime=label(got.regime)))

    def _clean_label(self) -> int | None:
        """The label of the conditions under which every device read clean (each rank
        within its threshold of its clean costs), the nearest to clean if several; None if
        no configuration was measured under such conditions."""
        found = []
        for key, label in self._regimes.items():
            worst = 0.0
            for e, rid in zip(self.est, key, strict=True):
                load = e.regime_load(rid)
                dev = None if load is None else np.abs(np.log(np.maximum(load, 1e-9)))
                if dev is None or np.any(dev > e.threshold()):
                    break
                worst = max(worst, float(dev.max()))
            else:
                if any(g == label for _, g, _ in self.memory.entries):
                    found.append((worst, label))
        return min(found)[1] if found else None

    def _judge(self, here: float, noise: float) -> None:
        """The first trusted window after a model-proposed move: what it achieved against
        what it promised, and whether it ran slower than the configuration it left (beyond
        ``min_gain`` and the two windows' noise: filed, whatever the conditions, for
        ``_as_then``); a reshape, whether it ran no faster. A change of conditions in
        between says nothing of the promise: its shortfall is not counted.

        A reshape costs far more than a shift of layers or shares (its copies, new
        communicators, a first step of about 4x), and one measured no faster than the shape
        it left is that cost again each time the model promises it: in the replica simulator
        a 4 x 2 vgg16 run went between DP only and 4 x 2 three times, each measured within
        0.4% of the other, on promises of 2-30% (1.196x the oracle; filed, 1.174x). Not for
        moves within a shape: filing theirs made two seed 11 runs 3-3.7% slower."""
        promise, self._promise = self._promise, None
        if promise is None:
            return
        regime, ratio, before, src, dst, before_noise = promise
        tol = self._as_then_tol(before_noise, noise)
        moved = float(np.log(here / max(before, 1e-9)))  # the steps' change, log ratio
        if moved > (tol if src.shape == dst.shape else -tol):
            self._slower = [*self._slower, (src, dst, before, here, before_noise)][-_SLOWER:]
        if regime != self.regime:
            return
        if moved > tol:
            # Slower beyond the two windows' noise under the same conditions: undone on this
            # window (``_decide``), as the ``Controller`` undoes such a move. The memory's
            # way back needs the configuration left measured under this regime, and a window
            # whose change is unconfirmed is filed under none: in the replica simulator a
            # 4 x 1 resnet50 run on swinging timers shifted shares to 3/2/1/2 in a window
            # that named new conditions, measured 96 ms per batch against the even shares'
            # 68, and held the shift to the end (1.35x static; undone, 1.04x).
            self._undo = (src, before)
        short = max(0.0, moved - float(np.log(max(ratio, 1e-9))))
        kept = self._shortfalls.get(regime, [])
        self._shortfalls[regime] = [*kept, short][-_SHORTFALLS:]

    def _decide(self, w: Window, cur: ReplicaConfig, here: float) -> Decision:
        cfg = self.config
        costs = self._costs(w)
        pipes = _Steps(costs, w.schedule)
        model_now = self._predict(pipes, cur, w.ranks)
        pause = self.pause_ms if self.pause_ms is not None else w.median_step_ms
        slow = tuple(float(x) for e in self.est for x in e.load)
        prev, self._seen = self._seen, (cur, model_now, w.median_step_ms)
        regime = self.regime

        def verdict(
            reason: str,
            proposed: float = model_now,
            to: ReplicaConfig | None = None,
            promise: float | None = None,
            held: bool = False,
        ):
            """``promise``: a model-proposed move's predicted ratio of the time per batch
            after it to before it (judged on the next trusted window); ``held``: a move to
            what was measured faster under the conditions in force (they held)."""
            nbytes = 0
            if to is not None and to.shape != cur.shape:
                nbytes = self._copies(w, to)[1]
            elif to is not None and to.bounds != cur.bounds:
                ranks = tuple(range(self.num_stages))
                nbytes = self.dp * moved_bytes(self.base.state_bytes, cur.bounds, to.bounds, ranks)
            if to is not None:
                self._held_move = held
                # The next window checks the model's promise against the steps.
                self._seen = (to, model_now, w.median_step_ms)
                self._pending = (
                    None
                    if promise is None
                    else _Promise(regime, promise, here, cur, to, w.step_noise)
                )
            return Decision(
                step=w.step + 1,
                mode=self.mode_used,
                slowdown=slow,
                current_ms=model_now,
                proposed_ms=proposed,
                pause_ms=pause + self._wire_ms(w, to, cur),
                moved_bytes=nbytes,
                repartition=to is not None,
                reason=reason,
                bounds=None if to is None else to.bounds,
                shares=None if to is None else to.shares,
                dropped=None if to is None else to.dropped,
            )

        self._left_out = self._left_out + len(w.step_ms) if cur.dropped else 0
        undo, self._undo = self._undo, None
        if undo is not None and undo[0] != cur:
            return verdict(
                f"back to {undo[0]!r}: the move from it measured {here:.2f} ms per batch "
                f"against {undo[1]:.2f} under the same conditions",
                proposed=model_now * undo[1] / here,
                to=undo[0],
                held=True,
            )
        if self._hold > 0:
            # A replica just came back from partial reduce: two windows let its estimates
            # confirm (or not) that its devices changed before anything is compared.
            self._hold -= 1
            return verdict("re-measuring a replica partial reduce had left out")
        if cur.dropped and self._left_out >= cfg.horizon_steps:
            back = self._with_shares(pipes, cur.bounds, sum(cur.shares))
            self._hold = 2
            return verdict(
                f"partial reduce: replicas {list(cur.dropped)} left out for {self._left_out} "
                "steps: their share back to re-measure their devices",
                to=back,
            )
        # Configurations are compared on measurements of the same conditions and of recent
        # windows (a machine's background load drifts), as the ``Controller`` compares
        # plans: one measured faster beyond the two configurations' noise is moved to. With
        # ``min_gain`` as the bar instead, two configurations within a window's noise of each
        # other (a stage-timer noise that swings the steps 5-10% from window to window) were
        # taken in turn whenever one window of the other read slower: in the replica
        # simulator a 2 x 2 resnet50 run moved 11 times between 10|8 and 11|7 and ran 2.5%
        # slower than holding the even split.
        recent = 2 * cfg.average_windows
        # Devices that read as under earlier conditions, one window before the change is
        # confirmed (an interferer gone): the configuration measured fastest then, against
        # this window's steps (the ``Controller``'s return). Not where the steps refute the
        # reading: this configuration measured then, and now beyond a change of conditions
        # from it. Without it the noise bar below holds the run a window longer on what the
        # interferer asked for: the device that sped up is as uncertain as its unconfirmed
        # change.
        backs = []
        for then in self._returning():
            was = self.memory.measured(cur, then, last=recent)
            if was is not None and self._beyond_noise(w, here, was):
                continue
            back = self.memory.faster(
                cur, here, then, last=recent, window_noise=w.step_noise, here_windows=1
            )
            if back is not None and (here - back[1]) * cfg.horizon_steps > pause + self._wire_ms(
                w, back[0], cur
            ):
                backs.append(back)
        if backs:
            back = min(backs, key=lambda x: x[1])
            return verdict(
                f"devices read as they ran before: {back[0]!r} measured {back[1]:.2f} ms per "
                f"batch then against {here:.2f} now",
                proposed=model_now * back[1] / here,
                to=back[0],
            )
        level = self.memory.measured(cur, regime, last=recent) or here
        best = self.memory.faster(cur, level, regime, last=recent, window_noise=w.step_noise)
        if best is not None and (level - best[1]) * cfg.horizon_steps > pause + self._wire_ms(
            w, best[0], cur
        ):
            return verdict(
                f"{best[0]!r} measured {best[1]:.2f} ms per batch under these conditions "
                f"against {level:.2f} now",
                proposed=model_now * best[1] / level,
                to=best[0],
                held=True,
            )
        if prev is None or prev[0] != cur:
            return verdict("the model has not yet predicted a window of this configuration")
        model, steps = model_now / max(prev[1], 1e-9), w.median_step_ms / max(prev[2], 1e-9)
        miss = float(np.log(model / steps))
        self._misses = [*self._misses, miss][-_MISSES:]
        lm, ls = float(np.log(model)), float(np.log(steps))
        if abs(miss) > np.log1p(self._tolerance(w)) and (lm * ls < 0 or abs(lm) > abs(ls)):
            return verdict(
                f"estimates moved {model - 1:+.0%} but steps {steps - 1:+.0%}: not acted on"
            )
        scored = self._scored(w, costs, pipes, cur)
        now = model_now / cur.counted_fraction
        ms, pick = min(scored, key=lambda x: (x[0], x[1] != cur, repr(x[1])))
        if pick == cur:
            return verdict("current configuration is best")
        gain = now - ms
        need = self.required_gain()
        if gain < need * now:
            return verdict(f"gain {gain / now:.1%} below {need:.1%}", ms)
        # The model's gain, on the scale of the measured step, must pay the pause back.
        real = here * gain / now
        cost = pause + self._wire_ms(w, pick, cur)
        if real * cfg.horizon_steps <= cost:
            return verdict(
                f"gain {real:.2f} ms/step does not pay {cost:.1f} ms within "
                f"{cfg.horizon_steps} steps",
                ms,
            )
        known = self.memory.measured(pick, regime, last=recent)
        if known is not None and known >= here * (1 - cfg.min_gain):
            return verdict(
                f"{pick!r} measured {known:.2f} ms per batch under these conditions, no "
                f"better than {here:.2f} now",
                ms,
            )
        # A gain the estimates' own noise could make is no gain (the ``Controller``'s rule):
        # where stage timers swing on their own, the options that look best are those that
        # favour the devices whose timers read low. In the replica simulator a 4 x 2 resnet50
        # run on loader-bound timers took a 19% promise to uneven shares, held them, and ran
        # 6% slower than static. Every device one standard error
        # against the move, but the one bounding the job's step where the steps moved as
        # the estimates did, beyond what they swing against the model on their own (an
        # onset is then acted on at once).
        vouched = lm * ls > 0 and abs(ls) > np.log1p(self._swing())
        # (Another shape's devices are priced apart: ``_other_shapes``.)
        sure = (
            self._gain_beyond_noise(w, costs, cur, pick, vouched=vouched)
            if pick.shape == cur.shape
            else 1.0
        )
        if sure <= 0:
            return verdict(
                f"gain {gain / now:.1%} within the estimates' noise ({sure:+.1%} with every "
                "device one standard error against it)",
                ms,
            )
        # The same move measured slower before (a reshape: no faster, ``_judge``), where
        # this configuration runs as it did then, whatever regime the timers name now (the
        # ``Controller``'s rule): timers that swing on their own name regimes in turn, and a
        # 2 x 1 resnet50 run in the replica simulator took the same 21-24% promise of uneven
        # shares every 50 steps, each time measured 24% slower and taken back.
        for src, dst, before, after, noise in self._slower:
            if src == cur and dst == pick and self._as_then(here, before, noise, w.step_noise):
                return verdict(
                    f"{pick!r} measured {after:.2f} ms per batch against this configuration's "
                    f"{before:.2f} when it ran as now ({here:.2f}): the model's "
                    f"{gain / now:.1%} not taken",
                    ms,
                )
        what = "partial reduce: " if pick.dropped else ""
        if pick.shape != cur.shape:
            what = f"reshape {cur.shape[0]} x {cur.shape[1]} -> {pick.shape[0]} x {pick.shape[1]}: "
        return verdict(
            f"{what}predicted {now:.2f} -> {ms:.2f} ms per batch with {pick!r}",
            ms * pick.counted_fraction,
            pick,
            promise=ms / max(now, 1e-9),
        )

    def _scored(
        self, w: Window, costs: list[CostModel], pipes: _Steps, cur: ReplicaConfig
    ) -> list[tuple[float, ReplicaConfig]]:
        """Every option weighed with its predicted time per counted batch."""
        options = self._candidates(costs, pipes, cur, w.schedule, memory=self._memory(w))
        scored = [(self._predict(pipes, c, w.ranks) / c.counted_fraction, c) for c in options]
        if self.config.reshape:
            scored += self._other_shapes(costs, w, cur)
        return scored

    def _gain_beyond_noise(
        self,
        w: Window,
        costs: list[CostModel],
        cur: ReplicaConfig,
        pick: ReplicaConfig,
        *,
        vouched: bool,
    ) -> float:
        """The relative gain per counted batch of ``pick`` over ``cur`` with every device's
        estimate one standard error against the move (``CostEstimates.uncertainty``): its
        costs lowered under ``cur``, raised under ``pick``. ``vouched``: the busiest stage
        of each replica that bounds the step is taken as it is."""
        subs = w.replicas or ()
        sds = [self.est[r].uncertainty()[list(sub.ranks)] for r, sub in enumerate(subs)]
        if vouched:
            # Every replica that may bound the step: within a change of conditions of the
            # slowest (the same stage slowed in each bounds it in each).
            pipes = _Steps(costs, w.schedule)
            live = [r for r in range(len(costs)) if r not in cur.dropped]
            ms = {r: pipes(cur.bounds, r, cur.shares[r]) for r in live}
            top = max(ms.values())
            for r in live:
                if np.log(top / max(ms[r], 1e-9)) <= np.log1p(self._step_noise_limit(w)):
                    sc = stage_costs(costs[r], cur.bounds, schedule=w.schedule)
                    sds[r] = sds[r].copy()
                    sds[r][int(np.argmax(np.add(sc.fwd_ms, sc.bwd_ms)))] = 0.0
        low = _Steps(
            [scaled_rows(c, np.exp(-sd)) for c, sd in zip(costs, sds, strict=True)], w.schedule
        )
        high = _Steps(
            [scaled_rows(c, np.exp(sd)) for c, sd in zip(costs, sds, strict=True)], w.schedule
        )
        before = self._predict(low, cur, w.ranks) / cur.counted_fraction
        after = self._predict(high, pick, w.ranks) / pick.counted_fraction
        return 1.0 - after / max(before, 1e-9)

    def priced(self, window: Window) -> list[tuple[float, ReplicaConfig]]:
        """The options a decision on ``window`` weighs (the configuration in force first),
        each with its predicted time per counted batch, from the estimates as they stand:
        called after ``observe(window)``, what that decision compared. Changes nothing."""
        cur = self._config_of(window)
        costs = self._costs(window)
        pipes = _Steps(costs, window.schedule)
        return self._scored(window, costs, pipes, cur)

    def required_gain(self) -> float:
        """``min_gain``, or what the last model-proposed moves under the current conditions
        fell short of their promise by on average, whichever is more."""
        mine = self._shortfalls.get(self.regime)
        short = float(np.expm1(np.mean(mine))) if mine else 0.0
        return max(self.config.min_gain, short)

    def _beyond_noise(self, w: Window, here: float, ms: float) -> bool:
        """Whether ``here`` (``w``'s time per batch) is beyond a change of conditions from
        ``ms`` (``_step_noise_limit``)."""
        return bool(abs(np.log(here / max(ms, 1e-9))) > np.log1p(self._step_noise_limit(w)))

    def _returning(self) -> list[int]:
        """The labels of earlier conditions the devices read as running again: every
        replica under its own regime or, where its devices' change is unconfirmed, one it
        reads as run again (``CostEstimates.returning``); only combinations measured before,
        and not the current one."""
        options = []
        for e in self.est:
            if e.changing or e.returning:
                options.append(e.returning)
            else:
                options.append((e.regime,))
        if not any(e.returning for e in self.est):
            return []
        now = self.regime
        labels = (self._regimes.get(k) for k in itertools.product(*options))
        return list(dict.fromkeys(g for g in labels if g is not None and g != now))

    # ---- the model -------------------------------------------------------------------------
    def _costs(self, w: Window) -> list[CostModel]:
        """Every replica's planner costs: rows in stage order of its window."""
        subs = w.replicas or ()
        pred = self._predicted(subs)
        base = self._base(w.num_stages)  # ``planner_costs`` takes it as it is
        return [
            planner_costs(base, self.est[r], sub, predicted=pred[r]) for r, sub in enumerate(subs)
        ]

    def _base(self, num_devices: int) -> CostModel:
        if num_devices not in self._bases:
            self._bases[num_devices] = self.base.for_devices(num_devices)
        return self._bases[num_devices]

    def _predict(self, pipes: _Steps, c: ReplicaConfig, places: Sequence[int]) -> float:
        """The job's step: the slowest replica's pipeline, then what the stages' gradient
        all-reduce and optimizer update add past it. ``places``: the place of each stage
        (replica ``r``'s stage ``s`` is global rank ``r pp + places[s]``), whose device's
        measured update rate prices the stage's update.

        Stage ``s`` ends its last backward ``lead_s`` before the pipeline's end, then waits
        for its reduce, then updates: the step ends ``max_s (exposed_s + update_s -
        lead_s)`` past the pipeline. With the updates measured, a stage's reduce is exposed
        only beyond its own last microbatch's backward, which the reduce's buckets overlap
        (DDP's): gpt 12 x 2048 as DP only on 4 x H200 waited 1.8 ms for a
        reduce priced 11.8 ms without that overlap. Before any update is measured (logs
        without it) the reduce is priced whole, as the planner does
        (``planner.shape.reduce_tail_ms``), which stood in for the update."""
        t = 0.0
        for r in range(len(pipes.costs)):
            if r not in c.dropped:  # a left-out replica only waits for the reduce
                t = max(t, pipes(c.bounds, r, c.shares[r]))
        key = (c.bounds, len(c.shares))
        if key not in self._tails:
            self._tails[key] = tail_parts(self.base, bounds=c.bounds, replicas=len(c.shares))
        reduce, lead, own = self._tails[key]
        update = self._updates(c, places)
        if update is not None:
            reduce = np.maximum(reduce - own, 0.0) + update
        elif len(c.shares) == 1:
            return t  # one pipeline, no update measured: the step is the pipeline's
        return t + max(float(np.max(reduce - lead)), 0.0)

    def _updates(self, c: ReplicaConfig, places: Sequence[int]) -> np.ndarray | None:
        """Per stage of ``c``, its slowest replica's optimizer update: the parameter bytes
        the stage would hold times the update rate measured on the device that would hold
        them (None until some device's update has been timed).

        The update of a rank's parameters is one pass over them and their optimizer state,
        so its time is proportional to the bytes it holds: AdamW on gpt 12 x 2048 took
        12.0 ms a rank in DP only and 6.0 ms in 2 x 2 on 4 x H200. A device's
        rate is measured on whatever it holds now, so it carries its device's slowdown
        (22.8 and 11.7 ms on the GPU under ``gemm``). A device not yet timed holding
        parameters is priced at the median of the others."""
        known = np.isfinite(self._rate)
        if not known.any():
            return None
        rate = np.where(known, self._rate, float(np.median(self._rate[known])))
        d, p = c.shape
        out = np.zeros(p)
        for s, (a, b) in enumerate(c.bounds):
            held = self._params[b] - self._params[a]
            out[s] = held * max(float(rate[r * p + places[s]]) for r in range(d))
        return out

    def _measure_updates(self, w: Window) -> None:
        """Each rank's update rate (ms per parameter byte) from the window's median update
        of the stage it holds; a rank holding no parameters keeps its last rate."""
        pp = w.num_stages
        for r, sub in enumerate(w.replicas or ()):
            med = sub.update_medians()
            if med is None:
                continue
            for s, (a, b) in enumerate(sub.bounds):
                held = self._params[b] - self._params[a]
                if held > 0 and np.isfinite(med[s]):
                    self._rate[r * pp + sub.ranks[s]] = float(med[s]) / held

    @staticmethod
    def _low(schedule: str, *, dp: int, pp: int) -> list[int]:
        return [pp if schedule == "1f1b" else 1] * dp

    def _with_shares(self, pipes: _Steps, bounds: Bounds, total: int) -> ReplicaConfig:
        low = self._low(pipes.schedule, dp=len(pipes.costs), pp=len(bounds))
        shares, _ = best_shares(lambda r, m: pipes(bounds, r, m), total=total, low=low)
        return ReplicaConfig(bounds=bounds, shares=shares)

    def _memory(self, w: Window) -> list[float] | None:
        """Per stage, the least memory its device has free in any replica (every replica's
        copy of a stage must fit), or None where nothing is known (CPU)."""
        subs = [sub.memory_bytes for sub in w.replicas or () if sub.memory_bytes is not None]
        if not subs or not any(np.isfinite(m).any() for m in subs):
            return None
        arr = np.asarray(subs, dtype=float)
        return np.min(np.where(np.isfinite(arr), arr, np.inf), axis=0).tolist()

    def _candidates(
        self,
        costs: list[CostModel],
        pipes: _Steps,
        cur: ReplicaConfig,
        schedule: str,
        *,
        memory: list[float] | None = None,
    ) -> list[ReplicaConfig]:
        total = sum(cur.shares)
        splits: list[Bounds] = [cur.bounds]
        # One stage has one split: every model gives it, or the same memory error (their
        # bytes are the base's; only their times differ), so one of them tells.
        planned = _with_worst(costs) if self.num_stages > 1 else costs[:1]
        mean = total // self.dp
        for cm in planned:
            # ``plan_partition``'s split, listed and scored at once where splits are few.
            b = best_bounds(
                cm,
                num_stages=self.num_stages,
                schedule=schedule,
                microbatches=mean,
                memory_bytes=memory,
            )
            if b not in splits:
                splits.append(b)
        out = [cur]
        for b in splits:
            c = self._with_shares(pipes, b, total)
            out += [c, ReplicaConfig(bounds=b, shares=cur.shares)]
        # Leaving a replica out stops its measurement: only on a confirmed change, so a
        # spike cannot leave its devices unmeasured, and memory compares like with like.
        if self.config.partial_reduce and self.dp > 1 and not any(e.changing for e in self.est):
            # Leave out the replica slowest per microbatch under each exact option.
            for c in list(out):
                if c.dropped:
                    continue
                per_mb = [
                    predicted_step_ms(cm, c.bounds, schedule="gpipe", microbatches=1)
                    for cm in costs
                ]
                slowest = int(np.argmax(per_mb))
                out.append(ReplicaConfig(bounds=c.bounds, shares=cur.shares, dropped=(slowest,)))
        # Deduplicated, the current one first.
        return list(dict.fromkeys(out))

    # ---- other shapes ------------------------------------------------------------------
    def _devices(self, costs: list[CostModel], w: Window) -> tuple[np.ndarray, ...]:
        """Per global rank: every layer's fwd/bwd ms per microbatch on its device
        (``[world, L]``) and its stage overhead (``[world]``), from each replica's model."""
        n = self.base.num_layers
        f, b = np.zeros((self.world, n)), np.zeros((self.world, n))
        of, ob = np.zeros(self.world), np.zeros(self.world)
        for r, (cm, sub) in enumerate(zip(costs, w.replicas or (), strict=True)):
            for s, place in enumerate(sub.ranks):
                g = r * self.num_stages + place
                f[g], b[g] = cm.fwd_ms[s], cm.bwd_ms[s]
                of[g], ob[g] = cm.stage_fwd_ms[s], cm.stage_bwd_ms[s]
        return f, b, of, ob

    def _other_shapes(
        self, costs: list[CostModel], w: Window, cur: ReplicaConfig
    ) -> list[tuple[float, ReplicaConfig]]:
        """Every other shape's configurations with their predicted time per batch: each
        replica of ``dp' x pp'`` on the devices it would run on (global rank ``r pp' + s``
        holds stage ``s`` of replica ``r``), the pipeline planner's split of each replica's
        model and of their worst, each with its best and with even shares."""
        f, b, of, ob = self._devices(costs, w)
        n, total = self.base.num_layers, sum(cur.shares)
        room = self._room(w)
        out: list[tuple[float, ReplicaConfig]] = []
        for d, p in shape_options(self.world, total=total, schedule=w.schedule, num_layers=n):
            if (d, p) == cur.shape:
                continue
            rows = [slice(r * p, (r + 1) * p) for r in range(d)]
            # The host's issue times (GPU) are the same on every device: every shape is
            # priced with them, as the current one is (``planner_costs``).
            host = {}
            if costs and costs[0].has_host:
                host = {
                    "host_fwd_ms": np.repeat(costs[0].host_fwd_ms[:1], p, axis=0),
                    "host_bwd_ms": np.repeat(costs[0].host_bwd_ms[:1], p, axis=0),
                }
            models = [
                dataclasses.replace(
                    self._base(p),
                    fwd_ms=f[i],
                    bwd_ms=b[i],
                    stage_fwd_ms=of[i],
                    stage_bwd_ms=ob[i],
                    **host,
                )
                for i in rows
            ]
            splits: list[Bounds] = [((0, n),)] if p == 1 else []
            if p > 1:
                for cm in _with_worst(models):
                    split = best_bounds(
                        cm, num_stages=p, schedule=w.schedule, microbatches=total // d
                    )
                    if split not in splits:
                        splits.append(split)
            pipes = _Steps(models, w.schedule)
            for split in splits:
                even = ReplicaConfig(bounds=split, shares=(total // d,) * d)
                for c in dict.fromkeys([self._with_shares(pipes, split, total), even]):
                    if self._fits(c, w.schedule, room):
                        out.append((self._predict(pipes, c, range(p)), c))
        return out

    def _room(self, w: Window) -> float | None:
        """The bytes one rank may hold in any shape: the least, over ranks, of what its
        device has free plus the layer state it holds now (None where unknown: CPU)."""
        static = self.base.static_bytes
        room = []
        for sub in w.replicas or ():
            if sub.memory_bytes is None:
                continue
            for (a, b), place in zip(sub.bounds, sub.ranks, strict=True):
                free = float(sub.memory_bytes[place])
                if np.isfinite(free):
                    room.append(free + float(static[a:b].sum()))
        return min(room) if room else None

    def _fits(self, c: ReplicaConfig, schedule: str, room: float | None) -> bool:
        """Every stage's state and in-flight activations within ``room`` (the planner's
        memory model)."""
        if room is None:
            return True
        k = in_flight(schedule, num_stages=len(c.bounds), microbatches=max(c.shares))
        static, act = self.base.static_bytes, self.base.act_bytes
        return all(
            float(static[a:b].sum() + k[s] * act[a:b].sum()) <= room
            for s, (a, b) in enumerate(c.bounds)
        )

    def _held(self, c: ReplicaConfig, w: Window | None = None) -> list[tuple[int, int]]:
        """The layers each global rank holds under ``c`` (stage ``s`` at place ``s``, or at
        the window's places for the configuration in force)."""
        d, p = c.shape
        bounds = list(c.bounds)
        if w is not None:
            by_place = dict(zip(w.ranks, w.bounds, strict=True))
            bounds = [by_place[q] for q in range(p)]
        return [bounds[g % p] for g in range(d * p)]

    def _copies(self, w: Window, to: ReplicaConfig) -> tuple[float, int]:
        """A reshape to ``to``: the copies' largest per-rank bytes over the link (ms) and
        the bytes copied (``autodp.copy_plan``: each layer a rank lacks, from a holder)."""
        old = self._held(ReplicaConfig(bounds=tuple(w.bounds), shares=(1,) * self.dp), w)
        names = self.base.layer_names
        copies = copy_plan(old, self._held(to), names=names, sizes=self.base.state_bytes)
        per_rank: dict[int, float] = {}
        for t in copies:
            per_rank[t.src] = per_rank.get(t.src, 0.0) + (t.nbytes or 0)
            per_rank[t.dst] = per_rank.get(t.dst, 0.0) + (t.nbytes or 0)
        bw = float(self.base.meta.get("link_bandwidth", 25e9))
        wire = max(per_rank.values(), default=0.0) / bw * 1e3
        return wire, int(sum(t.nbytes or 0 for t in copies))

    def _wire_ms(self, w: Window, to: ReplicaConfig | None, cur: ReplicaConfig) -> float:
        """What a move to ``to`` adds to the measured pause: a reshape's copies (0 else)."""
        if to is None or to.shape == cur.shape:
            return 0.0
        return self._copies(w, to)[0]

    def _predicted(self, subs: Sequence[Window]) -> list[tuple[np.ndarray, np.ndarray] | None]:
        """Per replica, its devices' per-layer predicted slowdowns from their telemetry
        (``predicted_slowdowns``; None where it has none), from one predictor call over
        every replica's devices: a replica's numbers are the ones a call of its own gives,
        for a fraction of the calls' fixed cost."""
        out: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(subs)
        # A replica of one stage holds every layer on its device: its costs are all
        # measured, and ``CostEstimates.costs`` reads a prediction only for a layer a
        # device does not hold, so it needs none.
        use = [r for r, sub in enumerate(subs) if sub.telemetry and sub.num_stages > 1]
        if self.mode_used != "adaptive" or not use:
            return out
        counts = [len(subs[r].telemetry or ()) for r in use]
        cf = np.repeat([self.est[r].clean_f for r in use], counts, axis=0)
        cb = np.repeat([self.est[r].clean_b for r in use], counts, axis=0)
        tel = [t for r in use for t in subs[r].telemetry or ()]
        sf, sb = predicted_slowdowns(self.predictor, self.prepared, cf, cb, tel)
        at = 0
        for r, k in zip(use, counts, strict=True):
            out[r] = (sf[at : at + k], sb[at : at + k])
            at += k
        return out

    # ---- after a move ----------------------------------------------------------------------
    def applied(self, *, step: int, pause_ms: float, moved_bytes: int) -> None:
        del moved_bytes
        self._promise, self._pending = self._pending, None
        self.settle = self.config.settle_windows
        p = float(pause_ms)
        self._moved = (step, p, self.pause_ms)
        self.pause_ms = p if self.pause_ms is None else 0.5 * (self.pause_ms + p)

    def _move_cost(self, w: Window) -> None:
        """The last move's whole cost, once the window starting with its first step is in:
        its pause plus what its first step and the stand before it took beyond the others
        (``Window.move_cost_ms``) takes the pause's place in the average of moves' costs.
        The first step of a new shape has run about 4x a step (gpt 12 x 2048 from one pipeline
        to 2 x 2 on 4 x H200: 558 ms against 145 after it, the pause 239)."""
        if self._moved is None:
            return
        step, p, before = self._moved
        cost = w.move_cost_ms(step, p)
        if w.step >= step:
            self._moved = None
        if cost is not None:
            self.pause_ms = cost if before is None else 0.5 * (before + cost)

    # ---- persistence ---------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "estimates": [e.state() for e in self.est],
            "memory": [[*_config_json(c), g, t] for c, g, t in self.memory.entries],
            "slower": [[_config_json(a), _config_json(b), *times] for a, b, *times in self._slower],
            "pause_ms": self.pause_ms,
            "misses": self._misses,
            "shortfalls": [[g, xs] for g, xs in self._shortfalls.items()],
            "left_out": self._left_out,
            "shape": [self.dp, self.num_stages],
            "stale": self._stale,
            "regimes": [[list(k), g] for k, g in self._regimes.items()],
            "next_regime": self._next_regime,
            # Per global rank (NaN: not yet timed): JSON has no NaN, so None.
            "update_rates": [None if r != r else float(r) for r in self._rate],
        }

    def load_state(self, state: dict[str, Any]) -> None:
        if not state:
            return
        target = (self.dp, self.num_stages)
        shape = tuple(int(x) for x in state.get("shape") or target)
        if shape[0] * shape[1] != self.world:
            raise ValueError(
                f"policy state of {shape[0]} x {shape[1]} ranks for a policy of "
                f"{self.dp} x {self.num_stages}"
            )
        if shape != target:
            # Saved before a reshape this policy asked for (the restart baseline's
            # checkpoint): loaded in its shape, then carried to the new one.
            self.dp, self.num_stages = shape
            self.est = [self._estimates(shape[1]) for _ in range(shape[0])]
        self._stale = int(state.get("stale", 0))
        self._regimes = {tuple(int(x) for x in k): int(g) for k, g in state.get("regimes", [])}
        self._next_regime = int(state.get("next_regime", 0))
        for e, s in zip(self.est, state.get("estimates", []), strict=False):
            e.load_state(s)
        self.memory.entries = [
            (_config_from(bounds, shares, dropped), int(g), float(t))
            for bounds, shares, dropped, g, t in state.get("memory", [])
        ]
        self._slower = [
            (_config_from(*a), _config_from(*b), float(x), float(y), float(z))
            for a, b, x, y, z in state.get("slower", [])
        ]
        if "regimes" not in state:
            # Saved when a label was the replicas' regimes summed: none names conditions
            # this policy can tell again, so none is compared with what it measures now.
            old: dict[int, int] = {}
            for i, (c, g, t) in enumerate(self.memory.entries):
                if g not in old:
                    self._stale -= 1
                    old[g] = self._stale
                self.memory.entries[i] = (c, old[g], t)
        self.pause_ms = state.get("pause_ms")
        self._misses = [float(x) for x in state.get("misses", [])]
        self._left_out = int(state.get("left_out", 0))
        saved = state.get("shortfalls") or []
        # A state that holds one list under no regime (an older checkpoint's) cannot be
        # assigned to a regime, so it is dropped.
        self._shortfalls = (
            {int(g): [float(x) for x in xs] for g, xs in saved}
            if isinstance(saved[0] if saved else None, list)
            else {}
        )
        rates = state.get("update_rates")
        if rates is not None and len(rates) == self.world:
            self._rate = np.array([np.nan if r is None else float(r) for r in rates])
        if shape != target:
            self._reshaped(*target)


def _config_json(c: ReplicaConfig) -> list:
    return [[list(b) for b in c.bounds], list(c.shares), list(c.dropped)]


def _config_from(bounds: list, shares: list, dropped: list) -> ReplicaConfig:
    return ReplicaConfig(
        bounds=tuple((int(a), int(b)) for a, b in bounds),
        shares=tuple(int(x) for x in shares),
        dropped=tuple(int(x) for x in dropped),
    )
