"""Monitor and controller: from measured stage times (and telemetry) to a repartition decision.

Pure logic over plain numbers, so it is unit-tested without a process group. Every rank
feeds it the same gathered numbers; the decision is still broadcast from one rank, so ranks
can never disagree about the plan.

The speed model. Clean per-layer costs start from the analytic cost model and are
calibrated once, on the first settled window, by spreading each stage's measured compute
over its layers in proportion to the model (this corrects the model where it is wrong
about whole stages). Afterwards each device gets a *measured slowdown*: its stage's EWMA
compute time over the clean cost of the layers it holds. Without a predictor every layer on
that device is assumed slowed by that factor (``measured`` mode). With a predictor, the
device's telemetry gives a per-layer slowdown for every layer, including those it does not
hold, and the measured slowdown rescales it so it agrees with what the stage sees
(``adaptive`` mode).

One plan's stage times cannot say how a stage's time splits among its layers; the model's
FLOP shares decide that, and they are wrong where layers run at different efficiency
(VGG's first convolutions, memory-bound at full resolution, take far longer per FLOP than
its later ones). Every move in clean conditions measures a second plan: the clean costs are
refitted from the stage times on both sides of it (``refit``), when the work of all stages
adds up the same on both sides (no device changed speed across the move).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynpipe.errors import UserError
from dynpipe.planner.costs import CostModel
from dynpipe.planner.diff import diff
from dynpipe.planner.dp import plan_partition
from dynpipe.planner.evaluate import stage_costs
from dynpipe.planner.plan import Plan
from dynpipe.planner.simulate import step_times

__all__ = [
    "ADAPT_MODES",
    "AdaptConfig",
    "Controller",
    "Decision",
    "Monitor",
    "credible",
    "fit_layer_costs",
    "refit_segments",
]

ADAPT_MODES = ("static", "measured", "adaptive", "restart")
_RECORD = 3  # judged moves the track record remembers
_TRUST_FADE = 0.9  # per quiet window: doubt halves in about 7 windows
_REFUTED = 4  # moves measured slower that are remembered
# A refit across a move needs the work measured on both sides to add up to within this: a
# larger difference means some device changed speed across the move.
_REFIT_TOL = 0.1


@dataclass(frozen=True)
class AdaptConfig:
    """When and how the runtime repartitions.

    mode: ``static`` never; ``measured`` from stage times alone; ``adaptive`` adds the
        predictor (falls back to measured without one); ``restart`` takes the same decisions
        but applies them by checkpoint, exit and relaunch.
    monitor_every: steps per monitoring window (one all-gather per window).
    settle_windows: windows ignored at start and after each repartition (allocator warm-up,
        first-touch effects) before times are trusted.
    calibrate_windows: windows whose steps give the clean per-stage costs at the start.
    ewma: weight of the newest window; a window that differs from the average by more than
        ``jump`` replaces it outright, so an onset is seen in one window, not several.
    min_gain: smallest relative step-time gain worth a repartition (hysteresis: a plan is
        only replaced by a clearly better one, so noise cannot make plans flap). A gain
        under ``confirm_below`` must also have been wanted by one of the two windows before
        it; a larger one (a real onset) is taken at once.
    horizon_steps: steps over which a gain must pay back the migration pause.
    cooldown_steps: steps after a repartition before another may be decided.
    drift_tol: a stage measured faster than its clean cost by more than this, in two windows
        running, lowers that clean cost: interference only slows a device, so a device
        faster than "clean" shows the clean costs were taken during a start-up transient.
    noise_z: a measured slowdown counts only beyond this many standard errors of the
        window's median stage time (the part within them is taken as noise).
    """

    mode: str = "adaptive"
    monitor_every: int = 5
    settle_windows: int = 1
    calibrate_windows: int = 3
    ewma: float = 0.5
    jump: float = 0.25
    min_gain: float = 0.05
    confirm_below: float = 0.2
    horizon_steps: int = 100
    cooldown_steps: int = 10
    drift_tol: float = 0.1
    noise_z: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in ADAPT_MODES:
            raise UserError(f"unknown --adapt {self.mode!r}; use one of {', '.join(ADAPT_MODES)}")
        if self.monitor_every < 1:
            raise UserError(f"--monitor-every must be >= 1, got {self.monitor_every}")
        if self.calibrate_windows < 1:
            raise UserError(f"calibrate_windows must be >= 1, got {self.calibrate_windows}")
        if not 0 < self.ewma <= 1:
            raise UserError(f"ewma weight must be in (0, 1], got {self.ewma}")


def _layer_classes(costs: CostModel) -> np.ndarray:
    """Class id per layer: layers with the same modelled costs and state are the same layer
    (a transformer's blocks, VGG's repeated convolutions) and must get one calibrated cost."""
    keys = [
        (round(float(f), 9), round(float(b), 9), int(n))
        for f, b, n in zip(costs.fwd_ms[0], costs.bwd_ms[0], costs.state_bytes, strict=True)
    ]
    ids = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    return np.array([ids[k] for k in keys])


def _key(bounds: Any) -> list[list[int]]:
    """A plan's ``(start, stop)`` bounds as plain lists: how moves are remembered."""
    return [list(b) for b in bounds]


def credible(slowdown: float, margin: float) -> float:
    """The part of a measured slowdown beyond ``margin`` (relative) of 1: a stage time that
    moved less than its noise is taken as unchanged, one that moved more counts only by the
    excess. Planning with these, a split changes for what the measurements can tell apart."""
    dev = slowdown - 1.0
    return 1.0 + math.copysign(max(0.0, abs(dev) - margin), dev)


def fit_layer_costs(
    modelled: np.ndarray,
    classes: np.ndarray,
    bounds: list[tuple[int, int]],
    stage_ms: np.ndarray,
    *,
    ridge: float = 1e-4,
) -> np.ndarray:
    """Per-layer costs that add up to each stage's measured time, one scale per layer class.

    The modelled costs (FLOP-based) are right about how identical layers compare and only
    roughly right about different ones: a vocabulary projection's FLOPs overstate its time
    next to a block of many small kernels. Scaling every layer of a stage by that stage's
    error (the obvious fix) gives identical blocks different costs on either side of a
    boundary, and the planner then "gains" by moving them. Instead, one factor per class of
    identical layers is fitted to all stages at once (least squares, pulled weakly towards
    the common factor), so a stage's error lands on the layers that make it differ.
    """
    modelled = np.asarray(modelled, dtype=np.float64)
    n_cls = int(classes.max()) + 1
    unit = np.zeros(n_cls)
    unit[classes] = modelled  # every member of a class has the same modelled cost
    common = float(np.sum(stage_ms)) / max(float(modelled.sum()), 1e-12)
    # Unknowns: each class's factor relative to the common one. Stage rows are relative to
    # the stage's time, so every stage counts alike; the weak pull treats every class
    # alike, so a stage's error is shared by its classes in proportion to their time there
    # (a cheap layer is not made ten times dearer to absorb it).
    rows, rhs = [], []
    for s, (a, b) in enumerate(bounds):
        t = max(float(stage_ms[s]), 1e-12)
        rows.append(np.bincount(classes[a:b], minlength=n_cls) * unit * common / t)
        rhs.append(1.0)
    rows += list(np.sqrt(ridge) * np.eye(n_cls))
    rhs += [np.sqrt(ridge)] * n_cls
    y, *_ = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)
    # A class that alone absorbs a stage's error must not become free or absurdly costly.
    x = common * np.clip(y, 0.1, 10.0)
    return modelled * x[classes]


def refit_segments(
    costs: np.ndarray,
    old_bounds: list[tuple[int, int]],
    old_ms: np.ndarray,
    new_bounds: list[tuple[int, int]],
    new_ms: np.ndarray,
) -> np.ndarray:
    """Per-layer costs that add up to the stage times of two plans of the same layers.

    The cuts of both plans split the layers into segments that move as a whole; each
    segment's cost is fitted (least squares, every stage relative to its own time) and
    spread over its layers in the proportions ``costs`` gives them. A segment's cost stays
    within 0.2-5x of its old value: one noisy stage must not make a layer free.
    """
    costs = np.asarray(costs, dtype=np.float64)
    cuts = sorted({a for a, _ in old_bounds} | {a for a, _ in new_bounds} | {len(costs)})
    segs = list(itertools.pairwise(cuts))
    rows, rhs = [], []
    for bounds, ms in ((old_bounds, old_ms), (new_bounds, new_ms)):
        for (a, b), t in zip(bounds, np.asarray(ms, dtype=np.float64), strict=True):
            t = max(float(t), 1e-12)
            rows.append([float(a <= lo and hi <= b) / t for lo, hi in segs])
            rhs.append(1.0)
    x, *_ = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)
    out = costs.copy()
    for (lo, hi), xk in zip(segs, x, strict=True):
        old = float(costs[lo:hi].sum())
        if old > 0:
            out[lo:hi] *= float(np.clip(xk, 0.2 * old, 5.0 * old)) / old
    return out


class Monitor:
    """EWMA of each stage's forward and backward compute per step, with jump detection."""

    def __init__(self, num_stages: int, *, ewma: float, jump: float) -> None:
        self.ewma, self.jump = ewma, jump
        self.fwd = np.full(num_stages, np.nan)
        self.bwd = np.full(num_stages, np.nan)
        self.windows = 0  # windows seen since the last reset (i.e. under the current plan)

    def reset(self, num_stages: int) -> None:
        self.fwd = np.full(num_stages, np.nan)
        self.bwd = np.full(num_stages, np.nan)
        self.windows = 0

    def update(self, fwd_ms: np.ndarray, bwd_ms: np.ndarray) -> None:
        """Feed one window's per-stage means (ms per step)."""
        self.windows += 1
        for cur, new in ((self.fwd, np.asarray(fwd_ms)), (self.bwd, np.asarray(bwd_ms))):
            for s in range(len(cur)):
                old = cur[s]
                if math.isnan(old) or abs(new[s] / max(old, 1e-9) - 1) > self.jump:
                    cur[s] = new[s]
                else:
                    cur[s] = self.ewma * new[s] + (1 - self.ewma) * old

    @property
    def ready(self) -> bool:
        return not (np.isnan(self.fwd).any() or np.isnan(self.bwd).any())


@dataclass(frozen=True)
class Decision:
    """The controller's verdict for one window (plain data, logged as is)."""

    step: int
    mode: str
    slowdown: tuple[float, ...]
    current_ms: float
    proposed_ms: float
    migration_ms: float
    moved_bytes: int
    repartition: bool
    reason: str
    plan: Plan | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["plan"] = self.plan.to_dict() if self.plan is not None else None
        return d


class Controller:
    """Decides, from monitored stage times, whether a new plan pays back its migration.

    ``costs``: the analytic (or profiled) clean costs per microbatch, one device row.
    ``predictor`` / ``layers``: a loaded predictor and ``prepare_layers`` output, or None.
    """

    def __init__(
        self,
        *,
        costs: CostModel,
        config: AdaptConfig,
        predictor: Any = None,
        prepared_layers: Any = None,
        pause_ms: float | None = None,
    ) -> None:
        self.config = config
        self.base = costs
        self.predictor = predictor
        self.prepared = prepared_layers
        self.mode = config.mode
        if self.mode in ("adaptive", "restart") and predictor is None:
            self.mode_used = "measured"
        else:
            self.mode_used = self.mode
        self.clean_fwd: np.ndarray | None = None  # [L] ms per microbatch, calibrated
        self.clean_bwd: np.ndarray | None = None
        self.last_change_step = -(10**9)
        # Whether each of the last two windows proposed moving: a modest gain is taken when
        # one of them did too, so one noisy window in between does not reset the evidence.
        self._wanted: list[bool] = []
        # Expected pause of a repartition (ms): learned from the ones we make.
        self.pause_ms = pause_ms
        # The controller's track record: achieved / predicted gain of its recent moves, as
        # measured (clipped to [0, 1]). A predicted gain is discounted by it, so a speed
        # model that is wrong on this machine (noise taken for interference, costs that do
        # not follow FLOPs) stops moving layers after a move or two instead of flapping.
        # The discount fades over windows without a move: conditions change.
        self.record: list[float] = []
        self.windows_since_judged = 0
        # Per-stage fwd/bwd step ms of the last window that ran faster than clean, under the
        # current plan (a clean cost is lowered only when two windows running agree).
        self._faster: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        # Moves measured to make steps slower: (from bounds, to bounds, per-device slowdowns
        # when decided). The same move is not proposed again under the same conditions: the
        # measurement outranks the speed model that proposed it. The last move proposed waits
        # in ``_proposed`` for its verdict.
        self.refuted: list[tuple[list, list, list[float]]] = []
        self._proposed: tuple[list, list, list[float]] | None = None
        # After a one-layer move measured slower, the same layers moved the other way, tried
        # once (from, to, slowdowns then): where the stage timers mislead the speed model (on
        # GPUs they carry the pipeline's waits, not only each device's speed), the step time
        # is the only reliable measure, and the opposite direction is the untried neighbour.
        self._probe: tuple[list, list, list[float]] | None = None
        # The plan bounds, per-stage fwd/bwd step ms and per-device slowdowns of the window
        # that decided the last move: the first side of its refit.
        self._before: tuple[list, list[float], list[float], list[float]] | None = None

    @property
    def calibrated(self) -> bool:
        return self.clean_fwd is not None

    def describe(self) -> str:
        if self.mode == "static":
            return "static: the plan never changes"
        if self.mode_used == "measured" and self.mode != "measured":
            return (
                f"{self.mode}: no predictor given, deciding from measured stage times alone "
                "(uniform slowdown per device)"
            )
        if self.mode_used == "measured":
            return (
                "measured: deciding from measured stage times alone (uniform slowdown per device)"
            )
        return f"{self.mode}: measured stage times calibrate the predictor's per-layer slowdowns"

    # ---- calibration -------------------------------------------------------------------
    def calibrate(self, plan: Plan, fwd_step_ms: np.ndarray, bwd_step_ms: np.ndarray) -> None:
        """Clean per-layer costs from settled windows, assumed free of interference."""
        m = plan.microbatches
        classes = _layer_classes(self.base)
        self.clean_fwd = fit_layer_costs(
            self.base.fwd_ms[0], classes, plan.bounds, np.asarray(fwd_step_ms) / m
        )
        self.clean_bwd = fit_layer_costs(
            self.base.bwd_ms[0], classes, plan.bounds, np.asarray(bwd_step_ms) / m
        )

    def state(self) -> dict[str, Any]:
        """What a relaunch needs to continue (restart baseline): the calibration."""
        return {
            "clean_fwd": None if self.clean_fwd is None else self.clean_fwd.tolist(),
            "clean_bwd": None if self.clean_bwd is None else self.clean_bwd.tolist(),
            "pause_ms": self.pause_ms,
            "record": list(self.record),
            "refuted": [list(r) for r in self.refuted],
            "before": None if self._before is None else [list(x) for x in self._before],
        }

    def load_state(self, st: dict[str, Any]) -> None:
        if st.get("clean_fwd") is not None:
            self.clean_fwd = np.asarray(st["clean_fwd"], dtype=np.float64)
            self.clean_bwd = np.asarray(st["clean_bwd"], dtype=np.float64)
        if st.get("pause_ms") is not None:
            self.pause_ms = float(st["pause_ms"])
        if st.get("record") is not None:
            self.record = [float(x) for x in st["record"]]
        self.refuted = [
            (list(map(list, a)), list(map(list, b)), list(c)) for a, b, c in st.get("refuted", [])
        ]
        if st.get("before") is not None:
            bounds, fwd, bwd, slow = st["before"]
            self._before = (bounds, fwd, bwd, slow)

    @property
    def refit_pending(self) -> bool:
        return self._before is not None

    def refit(self, plan: Plan, fwd_step_ms: np.ndarray, bwd_step_ms: np.ndarray) -> dict:
        """Refit the clean costs from the stage times before the last move and under ``plan``.

        Taken only when the move was decided with every device within ``jump`` of clean:
        then the stage times on both sides are clean costs, and what the model got wrong
        about the moved layers shows as one stage gaining less (or more) than the other
        lost. Under interference a layer's slowdown depends on the layer, so times then do
        not give clean costs. Also skipped when the work of all stages does not add up to
        the same on both sides within ``_REFIT_TOL``: a device changed speed across the move,
        and that change is not the layers' cost. Returns what was done, for the log.
        """
        assert self._before is not None and self.clean_fwd is not None
        assert self.clean_bwd is not None
        (old_bounds, old_f, old_b, slow), self._before = self._before, None
        old_bounds = [tuple(b) for b in old_bounds]
        if old_bounds == list(plan.bounds):
            return {"refit": False, "why": "same plan"}
        m = plan.microbatches
        old_f, old_b = np.asarray(old_f, float) / m, np.asarray(old_b, float) / m
        new_f, new_b = np.asarray(fwd_step_ms, float) / m, np.asarray(bwd_step_ms, float) / m
        ratio = float((new_f.sum() + new_b.sum()) / max(old_f.sum() + old_b.sum(), 1e-12))
        info = {"work_ratio": round(ratio, 4), "slowdown": [round(float(x), 4) for x in slow]}
        if np.any(np.abs(np.asarray(slow) - 1) > self.config.jump):
            return {"refit": False, "why": "a device was slowed when the move was decided", **info}
        if abs(ratio - 1) > _REFIT_TOL:
            return {"refit": False, "why": "work does not add up: a device changed speed", **info}
        new_bounds = list(plan.bounds)
        self.clean_fwd = refit_segments(self.clean_fwd, old_bounds, old_f, new_bounds, new_f)
        self.clean_bwd = refit_segments(self.clean_bwd, old_bounds, old_b, new_bounds, new_b)
        self._faster = None  # measured against the costs just replaced
        return {"refit": True, **info}

    # ---- the speed model ---------------------------------------------------------------
    def device_costs(
        self,
        plan: Plan,
        fwd_step_ms: np.ndarray,
        bwd_step_ms: np.ndarray,
        telemetry: list[dict[str, float]] | None = None,
        noise: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Predicted per-microbatch fwd/bwd ms of every layer on every rank ``[R, L]``.

        Rows are indexed by rank (device), and the per-device measured slowdowns ``[R]``.
        ``noise``: per stage, the relative standard error of its measured time; the costs
        use only the part of each slowdown beyond ``noise_z`` of them (``credible``).
        """
        assert self.clean_fwd is not None and self.clean_bwd is not None
        m = plan.microbatches
        n_dev = plan.num_stages
        cf, cb = self.clean_fwd, self.clean_bwd
        fwd = np.empty((n_dev, len(cf)))
        bwd = np.empty((n_dev, len(cf)))
        slow = np.ones(n_dev)
        rel_f = rel_b = None
        if self.mode_used != "measured" and telemetry is not None:
            from dynpipe.predictor import predict_layer_times

            pf, pb = predict_layer_times(
                self.predictor,
                layers=self.prepared,
                alone_fwd_ms=cf,
                alone_bwd_ms=cb,
                telemetry=telemetry,
            )
            rel_f, rel_b = pf / np.maximum(cf, 1e-12), pb / np.maximum(cb, 1e-12)
        for s, st in enumerate(plan.stages):
            a, b = st.start, st.stop
            clean = cf[a:b].sum() + cb[a:b].sum()
            measured = (fwd_step_ms[s] + bwd_step_ms[s]) / m
            sigma = measured / max(clean, 1e-12)
            slow[st.rank] = sigma
            if noise is not None:
                sigma = credible(sigma, self.config.noise_z * float(noise[s]))
                measured = sigma * clean
            if rel_f is None:
                fwd[st.rank], bwd[st.rank] = cf * sigma, cb * sigma
            else:
                d = st.rank
                predicted_held = (cf[a:b] * rel_f[d, a:b]).sum() + (cb[a:b] * rel_b[d, a:b]).sum()
                kappa = measured / max(predicted_held, 1e-12)
                fwd[d], bwd[d] = cf * rel_f[d] * kappa, cb * rel_b[d] * kappa
        return fwd, bwd, slow

    def _costs_for(self, plan: Plan, fwd: np.ndarray, bwd: np.ndarray) -> CostModel:
        # The planner places stage s on device s; our rows are ranks, so order them by stage.
        order = plan.ranks
        return dataclasses.replace(
            self.base,
            fwd_ms=fwd[order],
            bwd_ms=bwd[order],
            bandwidth=np.resize(self.base.bandwidth, len(order) - 1),
            latency_ms=np.resize(self.base.latency_ms, len(order) - 1),
        )

    def predicted_step_ms(self, plan: Plan, costs: CostModel) -> float:
        sc = stage_costs(costs, plan.bounds, schedule=plan.schedule, microbatches=plan.microbatches)
        return float(
            step_times(
                np.array([sc.fwd_ms]),
                np.array([sc.bwd_ms]),
                np.array([sc.comm_ms]),
                schedule=plan.schedule,
                microbatches=plan.microbatches,
            )[0]
        )

    # ---- the decision ------------------------------------------------------------------
    def decide(
        self,
        *,
        step: int,
        plan: Plan,
        fwd_step_ms: np.ndarray,
        bwd_step_ms: np.ndarray,
        telemetry: list[dict[str, float]] | None = None,
        noise: np.ndarray | None = None,
    ) -> Decision:
        """Whether to move from ``plan`` now, and to which plan. ``noise``: per stage, the
        relative standard error of the measured stage time (see ``device_costs``)."""
        fwd, bwd, slow = self.device_costs(plan, fwd_step_ms, bwd_step_ms, telemetry, noise)
        if self._lower_clean(plan, fwd_step_ms, bwd_step_ms, slow):
            fwd, bwd, slow = self.device_costs(plan, fwd_step_ms, bwd_step_ms, telemetry, noise)
        costs = self._costs_for(plan, fwd, bwd)
        cur = self.predicted_step_ms(plan, costs)
        pause = self.pause_ms if self.pause_ms is not None else cur  # first guess: one step
        res = plan_partition(
            costs,
            num_stages=plan.num_stages,
            schedule=plan.schedule,
            microbatches=plan.microbatches,
            current=plan,
            migration_ms_per_byte=0.0,
            ranks=plan.ranks,
        )
        new_plan = self._with_bounds(plan, res.bounds, step)
        moved = self._moves(plan, new_plan)
        moved_bytes = int(sum(t.nbytes or 0 for t in moved))
        gain = cur - res.step_ms
        common = dict(
            step=step,
            mode=self.mode_used,
            slowdown=tuple(round(float(x), 4) for x in slow),
            current_ms=cur,
            proposed_ms=res.step_ms,
            migration_ms=pause,
            moved_bytes=moved_bytes,
        )
        probe = self._probe_now(plan, slow, step)
        if probe is not None:
            probe_plan = self._with_bounds(plan, probe, step)
            self._wanted = []
            self._decided(plan, probe, fwd_step_ms, bwd_step_ms, slow)
            return Decision(
                **{
                    **common,
                    "proposed_ms": self.predicted_step_ms(probe_plan, costs),
                    "moved_bytes": int(sum(t.nbytes or 0 for t in self._moves(plan, probe_plan))),
                },
                repartition=True,
                reason="probe: one layer the other way from a move measured slower",
                plan=probe_plan,
            )
        if not moved:
            self._want(False)
            return Decision(**common, repartition=False, reason="current plan is best")
        if step - self.last_change_step < self.config.cooldown_steps:
            return Decision(**common, repartition=False, reason="cooldown")
        context = (_key(plan.bounds), _key(res.bounds), list(slow))
        if self._was_refuted(context):
            self._want(False)
            return Decision(
                **common,
                repartition=False,
                reason="this move was measured slower under these conditions",
            )
        trust = self.trust
        if gain * trust < self.config.min_gain * cur:
            self._want(False)
            discounted = f" ({gain * trust / cur:.1%} after the track record)" if trust < 1 else ""
            return Decision(
                **common,
                repartition=False,
                reason=f"gain {gain / cur:.1%}{discounted} below min {self.config.min_gain:.0%}",
            )
        gain *= trust
        if gain * self.config.horizon_steps <= pause:
            return Decision(
                **common,
                repartition=False,
                reason=f"gain {gain:.2f} ms/step does not pay {pause:.1f} ms within "
                f"{self.config.horizon_steps} steps",
            )
        if gain < self.config.confirm_below * cur and not any(self._wanted):
            # A modest gain may be noise: act only if one of the next two windows also wants
            # to move.
            self._want(True)
            return Decision(
                **common,
                repartition=False,
                reason=f"gain {gain / cur:.1%} needs a second window to confirm",
            )
        self._wanted = []
        self._decided(plan, res.bounds, fwd_step_ms, bwd_step_ms, slow)
        return Decision(
            **common,
            repartition=True,
            reason=f"predicted {cur:.2f} -> {res.step_ms:.2f} ms/step",
            plan=new_plan,
        )

    def _decided(
        self,
        plan: Plan,
        to: Any,
        fwd_step_ms: np.ndarray,
        bwd_step_ms: np.ndarray,
        slow: np.ndarray,
    ) -> None:
        """Remember a move to ``to`` bounds for its verdict (``judge``) and its refit."""
        src, conditions = _key(plan.bounds), [float(x) for x in slow]
        self._proposed = (src, _key(to), conditions)
        self._before = (
            src,
            [float(x) for x in fwd_step_ms],
            [float(x) for x in bwd_step_ms],
            conditions,
        )

    def _lower_clean(
        self, plan: Plan, fwd_step_ms: np.ndarray, bwd_step_ms: np.ndarray, slow: np.ndarray
    ) -> bool:
        """Lower the clean cost of stages that ran clearly faster than it, two windows running.

        Interference only ever slows a device, so a stage faster than its clean cost shows
        the calibration was taken under a transient: GPU clocks ramping up, kernels being
        tuned, loader workers starting, another job finishing. Left alone, that stage looks
        fast next to the others and the planner "gains" by loading it up. One fast window is
        not enough (noise); the slower of the two windows becomes the stage's clean time,
        the other stages keep theirs, and the per-class fit is redone. Returns whether it did.
        """
        by_stage = np.array([slow[st.rank] for st in plan.stages])
        fast = by_stage < 1 - self.config.drift_tol
        prev, self._faster = self._faster, None
        if not fast.any():
            return False
        fwd, bwd = np.asarray(fwd_step_ms, float), np.asarray(bwd_step_ms, float)
        if prev is None or not (fast & prev[0]).any():
            self._faster = (fast, fwd, bwd)
            return False
        assert self.clean_fwd is not None and self.clean_bwd is not None
        both = fast & prev[0]
        m = plan.microbatches
        tf = np.array([self.clean_fwd[a:b].sum() * m for a, b in plan.bounds])
        tb = np.array([self.clean_bwd[a:b].sum() * m for a, b in plan.bounds])
        tf[both] = np.maximum(fwd, prev[1])[both]
        tb[both] = np.maximum(bwd, prev[2])[both]
        self.calibrate(plan, tf, tb)
        return True

    def _moves(self, plan: Plan, new_plan: Plan) -> list:
        return diff(plan, new_plan, param_bytes=list(self.base.state_bytes.astype(int)))

    def _with_bounds(self, plan: Plan, bounds: Any, step: int) -> Plan:
        return dataclasses.replace(
            plan,
            stages=tuple(
                dataclasses.replace(st, start=a, stop=b, layers=tuple(self.base.layer_names[a:b]))
                for st, (a, b) in zip(plan.stages, bounds, strict=True)
            ),
            meta={**plan.meta, "method": f"controller:{self.mode_used}", "decided_at": step},
        )

    def _mirror(
        self, move: tuple[list, list, list[float]]
    ) -> tuple[list, list, list[float]] | None:
        """The opposite of a move that shifted every boundary by at most one layer, if it is a
        valid plan (a move of several layers has no single untried neighbour)."""
        src, dst, slow = move
        cuts = [b[0] for b in src[1:]]
        shift = [d[0] - c for d, c in zip(dst[1:], cuts, strict=True)]
        if any(abs(x) > 1 for x in shift) or not any(shift):
            return None
        new_cuts = [0, *(c - x for c, x in zip(cuts, shift, strict=True)), src[-1][1]]
        if any(a >= b for a, b in itertools.pairwise(new_cuts)):
            return None
        return (src, [[a, b] for a, b in itertools.pairwise(new_cuts)], slow)

    def _probe_now(self, plan: Plan, slow: np.ndarray, step: int) -> list | None:
        """The waiting probe's target bounds, if it applies to this plan and these conditions
        (and the cooldown has passed); it is given up otherwise."""
        if self._probe is None or step - self.last_change_step < self.config.cooldown_steps:
            return None
        probe, self._probe = self._probe, None
        src, dst, then = probe
        same = _key(plan.bounds) == src and self._same_conditions(slow, then)
        if not same or self._was_refuted((src, dst, list(slow))):
            return None
        return dst

    def _was_refuted(self, context: tuple[list, list, list[float]]) -> bool:
        """Whether this move (same splits) was measured slower while every device ran at
        about the slowdown it runs at now (within ``jump``: an onset or a departure makes it
        a new situation, and the move may be tried again)."""
        src, dst, slow = context
        return any(
            r_src == src and r_dst == dst and self._same_conditions(slow, r_slow)
            for r_src, r_dst, r_slow in self.refuted
        )

    def _same_conditions(self, slow: Any, then: Any) -> bool:
        """Every device's slowdown within ``jump`` of what it was then."""
        if len(slow) != len(then):
            return False
        ratio = np.asarray(slow) / np.maximum(np.asarray(then), 1e-9)
        return bool(np.all(np.abs(ratio - 1) <= self.config.jump))

    def slower(self, before_ms: float, after_ms: float) -> bool:
        """Whether a move made steps slower by the minimum gain or more: beyond what one
        window's noise does, so it is undone (and remembered)."""
        return after_ms > before_ms * (1 + self.config.min_gain)

    def _want(self, wanted: bool) -> None:
        self._wanted = [*self._wanted, wanted][-2:]

    @property
    def trust(self) -> float:
        """Factor on predicted gains: the recent record, fading to 1 over quiet windows."""
        if not self.record:
            return 1.0
        doubt = 1.0 - sum(self.record) / len(self.record)
        return 1.0 - doubt * _TRUST_FADE**self.windows_since_judged

    def quiet_window(self) -> None:
        """A window passed without a judged move."""
        self.windows_since_judged += 1

    def judge(self, before_ms: float, after_ms: float, predicted_gain: float) -> bool:
        """Record how the last move did, from measured step times before and after it.

        A move that achieved half its predicted gain or more counts fully in the record.
        Returns whether it paid: the step got faster by at least half the minimum gain.
        """
        achieved = 1.0 - after_ms / max(before_ms, 1e-9)
        # Half the predicted gain, measured over one window, counts as keeping the promise.
        ratio = achieved / max(predicted_gain / 2, 1e-3)
        self.record = [*self.record, min(1.0, max(0.0, ratio))][-_RECORD:]
        self.windows_since_judged = 0
        proposed, self._proposed = self._proposed, None
        if proposed is not None and self.slower(before_ms, after_ms):
            self.refuted = [*self.refuted, proposed][-_REFUTED:]
            self._probe = self._mirror(proposed)
        return achieved >= self.config.min_gain / 2

    def applied(self, step: int, pause_ms: float) -> None:
        """Record that a repartition happened at ``step`` and what it cost."""
        self.last_change_step = step
        self._faster = None  # measured under the plan just left
        self.pause_ms = pause_ms if self.pause_ms is None else 0.5 * (self.pause_ms + pause_ms)
