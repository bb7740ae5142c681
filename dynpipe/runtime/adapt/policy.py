"""Policies: from a window of measurements to a decision (pure logic over plain numbers).

A policy sees one ``Window`` at a time and says whether to move to other bounds. It never
touches a process group, an engine or a file, so the training loop, the replay tool and the
controller simulator drive the same code, and tests inject their own.

``Controller`` (``measured``, ``adaptive``, ``restart``) plans from measured per-layer costs
(``CostEstimates``): the exact planner on the current estimates gives the best split; it is
taken when its predicted gain is at least ``min_gain`` and pays back the measured pause
within ``horizon_steps``. The step time is what the model answers to:

- a plan measured faster under the same conditions, beyond what the two plans' window
  noise could make, is moved back to (``PlanMemory``: the regime's own last windows, so
  conditions that come back, an interferer gone, bring back the plan measured best under
  them, in the first window that reads as they did, before the next confirms it);
- each move is judged on the first trusted window after it (``MoveRecord``), beyond what the
  two windows' noise could make; one measured slower across a change of conditions has the
  plan it left measured again under the new ones, so an onset neither undoes nor bars it;
- the model is not acted on before it has predicted one window, nor when its estimates
  moved and the steps did not follow (launch-bound timers), nor for a gain that its
  estimates' own noise could make (every device one standard error against the move);
- a move must promise more than the last moves fell short of their promises, as measured
  under one set of conditions (a model its timers mislead stops moving layers); a change of
  conditions, an interferer's end included, clears what was earned under the old ones.

``SweepPolicy`` (benchmarks) visits every split in turn so that one launch measures every
static plan under the same conditions: the oracle the adaptive runs are judged against.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from dynpipe.planner.costs import CostModel
from dynpipe.planner.dp import plan_partition
from dynpipe.planner.evaluate import StageCosts, stage_costs
from dynpipe.planner.plan import PlanError, split_label
from dynpipe.planner.simulate import step_times
from dynpipe.runtime.adapt.config import AdaptConfig
from dynpipe.runtime.adapt.estimates import CostEstimates
from dynpipe.runtime.adapt.record import Bounds, MoveRecord, PlanMemory, as_bounds
from dynpipe.runtime.adapt.window import Window

__all__ = [
    "Controller",
    "Decision",
    "NoiseRules",
    "Policy",
    "SweepPolicy",
    "layer_classes",
    "moved_bytes",
    "planner_costs",
    "predicted_slowdowns",
    "predicted_step_ms",
    "scaled_rows",
    "stage_memory",
]


@dataclass
class Decision:
    """A policy's verdict for one window (plain data, logged as is).

    slowdown: per-rank slowdown against clean costs; current_ms / proposed_ms: the speed
    model's step time under the current and the proposed plan; pause_ms: the pause a move
    is expected to cost; bounds: the plan to move to (``repartition``), else None;
    judged: the verdict on the previous move, when this window judged one.
    shares / dropped: with pipeline replicas, the batch shares and the replicas partial
    reduce leaves out under the plan moved to (None: one replica, or no move).
    """

    step: int
    mode: str
    slowdown: tuple[float, ...]
    current_ms: float
    proposed_ms: float
    pause_ms: float
    moved_bytes: int
    repartition: bool
    reason: str
    bounds: Bounds | None = None
    judged: dict[str, Any] | None = field(default=None, repr=False)
    shares: tuple[int, ...] | None = None
    dropped: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["slowdown"] = [round(float(x), 4) for x in self.slowdown]
        d["bounds"] = None if self.bounds is None else [list(b) for b in self.bounds]
        for k in ("shares", "dropped"):
            if d[k] is None:
                del d[k]  # one replica's decisions read as they always have
            else:
                d[k] = list(d[k])
        for k in ("current_ms", "proposed_ms", "pause_ms"):
            d[k] = round(float(d[k]), 4)
        return d


class Policy(Protocol):
    """What the adaptation loop needs of a policy."""

    mode_used: str

    def observe(self, window: Window) -> Decision | None:
        """Fold in one window; None while it is not trusted (settling)."""

    def applied(self, *, step: int, pause_ms: float, moved_bytes: int) -> None:
        """The move the last decision asked for took effect at ``step``, at this cost."""

    def describe(self) -> str: ...

    def state(self) -> dict[str, Any]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...


def layer_classes(costs: CostModel) -> np.ndarray:
    """Class id per layer: layers with the same modelled costs and state are the same layer
    (a transformer's blocks, VGG's repeated convolutions) and share one clean cost."""
    keys = [
        (round(float(f), 9), round(float(b), 9), int(n))
        for f, b, n in zip(costs.fwd_ms[0], costs.bwd_ms[0], costs.state_bytes, strict=True)
    ]
    ids = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    return np.array([ids[k] for k in keys])


def moved_bytes(state_bytes: np.ndarray, src: Bounds, dst: Bounds, ranks: tuple[int, ...]) -> int:
    """Bytes of layer state that change owner going from ``src`` to ``dst``."""
    n = len(state_bytes)
    owner_a, owner_b = np.empty(n, int), np.empty(n, int)
    for (a, b), (c, d), r in zip(src, dst, ranks, strict=True):
        owner_a[a:b], owner_b[c:d] = r, r
    return int(state_bytes[owner_a != owner_b].sum())


def planner_costs(
    base: CostModel,
    est: CostEstimates,
    w: Window,
    *,
    predicted: tuple[np.ndarray, np.ndarray] | None = None,
) -> CostModel:
    """``base`` with the estimated per-layer costs and stage overheads of ``w``'s ranks, one
    row per stage in pipeline order (the planner puts stage ``s`` on row ``s``)."""
    fwd, bwd = est.costs(w.bounds, w.ranks, predicted=predicted)
    return dataclasses.replace(base.for_devices(w.num_stages), **est.stage_model(fwd, bwd, w.ranks))


def predicted_step_ms(
    costs: CostModel, bounds: Bounds, *, schedule: str, microbatches: int
) -> float:
    """The speed model's step time of ``bounds`` (stage ``s`` on row ``s`` of ``costs``)."""
    sc = stage_costs(costs, bounds, schedule=schedule, microbatches=microbatches)
    return _step_of(sc, schedule=schedule, microbatches=microbatches)


def _step_of(sc: StageCosts, *, schedule: str, microbatches: int) -> float:
    """The pipeline step of stage costs ``sc`` (``stage_costs``' answer)."""
    return float(
        step_times(
            np.array([sc.fwd_ms]),
            np.array([sc.bwd_ms]),
            np.array([sc.comm_ms]),
            schedule=schedule,
            microbatches=microbatches,
        )[0]
    )


def predicted_slowdowns(
    predictor: Any,
    prepared: Any,
    clean_fwd: np.ndarray,
    clean_bwd: np.ndarray,
    telemetry: list[dict],
) -> tuple[np.ndarray, np.ndarray]:
    """``[R, L]`` forward and backward slowdowns the predictor gives each layer on each
    device from the device's telemetry, against the layers' measured clean costs:
    ``clean_*`` ``[L]`` for every device, or ``[R, L]`` one row per device (the predictor
    prices each device's rows on their own, so devices of several estimates go in one
    call)."""
    from dynpipe.predictor import predict_layer_times

    cf, cb = clean_fwd, clean_bwd
    pf, pb = predict_layer_times(
        predictor,
        layers=prepared,
        alone_fwd_ms=np.maximum(cf, 1e-6),
        alone_bwd_ms=np.maximum(cb, 1e-6),
        telemetry=telemetry,  # a reading logged as None is NaN there
    )
    return pf / np.maximum(cf, 1e-6), pb / np.maximum(cb, 1e-6)


_MISSES = 16  # the model's misses remembered for its tracking error
_SHORTFALLS = 3  # moves whose shortfall against their promise is remembered
_SLOWER = 8  # moves judged slower remembered (see ``Controller._slower``)


class NoiseRules:
    """How far measured steps move on their own, shared by the policies that read them
    (``Controller``, ``replicas.ReplicaPolicy``): from ``config`` (``jump``, ``min_gain``)
    and the model's recent misses (``_misses``: log of its predicted window-to-window
    change over the measured one)."""

    config: AdaptConfig
    _misses: list[float]

    def tracking_error(self) -> float:
        """Relative standard deviation of the model's misses: how far, window to window,
        the change of its predicted step time differed from the change of the measured one
        (robust; 0 until a few windows are known)."""
        if len(self._misses) < 3:
            return 0.0
        x = np.asarray(self._misses)
        return float(np.expm1(1.4826 * np.median(np.abs(x - np.median(x)))))

    def _swing(self) -> float:
        """How far the median step moves on its own from one window to the next: ``jump``,
        or twice the model's tracking error (steps that swing against it), whichever is
        more."""
        return max(self.config.jump, 2.0 * self.tracking_error())

    def _step_noise_limit(self, w: Window) -> float:
        """A change of the window's median step that is more than noise: ``_swing``, or
        three standard errors of the median (from the spread of the window's steps),
        whichever is more."""
        return max(self._swing(), 3.0 * w.step_noise)

    def _tolerance(self, w: Window) -> float:
        """How far model and steps may disagree in one window: ``jump``, three tracking
        errors, or three standard errors of the window's median step (from its steps'
        spread: ``Window.step_noise``), whichever is most."""
        return max(self.config.jump, 3.0 * self.tracking_error(), 3.0 * w.step_noise)

    def _as_then(self, now_ms: float, then_ms: float, then_noise: float, now_noise: float) -> bool:
        """Whether a plan measured ``now_ms`` runs as it did at ``then_ms``, by a move's
        verdict rule (``MoveRecord.judge``): within ``min_gain`` and three standard errors
        of the two windows' difference (``*_noise``: ``Window.step_noise``)."""
        tol = self._as_then_tol(then_noise, now_noise)
        return bool(abs(np.log(now_ms / max(then_ms, 1e-9))) <= tol)

    def _as_then_tol(self, then_noise: float, now_noise: float) -> float:
        """How far (log ratio) two windows' step times may differ and still be the same:
        ``min_gain`` or three standard errors of their difference, whichever is more."""
        return max(self.config.min_gain, 3.0 * float(np.hypot(then_noise, now_noise)))


class Controller(NoiseRules):
    """The default policy: plans from measured per-layer costs (see the module docstring).

    base: the model's cost model (one device row): layer names, state bytes, links, and the
        prior per-layer costs before the first measurement.
    predictor / prepared: a loaded slowdown predictor and its ``prepare_layers`` output
        (``adaptive`` and ``restart``); without one those modes plan as ``measured``.
    light_probes: whether light ranks may probe their devices (``light_probes``): on GPUs,
        where a light stage's short kernels run between a co-located job's and its timers
        miss the job; not on CPUs, where a job sharing a core slows every instruction stream
        alike and a light stage's own timers see it (the demo's one-layer stage read its
        emulated 5x at once, while a probe of one layer alone read 2-2.4x a layer's share
        of a stage with nothing slowing it, so the device never read clean again).
    """

    def __init__(
        self,
        *,
        base: CostModel,
        config: AdaptConfig,
        num_ranks: int,
        predictor: Any = None,
        prepared: Any = None,
        light_probes: bool = True,
    ) -> None:
        self.config = config
        self.probe_light = light_probes
        self.base = base
        self.predictor, self.prepared = predictor, prepared
        use = config.mode in ("adaptive", "restart") and predictor is not None
        self.mode_used = "adaptive" if use else "measured"
        self.est = CostEstimates(
            prior_fwd=base.fwd_ms[0],
            prior_bwd=base.bwd_ms[0],
            classes=layer_classes(base),
            num_ranks=num_ranks,
            window=config.average_windows,
            jump=config.jump,
        )
        self.memory = PlanMemory()
        self.pause_ms: float | None = None  # learned from the moves made
        self.settle = config.settle_windows
        self.pending: MoveRecord | None = None  # decided, not yet applied or judged
        self.last: MoveRecord | None = None
        # (bounds, model's step time, measured step time) of the last trusted window, and
        # the model's recent misses (see ``tracking_error``).
        self._seen: tuple[Bounds, float, float] | None = None
        # (plan, measured step time) of the last trusted window, None after a move: what a
        # change of conditions is read against (a move's own effect is not one).
        self._held: tuple[Bounds, float] | None = None
        self._drift = 0  # the last window's drift from its plan's level (``_drift_from_level``)
        self._misses: list[float] = []
        self._shortfalls: list[float] = []  # of the last moves (see ``required_gain``)
        # Returns the steps refuted, as (plan returned from, the devices' readings that
        # suggested it): from that plan, readings nearer those than an earlier regime's own
        # do not send the run back to it, until the plan's steps change (see ``_decide``).
        self._refuted: list[tuple[Bounds, tuple[float, ...]]] = []
        # Moves judged slower, or no better, under one set of conditions, as (plan left,
        # plan taken, step time before, after, the before window's noise): not taken again
        # for the model's promise while the plan left runs as it did (see ``_decide``); the
        # last one held until the way back vouches for it (``_file_slower``).
        self._slower: list[_Pair] = []
        self._slower_held: _Pair | None = None
        self._prediction: tuple[Window, Any] | None = None  # (window, ``_predicted``'s answer)
        # Host ms the last window's prediction took (None: it made none). The adaptive
        # mode's one cost over the measured mode's, logged beside the window's decide_ms.
        self.predict_ms: float | None = None
        # Ranks handed back on request (``dynpipe release``): never brought back by --elastic.
        self.excluded: frozenset[int] = frozenset()

    def describe(self) -> str:
        how = (
            "predicted per-layer slowdowns calibrated on each device's measured layers"
            if self.mode_used == "adaptive"
            else "one slowdown per device"
        )
        return (
            f"{self.config.mode}: per-layer costs measured on the devices that hold them; "
            f"elsewhere clean cost x {how}; move when the gain is >= {self.config.min_gain:.0%} "
            f"and pays back the pause within {self.config.horizon_steps} steps"
        )

    # ---- one window ----------------------------------------------------------------------
    def observe(self, window: Window) -> Decision | None:
        self.predict_ms = None
        if self.settle > 0:
            self.settle -= 1
            return None
        # Steps that jump beyond their noise under an unchanged plan are a change of
        # conditions whatever the timers say (launch-bound timers can hide one in noise).
        # Across a move they are the move's own effect: a move that made the steps slower
        # read as a change of conditions would have its verdict, and the model's broken
        # promise, set aside. So do steps that leave the plan's level under the conditions
        # last named, two windows running on the same side (one is a swing): a change that
        # comes in steps each within the noise of the window before, or gradually, is one
        # too (in the controller simulator a 2-stage resnet50 held 3|15 while a `copy`, then
        # a `gemm` interferer took its steps from 93 to 148 ms over 80 steps, no window more
        # than 19% over the one before, and no new conditions were ever named).
        prev, self._held = self._held, (window.key, window.median_step_ms)
        held = prev is not None and prev[0] == window.key
        drift = self._drift_from_level(window) if held else 0
        changed = held and (self._moved_from(window, prev[1]) or drift * self._drift > 0)
        self._drift = drift
        regime = self.est.regime
        steady = held and not changed
        self.est.update(window, changed=changed, steady=steady)
        idle = {r: p for r, p in (window.probes or {}).items() if r in window.idle}
        if idle:
            # Light ranks' probes (ranks that hold layers) are read in ``update``.
            self.est.probe(idle)
        if changed:
            # Steps that moved under an unchanged plan: what a return would find is news.
            self._refuted = []
        if changed or self.est.regime != regime:
            # Promises broken under the old conditions say little about the model's view of
            # new ones (its timers may well be sound there; an interferer's end is such a
            # change).
            self._shortfalls = []
        slow = tuple(float(x) for x in self.est.load)
        here = window.median_step_ms
        regime = self.est.regime
        # A window whose change of conditions is not yet confirmed is kept under no regime
        # (an onset's first window measured the plan under neither the old conditions nor,
        # for sure, the new ones).
        self.memory.add(window.key, -1 if self.est.changing else regime, here)
        judged = None
        if self.last is not None and self.last.verdict is None and self.last.pause_ms is not None:
            noise = window.step_noise
            self.last.judge(here, slow, regime=regime, tol=self.config.min_gain, after_noise=noise)
            judged = self.last.to_dict()
            self._file_slower(self.last, here, window.step_noise)
            if self.last.model and self.last.verdict != "conditions changed":
                # How far the steps fell short of what the model promised (0 if they did
                # better, or within the two windows' noise). Only a move judged under one
                # set of conditions says anything about the model's promise.
                kept = np.log(self.last.after_ms / max(self.last.before_ms, 1e-9))
                promised = np.log(self.last.predicted_ms / max(self.last.model_before_ms, 1e-9))
                short = float(kept - promised) - self.last.noise(noise)
                self._shortfalls = [*self._shortfalls, max(0.0, short)][-_SHORTFALLS:]
        decision = self._decide(window, slow, self.last if judged is not None else None)
        decision.judged = judged
        return decision

    def _decide(
        self, w: Window, slow: tuple[float, ...], judged: MoveRecord | None = None
    ) -> Decision:
        """``judged``: the move this window just judged, if any."""
        cfg = self.config
        costs = self.cost_model(w)
        kw = {"schedule": w.schedule, "microbatches": w.microbatches}
        cur = predicted_step_ms(costs, w.bounds, **kw)
        regime = self.est.regime
        # Plans are compared on measurements of the same conditions and of recent windows
        # (a machine's background load drifts; an old median says little about now).
        recent = 2 * cfg.average_windows
        key = w.key  # names the plan (one range per rank when ranks may be idle)
        here = self.memory.measured(key, regime, last=recent) or w.median_step_ms
        pause = self.pause_ms if self.pause_ms is not None else w.median_step_ms
        prev, self._seen = self._seen, (key, cur, w.median_step_ms)

        def verdict(
            reason: str,
            proposed: float = cur,
            bounds: Bounds | None = None,
            model: bool = False,
            returns_to: int | None = None,
        ) -> Decision:
            nbytes = 0 if bounds is None else self._moved(w, bounds)
            if judged is not None and judged.returns_to is not None and bounds == judged.src:
                # The window that judges a return to an earlier regime's plan goes back to
                # the plan it left: the steps refuted it, the devices only read as they ran
                # then. A light stage reads its device less slowed than a stage holding work
                # (the demo's head alone read its emulated 5x as 2.5-3.1x, nearer clean than
                # the 11x its five layers read), and the same reading sent the run back
                # again every other window. What is refuted is the reading, not a regime:
                # two earlier regimes of the same clean conditions read alike, and a demo run
                # refuted the return to one and took the same move to the other 40 steps on;
                # an interferer's real end reads nearer the earlier regime than the refuted
                # reading, and is followed.
                self._refuted.append((judged.src, judged.slowdown))
            if bounds is not None:
                # The next trusted window checks the model's promise against the steps: how
                # its step time under the new plan compares with the old plan's now.
                self._seen = (bounds, cur, w.median_step_ms)
                self.pending = MoveRecord(
                    step=w.step + 1,
                    src=key,
                    dst=bounds,
                    reason=reason,
                    before_ms=w.median_step_ms,
                    before_noise=w.step_noise,
                    model_before_ms=cur,
                    predicted_ms=proposed,
                    slowdown=slow,
                    regime=regime,
                    model=model,
                    returns_to=returns_to,
                )
            return Decision(
                step=w.step + 1,
                mode=self.mode_used,
                slowdown=slow,
                current_ms=cur,
                proposed_ms=proposed,
                pause_ms=pause,
                moved_bytes=nbytes,
                repartition=bounds is not None,
                reason=reason,
                bounds=bounds,
            )

        # A plan measured clearly faster under these conditions: go back to it.
        # A move measured slower across a change of conditions says nothing about the move:
        # the plan it left is measured again under the new conditions (an A/B of the two
        # plans in one regime), so neither an onset nor timers that fake one can leave the
        # run on a worse plan. Not where the model, on the new conditions' readings, prices
        # that plan slower than this one with every device one standard error in its favour
        # (``_priced_slower``): the readings then say what the A/B would find. In the
        # controller simulator a 4-stage gpt whose last device took two training jobs as it
        # moved went back to the even split to measure it there (a split the model priced
        # slower that way) and ran it at 149 ms a step; the model's own move ran at 111 ms (seeds
        # 7 and 11, 300 scenarios each: four runs 0.7-3.4% faster, no other run changed).
        last = judged
        if (
            last is not None
            and last.verdict == "conditions changed"
            and last.after_ms is not None
            and last.after_ms > last.before_ms * (1 + cfg.min_gain)
            and last.dst == key
            and self.memory.measured(last.src, regime, last=recent) is None
            and not self._priced_slower(w, costs, last.src, judged)
        ):
            return verdict(
                f"{split_label(last.src)} measured again: the move from it measured slower "
                "across a change of conditions",
                bounds=last.src,
            )
        # Devices that read as under an earlier regime, one window before the change is
        # confirmed (an interferer's end followed in one window, as its onset is: the model
        # alone cannot follow it so soon, for the device that sped up is as uncertain as its
        # unconfirmed change and the move puts layers on it). Compared with this window's
        # own steps: the regime's median of this plan is of the conditions that seem to have
        # ended. A reading that only looked like the earlier conditions has the move judged
        # on the next window. The same on the window that confirms the change as conditions
        # not seen before (``CostEstimates.returning``), and where several earlier regimes
        # read alike, the plan measured fastest under any of them. Not where the steps
        # refute the reading: this plan measured under one of those regimes, and now beyond
        # a change of conditions from it. The regimes listed are those the readings cannot
        # tell apart, so the steps refute them all (a launch-bound 8-stage run read an
        # onset as a return to the clean conditions, twice, for its thresholds are wide;
        # its steps, 1.4-1.6x what the plan ran under them, said otherwise, and each
        # return cost ten steps at 1.5x). Nor where the model, on these same readings,
        # prices the earlier plan slower than this one even with every device one standard
        # error in its favour: the readings then say the devices still run unlike then. A
        # stage's reading depends on what it holds: the demo's head, left alone on a device
        # slowed 5x, read 3.85x and then 2.86x, nearer the clean 1.3x than the 9.1x its
        # five layers had read, and half the runs went back to 5 | 5 under the interferer
        # (the model priced it 2.6x slower than 9 | 1). On the real end it read 1.1-1.7x,
        # and the model priced 5 | 5 faster. In the window that judges a move, the ranks
        # whose layers it changed are priced as they read: their change, not yet confirmed,
        # counts as uncertain as its size, and the move itself may have made it (the head
        # read 2.6x and 4.1x there, 1.0-1.2 of a log ratio in its favour priced it near
        # clean, and a third of the demo runs went back under the interferer).
        now = w.median_step_ms
        returning = self.est.returning
        if any(self._steps_agree(w, key, then) is False for then in returning):
            returning = ()
        backs = [
            (b, then)
            for then in returning
            if not self._refutes(key, then)
            and (b := self._faster(w, key, now, then, pause, recent, 1)) is not None
            and not self._priced_slower(w, costs, b[0], judged)
        ]
        if backs:
            back, then = min(backs, key=lambda x: x[0][1])
            return verdict(
                f"devices read as they ran before: measured {back[1]:.2f} ms/step then "
                f"against {now:.2f} now",
                proposed=cur * back[1] / now,
                bounds=back[0],
                returns_to=then,
            )
        best = self._faster(w, key, here, regime, pause, recent)
        if best is not None:
            return verdict(
                f"measured {best[1]:.2f} ms/step under these conditions against {here:.2f} now",
                proposed=cur * best[1] / here,
                bounds=best[0],
            )
        # The step time is the one measurement timers cannot fool (on a launch-bound GPU a
        # stage's timers swing 2x while its steps do not). The model is acted on only as
        # far as it has tracked the measured steps: not before it has predicted one window
        # of the plan (in the run's first trusted window, not unless it reproduces the step
        # that window measured), and not when its estimates moved and the steps did not
        # follow (beyond ``_tolerance``). A proposed gain clears ``required_gain``: the
        # tracking error as a floor on it froze adaptation wherever step noise swelled it.
        tolerance = np.log1p(self._tolerance(w))
        if prev is None:
            # Nothing predicted yet to track. Waiting a window for it cost every run that
            # starts from a poor split five more steps there: in the controller simulator
            # (from the even split, 100 scenarios a seed) acting now took the mean to the
            # oracle from 1.031 / 1.033 / 1.032 / 1.029 to 1.028 / 1.029 / 1.028 / 1.026
            # (seeds 7 / 11 / 23 / 101). Timers that swing on their own do not reproduce
            # the step.
            if abs(np.log(cur / max(w.median_step_ms, 1e-9))) > tolerance:
                return verdict("the model has not yet predicted a window of this plan")
            model = steps = 1.0
        elif prev[0] != key:
            return verdict("the model has not yet predicted a window of this plan")
        else:
            model, steps = cur / max(prev[1], 1e-9), w.median_step_ms / max(prev[2], 1e-9)
            self._misses = [*self._misses, float(np.log(model / steps))][-_MISSES:]
        miss = float(np.log(model / steps))
        # Blocked only where the estimates outran the steps (moved the other way, or further):
        # where the steps moved further than the estimates (an onset's stall outside the
        # timed layers), the model is conservative, and acting on it is safe.
        lm, ls = float(np.log(model)), float(np.log(steps))
        if abs(miss) > tolerance and (lm * ls < 0 or abs(lm) > abs(ls)):
            return verdict(
                f"estimates moved {model - 1:+.0%} but steps {steps - 1:+.0%}: not acted on"
            )
        res = plan_partition(costs, num_stages=w.num_stages, memory_bytes=self._memory(w), **kw)
        on, split = w.ranks, tuple((int(a), int(b)) for a, b in res.bounds)
        bounds = _wide(split, w.ranks, len(key))
        step_ms, what = res.step_ms, ""
        if self.config.elastic and w.dp == 1:
            # The same rule over other numbers of stages: one device fewer, or an idle one
            # back (priced at its probed slowdown).
            for ranks in self._rank_sets(w):
                alt_ms, alt = self._plan_on(w, ranks, **kw)
                if alt is not None and alt_ms < step_ms:
                    step_ms, bounds, on, split = alt_ms, _wide(alt, ranks, len(key)), ranks, alt
                    what = f" on {len(ranks)} of {len(key)} devices (ranks {list(ranks)})"
        if on == w.ranks:
            split, step_ms, new = self._under_load(w, costs, split, step_ms, **kw)
            bounds = _wide(split, w.ranks, len(key))
        else:
            new = self._costs_on(w, on)
        if bounds == key:
            return verdict("current plan is best")
        res = dataclasses.replace(res, step_ms=step_ms)
        gain = cur - res.step_ms
        need = self.required_gain()
        if gain < need * cur:
            return verdict(f"gain {gain / cur:.1%} below {need:.1%}", res.step_ms)
        # A plan already measured under these conditions is priced by its measurement, not
        # the model: one measured no faster than this plan is not taken for the model's
        # promise (vgg16 256 under gemm on 2 x H200 went back and forth between two splits,
        # the model promising 6% each time, the steps measuring 3.7% slower). Only for
        # plans on the devices that hold layers now: a regime is their conditions, and an
        # idle device's (probed) may have changed since a plan using it was measured.
        known = self.memory.measured(bounds, regime, last=recent) if on == w.ranks else None
        if known is not None and known >= here:
            return verdict(
                f"{split_label(bounds)} measured {known:.2f} ms/step under these conditions against "
                f"{here:.2f} now: the model's {gain / cur:.1%} not taken",
                res.step_ms,
            )
        # The same for a move from this plan to that one judged slower, where this plan
        # runs as it did then (by the verdict's own rule: within ``min_gain`` and the two
        # windows' noise), whatever regime the timers name now: timers that swing on their
        # own name a new regime every few windows, and a launch-bound 8-stage run took the
        # same 29% promise to a 14% slower split three times, 50 steps apart, its steps at
        # 61.6 ms each time.
        for src, dst, before, after, noise in self._slower:
            if (
                src == key
                and dst == bounds
                and self._as_then(w.median_step_ms, before, noise, w.step_noise)
            ):
                return verdict(
                    f"{split_label(bounds)} measured {after:.2f} ms/step against this plan's "
                    f"{before:.2f} when it ran as now ({w.median_step_ms:.2f}): the model's "
                    f"{gain / cur:.1%} not taken",
                    res.step_ms,
                )
        # A gain the estimates' own noise could make is no gain: on a launch-bound GPU a
        # stage's timers swing 0.4-1.3x for a window or two while its steps do not, and the
        # planner picks exactly the split that favours the devices whose timers read low.
        # The move must still gain with every device one standard error against it, except
        # the slowest stage where the steps moved as the estimates did, beyond what they
        # swing against the model on their own (``_swing``: a measurement the timers cannot
        # fool vouches for what they read, and an onset is acted on at once). Not beyond
        # ``jump`` alone: in the controller simulator a launch-bound 4-stage run's steps
        # swung 35.7 -> 42.0 ms between two windows of unchanged conditions, as far as twice
        # the model's tracking error then, and vouched for timers that read a 40% gain; the
        # move measured 22% slower (seed 11: runs more than 2% slower than static 4 -> 2
        # measured, 5 -> 4 adaptive; seed 7's p95 to the oracle 1.074 -> 1.062; three
        # tracking errors made another run 6% slower). Not beyond the window's own
        # spread either: an onset inside the window widens it, and a replayed resnet50 run
        # on 2 x H100 then sat out a real onset (+31% steps) on a split 42% slower.
        vouched = lm * ls > 0 and abs(ls) > np.log1p(self._swing())
        sure = self._gain_beyond_noise(w, costs, new, on, split, vouched=vouched, **kw)
        if sure <= 0:
            return verdict(
                f"gain {gain / cur:.1%} within the estimates' noise ({sure:+.1%} with every "
                "device one standard error against it)",
                res.step_ms,
            )
        if gain * cfg.horizon_steps <= pause:
            return verdict(
                f"gain {gain:.2f} ms/step does not pay {pause:.1f} ms within "
                f"{cfg.horizon_steps} steps",
                res.step_ms,
            )
        return verdict(
            f"predicted {cur:.2f} -> {res.step_ms:.2f} ms/step{what}",
            res.step_ms,
            bounds,
            model=True,
        )

    def _priced_slower(
        self, w: Window, costs: CostModel, key: Bounds, judged: MoveRecord | None
    ) -> bool:
        """Whether the model, on this window's readings, prices plan ``key`` (one range per
        rank) slower than ``w``'s plan even with every device's estimate one standard error
        in its favour (``_gain_beyond_noise`` the other way round); False where ``key``
        holds other ranks. ``judged``: the move this window judges, if any: the ranks whose
        layers it changed are taken as they read (see ``_decide``)."""
        if {r for r, (a, b) in enumerate(key) if b > a} != set(w.ranks):
            return False
        sd = self.est.uncertainty()
        if judged is not None and len(judged.src) == len(judged.dst):
            for r, (x, y) in enumerate(zip(judged.src, judged.dst, strict=True)):
                if x != y:
                    sd[r] = 0.0
        kw = {"schedule": w.schedule, "microbatches": w.microbatches}
        there = tuple(key[r] for r in w.ranks)
        return (
            self._gain_beyond_noise(w, costs, costs, w.ranks, there, vouched=False, sd=-sd, **kw)
            < 0
        )

    def _refutes(self, key: Bounds, then: int) -> bool:
        """Whether a refuted return from ``key`` bars going back to regime ``then`` now: the
        devices read nearer the readings that suggested it (on the rank furthest from them)
        than regime ``then``'s own."""
        earlier = self.est.regime_load(then)
        if earlier is None:
            return False
        now = np.log(np.maximum(self.est.load, 1e-9))

        def distance(loads: Any) -> float:  # on the rank that differs most, as a log ratio
            return float(np.max(np.abs(now - np.log(np.maximum(loads, 1e-9)))))

        far = distance(earlier)
        return any(b == key and distance(s) < far for b, s in self._refuted)

    def _file_slower(self, move: MoveRecord, after_ms: float, after_noise: float) -> None:
        """File a move judged slower, or no better, once the steps vouch that conditions
        held: the plan it left, measured again after the move back, runs as it did before
        it (a move whose after window caught an onset the timers had not yet confirmed
        reads slower, and its plan measures slower again on the way back).

        No better counts too, once the run went back: where steps are noisy, a move 9%
        slower is within the two windows' noise ("no better"), the way back is taken on
        the memory of the plan left, and the window that measured the move falls under no
        regime while the timers' swing is unconfirmed, so nothing else remembers it. A
        2-stage gpt run (controller simulator, seed 11) took the same 41% promise from
        7|7 to 12|2 and came back four times, 50 steps apart: 1.106x the oracle, 1.063x
        static."""
        held, self._slower_held = self._slower_held, None
        if (
            held is not None
            and (move.src, move.dst) == (held[1], held[0])  # the way back
            and self._as_then(after_ms, held[2], held[4], after_noise)
        ):
            self._slower = [*self._slower, held][-_SLOWER:]
        if move.verdict in ("slower", "no better"):
            self._slower_held = (move.src, move.dst, move.before_ms, after_ms, move.before_noise)

    def _moved_from(self, w: Window, ms: float) -> bool:
        """Whether ``w``'s median step is beyond a change of conditions from ``ms``
        (``_step_noise_limit``)."""
        return bool(
            abs(np.log(w.median_step_ms / max(ms, 1e-9))) > np.log1p(self._step_noise_limit(w))
        )

    def _level(self, key: Bounds, then: int) -> float | None:
        """Plan ``key``'s median step over regime ``then``'s recent windows (None where it was
        not measured then)."""
        return self.memory.measured(key, then, last=2 * self.config.average_windows)

    def _drift_from_level(self, w: Window) -> int:
        """The direction (+1 slower, -1 faster, 0 neither) in which ``w``'s median step is
        beyond a change of conditions (``_moved_from``) from its plan's level under the
        conditions last named."""
        was = self._level(w.key, self.est.regime)
        if was is None or not self._moved_from(w, was):
            return 0
        return 1 if w.median_step_ms > was else -1

    def _steps_agree(self, w: Window, key: Bounds, then: int) -> bool | None:
        """Whether ``w``'s plan ``key`` runs within a change of conditions of its level under
        regime ``then`` (``_moved_from``, ``_level``); None where it was not measured then."""
        was = self._level(key, then)
        return None if was is None else not self._moved_from(w, was)

    def _faster(
        self,
        w: Window,
        key: Bounds,
        here: float,
        regime: int,
        pause: float,
        recent: int,
        here_windows: int | None = None,
    ) -> tuple[Bounds, float] | None:
        """The plan measured fastest in ``regime`` (among its ``recent`` windows) and its step
        time, if it beats ``here``, this plan's step time, beyond the two plans' noise
        (``PlanMemory.faster``; ``here_windows``: this plan's windows, if not the memory's)
        and pays the pause back within the horizon. No ``min_gain`` here: that floor is for
        the model's promises; two measurements of one regime need only beat their own noise
        (a split measured 3.6% slower than the one it left, beyond 0.5% of noise, was
        otherwise kept for 55 steps: vgg16 256 under ``gemm`` on 2 x H200)."""
        best = self.memory.faster(
            key,
            here,
            regime,
            last=recent,
            window_noise=w.step_noise,
            here_windows=here_windows,
            allow=self._may_hold(w),
        )
        if best is None or (here - best[1]) * self.config.horizon_steps <= pause:
            return None
        return best

    def _may_hold(self, w: Window) -> Callable[[Bounds], bool]:
        """Which measured plans the memory may move to: any (but a released device's) with
        ``elastic``; else those on the devices that hold layers now. Without ``elastic`` the
        stage count is the run's: a plan measured with a device idle (a release, since
        reclaimed) is not one to go back to for its speed."""

        def holding(b: Bounds) -> set[int]:  # a plan's key has one range per rank
            return {r for r, (a, c) in enumerate(b) if c > a}

        if self.config.elastic:
            return lambda b: not holding(b) & self.excluded
        active = set(w.ranks)
        return lambda b: holding(b) == active

    def required_gain(self) -> float:
        """The relative gain a model-proposed move needs: ``min_gain``, or what the last
        moves fell short of their promise by on average (in the current regime), whichever
        is more: where timers mislead the model (a launch-bound GPU), its promises are
        measured to be empty and it stops moving layers."""
        short = float(np.expm1(np.mean(self._shortfalls))) if self._shortfalls else 0.0
        return max(self.config.min_gain, short)

    @property
    def _state_bytes(self) -> np.ndarray:
        return self.base.state_bytes

    def _moved(self, w: Window, bounds: Bounds) -> int:
        """Bytes that change owner going from ``w``'s plan to ``bounds`` (one range per
        stage of ``w``, or one per rank)."""
        if w.idle or len(bounds) != len(w.bounds):
            key = w.key
            return moved_bytes(self._state_bytes, key, bounds, tuple(range(len(key))))
        return moved_bytes(self._state_bytes, w.bounds, bounds, w.ranks)

    def split_on(self, w: Window, *, ranks: tuple[int, ...]) -> Bounds | None:
        """The best split of the model over ``ranks`` under the current estimates, one range
        per rank (a release or reclaim request's plan); None if no split fits."""
        if not self.est.calibrated:
            return None
        kw = {"schedule": w.schedule, "microbatches": w.microbatches}
        _, bounds = self._plan_on(w, ranks, **kw)
        world = len(w.ranks) + len(w.idle)
        return None if bounds is None else _wide(bounds, ranks, world)

    def light_probes(self, key: Bounds) -> dict[int, int]:
        """``{rank: layer}``: the ranks of the plan ``key`` (one range per rank) that hold
        too little work for their timers to read their device, each with the layer it times
        on sampled steps (``CostEstimates.light_probes`` says why and when). The adaptation
        loop hands each engine its own entry after every window and every move; every rank's
        policy holds the same estimates, so every rank reads the same plan of probes and none
        needs to be told another's (its probe comes back with the window's gather). Released
        ranks never probe.

        Only a light rank whose device reads slowed probes (its slowdown, from its stage
        before it turned light or from its probe since, beyond ``jump``): the probe is
        there to see that device's interference end, the case a light stage cannot see (the
        controller left the slowed device a light share). A probe costs a step its time on
        the first stage (it cannot hide in the pipeline's fill there), and one microbatch of
        one layer reads a device more noisily than a stage's window: in the controller
        simulator, light ranks probing whatever their device read made the runs with sound
        timers 0.1% slower on average (p95 1.056 -> 1.064, seed 11), probing only slowed
        devices 0.03% (p95 1.057), while on scenarios whose light stages cannot see their
        device (``--blind``, seed 0) it keeps the probes' gain (mean / p95 ratio to the
        oracle 1.044 / 1.138 without probes, 1.035 / 1.082 with)."""
        if not self.probe_light:
            return {}
        est = self.est
        return {
            r: i
            for r, i in est.light_probes(key).items()
            if r not in self.excluded and est.slow[r] > 1.0 + est.jump
        }

    def _rank_sets(self, w: Window) -> list[tuple[int, ...]]:
        """Sets of ranks one device away from ``w``'s: each active rank left out (two or
        more active), each idle rank whose device was probed brought back."""
        active = list(w.ranks)
        out = []
        if len(active) > 1:
            out += [tuple(r for r in active if r != x) for x in active]
        probed = set(w.probes or {}) - self.excluded
        out += [tuple(sorted([*active, x])) for x in w.idle if x in probed]
        return out

    def _plan_on(
        self, w: Window, ranks: tuple[int, ...], *, schedule: str, microbatches: int
    ) -> tuple[float, Bounds | None]:
        """The best split over ``ranks`` (in rank order) and its predicted step time (costs
        from ``_costs_on``)."""
        costs = self._costs_on(w, ranks)
        memory = None
        if w.memory_bytes is not None and np.isfinite(w.memory_bytes).any():
            held = dict(zip(w.ranks, self._memory(w) or [], strict=False))
            memory = [
                held.get(r, float(w.memory_bytes[r]) if np.isfinite(w.memory_bytes[r]) else np.inf)
                for r in ranks
            ]
        if len(ranks) > w.num_layers:
            return np.inf, None
        try:
            res = plan_partition(
                costs,
                num_stages=len(ranks),
                memory_bytes=memory,
                schedule=schedule,
                microbatches=microbatches,
            )
        except PlanError:
            return np.inf, None  # the model does not fit these devices' memory
        if not np.isfinite(res.step_ms):
            return np.inf, None
        return float(res.step_ms), tuple((int(a), int(b)) for a, b in res.bounds)

    def _costs_on(self, w: Window, ranks: tuple[int, ...]) -> CostModel:
        """The cost model of a split over ``ranks`` (one row per rank, in rank order): layers
        on a rank that holds them cost what they measure there, elsewhere their clean cost
        times the rank's slowdown (an idle rank's from its probe)."""
        fwd, bwd = self.est.costs(w.bounds, w.ranks, predicted=self._predicted(w))
        for r in ranks:
            if r not in w.ranks:
                fwd[r], bwd[r] = (
                    self.est.clean_f * self.est.slow[r],
                    self.est.clean_b * self.est.slow[r],
                )
        return dataclasses.replace(
            self.base.for_devices(len(ranks)), **self.est.stage_model(fwd, bwd, ranks)
        )

    def _under_load(
        self,
        w: Window,
        costs: CostModel,
        split: Bounds,
        step_ms: float,
        *,
        schedule: str,
        microbatches: int,
    ) -> tuple[Bounds, float, CostModel]:
        """The best split of ``w``'s ranks with every slowed device priced at the load the
        split gives it (``CostEstimates.load_factor``), its predicted step time, and the
        cost rows that price it; ``split`` (the plan on ``costs``) as it is while no rank
        has shown a load coefficient below 1.

        A device's layers are priced at what they measure at its load now; a split that
        fills a device whose slowdown grows with its load runs them slower. The exact
        planner cannot see a cost that depends on the split it picks, so it plans again on
        the costs of its last pick's loads, a few times, and the pick priced fastest wins.
        The current plan's loads price it as it is (a factor of 1).
        """
        if np.all(self.est.load_c >= 1.0):
            return split, step_ms, costs
        kw = {"schedule": schedule, "microbatches": microbatches}
        u_now = self._loads(w, costs, **kw)
        rows = self._loaded(w, costs, split, u_now=u_now, **kw)
        best = (predicted_step_ms(rows, split, **kw), split, rows)
        pick = split
        for _ in range(3):
            try:
                res = plan_partition(
                    rows, num_stages=w.num_stages, memory_bytes=self._memory(w), **kw
                )
            except PlanError:
                break
            nxt = tuple((int(a), int(b)) for a, b in res.bounds)
            if nxt == pick:
                break
            pick = nxt
            rows = self._loaded(w, costs, pick, u_now=u_now, **kw)
            ms = predicted_step_ms(rows, pick, **kw)
            if ms < best[0]:
                best = (ms, pick, rows)
        return best[1], best[0], best[2]

    def _loads(
        self, w: Window, costs: CostModel, *, schedule: str, microbatches: int
    ) -> np.ndarray:
        """``[R]`` each rank's busy fraction under ``w``'s plan as ``costs`` model it (0 for
        a rank that holds no stage)."""
        out = np.zeros(len(self.est.slow))
        out[list(w.ranks)] = _busy(costs, w.bounds, schedule=schedule, microbatches=microbatches)
        return out

    def _loaded(
        self,
        w: Window,
        costs: CostModel,
        bounds: Bounds,
        *,
        schedule: str,
        microbatches: int,
        u_now: np.ndarray | None = None,
    ) -> CostModel:
        """``costs`` (rows in ``w``'s stage order, priced at the loads ``u_now`` of ``w``'s
        plan, ``_loads`` where not given) with each row priced at the load its device would
        carry under ``bounds``."""
        kw = {"schedule": schedule, "microbatches": microbatches}
        ranks = list(w.ranks)
        if u_now is None:
            u_now = self._loads(w, costs, **kw)
        rows = costs
        for _ in range(2):  # the loads of ``bounds`` under the costs at those loads
            u_new = u_now.copy()
            u_new[ranks] = _busy(rows, bounds, **kw)
            rows = scaled_rows(costs, self.est.load_factor(u_now, u_new)[ranks])
        return rows

    def _gain_beyond_noise(
        self,
        w: Window,
        now: CostModel,
        new: CostModel,
        ranks: tuple[int, ...],
        bounds: Bounds,
        *,
        vouched: bool,
        schedule: str,
        microbatches: int,
        sd: np.ndarray | None = None,
    ) -> float:
        """The relative gain of ``bounds`` over ``ranks`` (cost rows ``new``, in rank order)
        against ``w``'s plan (cost rows ``now``, in stage order) with every device's estimate
        one standard error against the move (``CostEstimates.uncertainty``): its costs
        raised under the new plan, lowered under the current one. ``vouched``: the slowest
        stage's estimate is taken as it is. ``sd``: per rank, the errors to price with
        instead (negated, they price in the move's favour)."""
        sd = self.est.uncertainty() if sd is None else sd.copy()
        kw = {"schedule": schedule, "microbatches": microbatches}
        if vouched:
            sc = stage_costs(now, w.bounds, **kw)
            sd[w.ranks[int(np.argmax(np.add(sc.fwd_ms, sc.bwd_ms)))]] = 0.0
        low = predicted_step_ms(scaled_rows(now, np.exp(-sd[list(w.ranks)])), w.bounds, **kw)
        high = predicted_step_ms(scaled_rows(new, np.exp(sd[list(ranks)])), bounds, **kw)
        return 1.0 - high / max(low, 1e-9)

    def _memory(self, w: Window) -> list[float] | None:
        return stage_memory(self.base, w)

    def cost_model(self, w: Window) -> CostModel:
        """The planner's cost model now: rows in stage order of ``w``'s plan."""
        return planner_costs(self.base, self.est, w, predicted=self._predicted(w))

    def _predicted(self, w: Window) -> tuple[np.ndarray, np.ndarray] | None:
        """Per-rank, per-layer predicted slowdowns from each device's telemetry: one
        prediction per window (the current plan and every other set of ranks are priced
        from it, and the estimates do not change while a window is decided)."""
        if self.mode_used != "adaptive" or not w.telemetry:
            return None
        if self._prediction is None or self._prediction[0] is not w:
            t0 = time.perf_counter()
            got = predicted_slowdowns(
                self.predictor, self.prepared, self.est.clean_f, self.est.clean_b, w.telemetry
            )
            self.predict_ms = (time.perf_counter() - t0) * 1e3
            self._prediction = (w, got)
        return self._prediction[1]

    # ---- after a move ----------------------------------------------------------------------
    def applied(self, *, step: int, pause_ms: float, moved_bytes: int) -> None:
        self.settle = self.config.settle_windows
        self._held = None
        p = float(pause_ms)
        self.pause_ms = p if self.pause_ms is None else 0.5 * (self.pause_ms + p)
        move, self.pending = self.pending, None
        if move is not None:
            move.step, move.pause_ms, move.moved_bytes = step, p, int(moved_bytes)
            self.last = move

    # ---- persistence ---------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "estimates": self.est.state(),
            "memory": self.memory.state(),
            "pause_ms": self.pause_ms,
            "misses": self._misses,
            "shortfalls": self._shortfalls,
            "refuted": [[[list(r) for r in b], list(s)] for b, s in self._refuted],
            "slower": [_pair_json(p) for p in self._slower],
            "slower_held": None if self._slower_held is None else _pair_json(self._slower_held),
            "pending": None if self.pending is None else self.pending.to_dict(),
            "last": None if self.last is None else self.last.to_dict(),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.est.load_state(state.get("estimates", {}))
        self.memory.load_state(state.get("memory", []))
        self.pause_ms = state.get("pause_ms")
        self._misses = [float(x) for x in state.get("misses", [])]
        self._shortfalls = [float(x) for x in state.get("shortfalls", [])]
        self._slower = [_pair_from(p) for p in state.get("slower", [])]
        held = state.get("slower_held")
        self._slower_held = None if held is None else _pair_from(held)
        self._refuted = [
            (as_bounds(b), tuple(float(x) for x in s))
            for b, s in state.get("refuted", [])
            if isinstance(s, list)  # a state from before refutations kept their readings
        ]
        self.pending = MoveRecord.from_dict(state["pending"]) if state.get("pending") else None
        self.last = MoveRecord.from_dict(state["last"]) if state.get("last") else None


def _busy(costs: CostModel, bounds: Bounds, *, schedule: str, microbatches: int) -> np.ndarray:
    """Per stage of ``bounds``, the share of the modelled step it computes (its busy
    fraction, what a slowed device's slowdown depends on)."""
    sc = stage_costs(costs, bounds, schedule=schedule, microbatches=microbatches)
    step = _step_of(sc, schedule=schedule, microbatches=microbatches)
    return microbatches * np.add(sc.fwd_ms, sc.bwd_ms) / max(step, 1e-9)


_Pair = tuple[Bounds, Bounds, float, float, float]  # see ``Controller._slower``


def _pair_json(p: _Pair) -> list:
    return [[list(r) for r in p[0]], [list(r) for r in p[1]], *p[2:]]


def _pair_from(v: list) -> _Pair:
    a, b, before, after, noise = v
    return (as_bounds(a), as_bounds(b), float(before), float(after), float(noise))


def scaled_rows(costs: CostModel, factor: np.ndarray) -> CostModel:
    """``costs`` with device row ``d``'s layer and stage costs times ``factor[d]``."""
    return dataclasses.replace(
        costs,
        fwd_ms=costs.fwd_ms * factor[:, None],
        bwd_ms=costs.bwd_ms * factor[:, None],
        stage_fwd_ms=costs.stage_fwd_ms * factor,
        stage_bwd_ms=costs.stage_bwd_ms * factor,
    )


def _wide(bounds: Bounds, ranks: tuple[int, ...], world: int) -> Bounds:
    """``bounds`` of stages on ``ranks`` (in rank order) as one range per rank of a
    ``world``; unchanged when every rank holds a stage."""
    if len(bounds) == world:
        return bounds
    by_rank = dict(zip(ranks, bounds, strict=True))
    out, at = [], 0
    for r in range(world):
        a, b = by_rank.get(r, (at, at))
        out.append((a, b))
        at = b
    return tuple(out)


class SweepPolicy:
    """Holds every split in turn for ``sweep_windows`` windows (benchmarks: the oracle).

    Two stages visit every split; more visit the ``sweep_plans`` best under the per-layer
    costs measured so far, re-ranked at the start of every pass (so a pass made under
    interference visits the splits that interference favours). Every pass ends on the split
    it started from: the launch's first split is then measured again once the launch has
    warmed up, as every other split is (a 4-stage gpt sweep left its first split after one
    window past warm-up, and read it 191 ms a step where its static launch ran 115). So a
    pass is ``n`` visits (every split, or ``sweep_plans``, the last one the split in force),
    and the first pass one more: the launch's first split, before it.
    """

    mode_used = "sweep"

    def __init__(self, *, base: CostModel, config: AdaptConfig, num_ranks: int) -> None:
        self.config = config
        self.base = base
        self.est = CostEstimates(
            prior_fwd=base.fwd_ms[0],
            prior_bwd=base.bwd_ms[0],
            classes=layer_classes(base),
            num_ranks=num_ranks,
            window=config.average_windows,
            jump=config.jump,
        )
        self.queue: list[Bounds] = []
        self.held = 0  # windows under the current plan
        self.passes = 0

    def describe(self) -> str:
        return (
            f"sweep: every split held for {self.config.sweep_windows} windows in turn "
            "(a benchmark of every static plan in one launch)"
        )

    def _candidates(self, w: Window) -> list[Bounds]:
        n, s = w.num_layers, w.num_stages
        cuts = list(itertools.combinations(range(1, n), s - 1))
        plans = [tuple(itertools.pairwise((0, *c, n))) for c in cuts]
        if s == 2 or len(plans) <= self.config.sweep_plans:
            return plans
        costs = planner_costs(self.base, self.est, w)
        kw = {"schedule": w.schedule, "microbatches": w.microbatches}
        scored = sorted(plans, key=lambda b: predicted_step_ms(costs, b, **kw))
        return scored[: self.config.sweep_plans]

    def observe(self, window: Window) -> Decision | None:
        self.est.update(window)
        self.held += 1
        slow = tuple(float(x) for x in self.est.slow)
        base = dict(
            step=window.step + 1,
            mode="sweep",
            slowdown=slow,
            current_ms=window.median_step_ms,
            proposed_ms=window.median_step_ms,
            pause_ms=0.0,
            moved_bytes=0,
        )
        if self.held < self.config.sweep_windows:
            return Decision(**base, repartition=False, reason="sweep: measuring this split")
        if not self.queue:
            self.passes += 1
            plans = self._candidates(window)
            others = [b for b in plans if b != window.bounds]
            # Every pass as long as the candidates (benchmarks start an interferer with a
            # pass), the split in force last whether or not it ranks among them.
            self.queue = [*others[: len(plans) - 1], window.bounds]
        nxt = self.queue.pop(0)
        self.held = 0
        return Decision(
            **base,
            repartition=True,
            reason=f"sweep pass {self.passes}: next split",
            bounds=nxt,
        )

    def applied(self, *, step: int, pause_ms: float, moved_bytes: int) -> None:
        del step, pause_ms, moved_bytes

    def state(self) -> dict[str, Any]:
        return {"estimates": self.est.state()}

    def load_state(self, state: dict[str, Any]) -> None:
        if state:
            self.est.load_state(state.get("estimates", {}))


def stage_memory(base: CostModel, w: Window) -> list[float] | None:
    """Per stage of ``w``, the bytes it may hold: what it holds now (the planner's own
    estimate of its parameters, gradients, optimizer state and in-flight activations) plus
    what its device has free for it; None where that is unknown (CPU)."""
    if w.memory_bytes is None or not np.isfinite(w.memory_bytes).any():
        return None
    held = stage_costs(
        base.for_devices(w.num_stages),
        w.bounds,
        schedule=w.schedule,
        microbatches=w.microbatches,
    ).mem_bytes
    free = [float(w.memory_bytes[r]) for r in w.ranks]
    return [h + f if np.isfinite(f) else np.inf for h, f in zip(held, free, strict=True)]
