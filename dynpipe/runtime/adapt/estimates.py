"""What every layer costs on every device now, from per-layer measurements.

Each stage times every layer it holds on one step per window (``runtime/timing.py``), so a
layer's cost on the device that holds it is measured, not inferred: ``run`` is its running
(exponentially weighted) time there. What cannot be measured is what a layer would cost on
a device that does not hold it. That is its *clean* cost times the device's slowdown now:

- ``clean``: a layer's cost on an idle device. Taken from the first trusted window (the
  offline profile or the analytic model is only the prior before then); identical layers
  (a transformer's blocks) share one clean cost, the least any device shows for them; and a
  layer that runs faster than its clean cost by more than its device's noise lowers it:
  interference only ever slows a device, so such a layer shows its clean cost was taken
  during a start-up transient or under interference. "Runs faster" is read twice: in its
  share of the stage's time (what ``run`` holds) and in its own timer's readings, unscaled
  (``raw``). The share is how a stage's measured time divides among its layers, scaled by
  the window's median stage time over the sampled step's (or down to the stage's time where
  the timers sum beyond it), so on a slowed stage whose sampled step ran slower than the
  median, or whose timers over-read, every share lands below what its layer costs. A
  timer can read long (a stall inside its events) but never short of the work it times:
  only a layer whose own timer also reads below its clean cost proves that cost too high.
  On 2 x H200, vgg16 256 under ``gemm`` on stage 1 scaled that stage's forward shares
  5-20% down in every window the interferer ran (its sampled step ran slower than the
  window's median), and the clean costs lowered on those shares left the device reading
  1.11x clean after the interferer stopped, where its timers read their clean costs.
  A device slowed from the run's start would give its layers their slowed times as clean
  costs and read 1.0x; a layer moved off it while the clean costs are still being taken
  runs on both devices under the same conditions, and its own timers there say how much
  slower that device ran all along (``_calibrate``).
- the device's slowdown: how much slower than clean it runs the layers it holds. In
  ``measured`` mode every layer is taken to slow alike; with a predictor, the predicted
  per-layer slowdowns from the device's telemetry are calibrated to what its held layers
  measure (one factor per device), so a layer type the interferer hurts more is priced so.

Only ratios of clean costs matter for a device's slowdown, so a bias common to all of them
cancels. A stage also costs something beyond its layers (input casts, the loss): measured as
the stage timer minus its layers on the sampled step, kept per device.

On a GPU a layer's cost here is its device's time (the events around it), not the longer
of that and its host's time to issue it. The host's time is not a property of the device:
it grows wherever the host waits for the device (a launch queue full of kernels, a stage
waiting for a slowed neighbour), and on 2 x H200 the first stage of gpt's 8|6 split read
30 ms of host time for 20 ms of device time while the second stage was slowed, so costs that
took the longer time priced every layer moved there 50% high. A stage is bound by the sum of
its layers' device times or by the sum of their host issue times, whichever is longer,
over a microbatch's forward and backward together (``CostModel.host_fwd_ms``): the
estimates keep, per layer, the least host time it has taken on any device (waiting only
ever adds to it, and hosts are alike) for that second sum, a reading far above its
identical neighbours' on its stage taken out first (``_fold_host``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dynpipe.runtime.adapt.window import Window

__all__ = ["CostEstimates"]

# Windows of readings kept per rank for its noise, and how many it takes to estimate it.
_NOISE_KEEP = 16
_NOISE_MIN = 6
# A rank is light (``CostEstimates.light_probes``) below this share of one probe layer's
# clean work: half a transformer block's, where an embedding or a final norm costs under a
# tenth of one (gpt in the analytic model: 0.08 and 0.09); a stage of one layer nearly as
# heavy as the probe layer reads its device as well as the probe would.
_LIGHT = 0.5
# A slowed device's slowdown depends on how busy the pipeline keeps it (``load_factor``):
# its excess over clean scales with ``c + (1 - c) u``, ``u`` its busy fraction. ``c`` is
# learned from a change of ``u`` of at least ``_LOAD_DU`` (a smaller one cannot tell ``c``
# from a timer's noise) on a device read clearly slowed (``_learn_load``), and kept within
# ``[_LOAD_C_MIN, 1]``: the oracle sweeps (``bench/sweep_slowdown.py``) put it near 0.5
# under ``gemm`` (gpt), 1 under ``copy``, and anywhere from 0 (vgg16 128: 1.38x at ``u``
# 0.57, 1.59x at 0.86) to 1 (bert, vgg16 256) under ``train``.
_LOAD_DU = 0.2
_LOAD_C_MIN = 0.0
# A device seen only nearly idle says little of how it runs busy: its reading there is taken
# as at least this share of the full excess.
_LOAD_G_MIN = 0.1


def median_work_layer(cost: np.ndarray) -> int:
    """The layer in which the median unit of the model's work runs: layers ordered by
    ``cost``, the first whose running sum reaches half the total."""
    order = np.argsort(cost, kind="stable")
    at = int(np.searchsorted(np.cumsum(cost[order]), 0.5 * float(cost.sum())))
    return int(order[min(at, len(order) - 1)])


def _twins(classes: np.ndarray, a: int, b: int) -> list[np.ndarray]:
    """Indices of each class of identical layers with three or more members in ``[a, b)``:
    enough of them for their middle to say what one of them costs."""
    groups = [np.flatnonzero(classes[a:b] == c) + a for c in np.unique(classes[a:b])]
    return [g for g in groups if len(g) >= 3]


def _stalls(host: np.ndarray, classes: np.ndarray, a: int, b: int, bar_ms: float) -> None:
    """In place: a host reading of layers ``[a, b)`` above the median of its identical
    layers there (three or more) by more than ``bar_ms`` (the stage's device time for a
    microbatch) is a wait, not the layer's issue time: it takes their median. Identical
    layers issue alike, and a layer whose host took longer over it than the device takes
    over the whole stage was waiting for something else."""
    for members in _twins(classes, a, b):
        vals = host[members]
        if not np.isfinite(vals).all():
            continue
        med = float(np.median(vals))
        host[members[vals > med + bar_ms]] = med


def _pooled(run: np.ndarray, classes: np.ndarray, a: int, b: int) -> np.ndarray:
    """Layers ``[a, b)`` of one device at their running costs, identical layers (three or
    more there) at their mean: they run alike under the same conditions, and what tells
    their readings apart is where the device's interference landed on the sampled step. A
    time-sliced GPU hands the device to the other process between kernels, so one layer's
    reading takes a slice and its neighbour's does not: under ``gemm`` on 2 x H200 bert's
    blocks on the slowed stage read 1.1 or 2.9-3.1 ms forward, alternating, and a split
    that kept the blocks that happened to read short was priced on them. The mean keeps
    the stage's total (the plan in force is priced as before) and spreads it evenly."""
    out = run.copy()
    for members in _twins(classes, a, b):
        if np.isfinite(out[members]).all():
            out[members] = float(out[members].mean())
    return out[a:b]


def _load_g(c: Any, u: Any) -> Any:
    """How much of a slowed device's full excess over clean it shows at busy fraction ``u``
    (``CostEstimates.load_factor``)."""
    return c + (1.0 - c) * u


def _confirms(pending: tuple[float, float], x: float, limit: float) -> bool:
    """Whether reading ``x`` confirms a suspected change ``pending`` (its direction, the
    level before it): still beyond ``limit`` (a log ratio) of that level, on the same side."""
    move = float(np.log(x / max(pending[1], 1e-9)))
    return abs(move) > limit and np.sign(move) == pending[0]


class CostEstimates:
    """Per-layer costs of ``L`` layers on ``R`` ranks, per microbatch (ms).

    prior_fwd / prior_bwd: ``[L]`` costs before any measurement (profile or analytic model).
    classes: ``[L]`` ids, equal for identical layers.
    window / jump: as ``average_windows`` / ``jump`` in ``AdaptConfig``.
    """

    def __init__(
        self,
        *,
        prior_fwd: np.ndarray,
        prior_bwd: np.ndarray,
        classes: np.ndarray,
        num_ranks: int,
        window: int,
        jump: float,
    ) -> None:
        n = len(prior_fwd)
        self.window, self.jump = window, jump
        self.classes = np.asarray(classes, dtype=int)
        self.clean_f = np.asarray(prior_fwd, dtype=float).copy()
        self.clean_b = np.asarray(prior_bwd, dtype=float).copy()
        self.calibrated = False
        self.run_f = np.full(n, np.nan)
        self.run_b = np.full(n, np.nan)
        # The same running averages of the layers' own timer readings, unscaled (NaN where
        # no window since the last reset timed the layer): the evidence that lowers a
        # clean cost (see the module docstring).
        self.raw_f = np.full(n, np.nan)
        self.raw_b = np.full(n, np.nan)
        self.n = np.zeros(n)  # windows in each layer's running average
        self.owner = np.full(n, -1)
        # Per rank, how much slower than another its layers ran while the clean costs were
        # being taken (1: as fast): a layer that moved between two ranks then measures both
        # (``_calibrate``).
        self.src_scale = np.ones(num_ranks)
        self.over_f = np.zeros(num_ranks)
        self.over_b = np.zeros(num_ranks)
        self.clean_of = np.zeros(num_ranks)
        self.clean_ob = np.zeros(num_ranks)
        # GPU (see the module docstring): per layer the least host time it took to issue
        # (NaN until measured).
        self.host_f = np.full(n, np.nan)
        self.host_b = np.full(n, np.nan)
        # Per rank: how much slower than clean its layers run (what a layer moved there
        # would cost more), and its stage's whole time per microbatch over clean.
        self.slow = np.ones(num_ranks)
        self.load = np.ones(num_ranks)
        # Per rank, log(window / running average) of its held layers over recent windows in
        # which it kept the same layers: what measurement noise alone does to it.
        self.steps: list[list[float]] = [[] for _ in range(num_ranks)]
        self.within = np.zeros(num_ranks)
        # Per rank, a change not yet confirmed: (direction, per-layer averages, stage
        # overhead and noise history from before it, size of the change as a log ratio).
        self._suspect: list[tuple | None] = [None] * num_ranks
        # Names the conditions: a new one when a rank's reading moves beyond its threshold
        # (confirmed), the old one again when every rank is back to how it ran then. Two
        # windows of the same regime ran under the same conditions.
        self.regime = 0
        self._regimes = 1
        self._regime_loads: dict[int, tuple[np.ndarray, int]] = {}  # id -> (sum, count)
        # The regime of the last window counted under one (the conditions last known), and
        # the one a change confirmed in this window left, if it named new conditions
        # (``returning``).
        self._last_known: int | None = None
        self._left_for_new: int | None = None
        self._calibrating = True
        self._probe_n = np.zeros(num_ranks)  # probes in each idle rank's running slowdown
        # Per idle rank, a change its last probe suggested: (direction, level before).
        self._probe_pending: list[tuple[float, float] | None] = [None] * num_ranks
        # Ranks that hold too little work to read their device (``_read_light``): the
        # probe's running slowdown, the probes in it, a change it suspects (direction, level
        # before, size as a log ratio), its window-to-window noise (log ratios), and every
        # rank's load after the last two windows (what a rank read before it probed).
        self._light_level = np.ones(num_ranks)
        self._light_layer = np.zeros(num_ranks, dtype=int)  # the layer each one probes
        self._light_n = np.zeros(num_ranks)
        # Per light rank, its probe's reading over the device's slowdown when it turned light
        # (``_read_light``): the probe's own bias against a layer's share of a stage.
        self._light_scale = np.ones(num_ranks)
        self._light_suspect: list[tuple[float, float, float] | None] = [None] * num_ranks
        self._light_suspect_move: list[float | None] = [None] * num_ranks
        self._light_steps: list[list[float]] = [[] for _ in range(num_ranks)]
        self._seen_loads: list[np.ndarray] = []
        # Ranks that held too little work to read their device (``light_probes``) in the
        # last window: their reading then was a light stage's, no reference for a probe.
        self._light_held: frozenset[int] = frozenset()
        # Per rank, its busy fraction in the last window that read it (NaN: none yet), and
        # its load coefficient (``load_c``) as learned since its conditions last changed:
        # the sum of its estimates, weighted by the change of load each came from, and the
        # weights.
        self.busy = np.full(num_ranks, np.nan)
        self._last_bounds: tuple[tuple[int, int], ...] | None = None
        self._load_sum = np.zeros(num_ranks)
        self._load_weight = np.zeros(num_ranks)

    @property
    def num_layers(self) -> int:
        return len(self.clean_f)

    @property
    def changing(self) -> bool:
        """A rank's reading moved beyond its threshold and the next window has yet to
        confirm it (see ``update``; a light rank's probe, ``_read_light``)."""
        return any(x is not None for x in [*self._suspect, *self._light_suspect])

    # ---- from one window ---------------------------------------------------------------
    def _measure(
        self, w: Window
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per-layer fwd/bwd ms per microbatch measured in ``w``, per-rank overheads, and
        the layers' own timer readings unscaled (NaN where the stage's were not used).

        The sampled step gives each stage's split into layers and overhead; the window's
        median stage time over all its steps gives the total (one step is noisier than the
        median of several). Without layer timings (timers off, logs that predate them) a
        stage's time is spread over its layers by their current estimates.
        """
        m = w.microbatches
        med_f, med_b = w.stage_medians()
        mf, mb = np.full(self.num_layers, np.nan), np.full(self.num_layers, np.nan)
        rf, rb = np.full(self.num_layers, np.nan), np.full(self.num_layers, np.nan)
        of, ob = self.over_f.copy(), self.over_b.copy()
        for s, ((a, b), r) in enumerate(zip(w.bounds, w.ranks, strict=True)):
            for phase, med, out, raw, over in (
                ("fwd", med_f, mf, rf, of),
                ("bwd", med_b, mb, rb, ob),
            ):
                total = float(med[s]) / m
                # On a GPU the device's own times (see the module docstring).
                layers = getattr(w, f"device_{phase}_ms")
                if layers is None:
                    layers = getattr(w, f"layer_{phase}_ms")
                sampled = getattr(w, f"sampled_{phase}_ms")
                seg = None if layers is None else layers[a:b]
                if seg is not None and np.isfinite(seg).all() and sampled is not None:
                    raw[a:b] = seg
                    stage = float(sampled[s])
                    if np.isfinite(stage) and stage > 0:
                        # The stage's time bounds its layers': where their timers sum to
                        # more (one gpt block read 3x its twins), they share the stage's.
                        scale = total / max(stage, float(seg.sum()))
                        out[a:b] = seg * scale
                        over[r] = max(0.0, stage - float(seg.sum())) * scale
                        continue
                    out[a:b] = seg
                    continue
                shares = self._shares(a, b, r, phase)
                out[a:b] = max(total - over[r], 0.0) * shares / max(shares.sum(), 1e-12)
        return mf, mb, of, ob, rf, rb

    def _shares(self, a: int, b: int, r: int, phase: str) -> np.ndarray:
        run = (self.run_f if phase == "fwd" else self.run_b)[a:b]
        clean = (self.clean_f if phase == "fwd" else self.clean_b)[a:b]
        known = (self.owner[a:b] == r) & np.isfinite(run)
        return np.where(known, run, clean)

    def noise(self) -> np.ndarray:
        """``[R]`` relative standard deviation of one window's reading of each rank: measured
        from how its readings moved between windows (robust: an onset is one outlier), and
        at least what the spread of the last window's steps says of its median."""
        out = self.within.copy()
        for r, xs in enumerate(self.steps):
            if len(xs) >= _NOISE_MIN:
                x = np.asarray(xs[-_NOISE_KEEP:])
                out[r] = max(out[r], 1.4826 * float(np.median(np.abs(x - np.median(x)))))
        for r in np.flatnonzero(self._light_n > 0):
            out[r] = max(out[r], self._light_noise(int(r)))  # read by its probe
        return out

    def _within(self, w: Window) -> None:
        """Noise of each rank's window median from the spread of the window's steps: the
        standard error of a median is about 1.25 x the spread over the root of the count."""
        k = len(w.step_ms)
        if k < 3:
            return
        total = w.stage_fwd_ms + w.stage_bwd_ms  # [k, S]
        med = np.median(total, axis=0)
        mad = np.median(np.abs(total - med), axis=0)
        for s, r in enumerate(w.ranks):
            self.within[r] = 1.25 * 1.4826 * float(mad[s] / max(med[s], 1e-12)) / np.sqrt(k)

    def threshold(self) -> np.ndarray:
        """``[R]`` change of a rank's reading, as a log ratio, that counts as a change of
        conditions: ``log(1 + jump)``, or three standard deviations of its measured noise
        (itself of log ratios) if that is more. In logs, a device 3x slower and one back to
        3x faster are the same size of change."""
        return np.maximum(np.log1p(self.jump), 3.0 * self.noise())

    def uncertainty(self) -> np.ndarray:
        """``[R]`` relative standard error (of log ratios) of each rank's running level: how
        far the speed a plan is built on may be from the rank's true speed now.

        One window's reading strays from the level by the root mean square of the rank's
        recent window-to-window changes (all ranks' pooled while it has too few: a
        launch-bound run's timers swing on every stage), and by at least what the spread of
        the window's steps says; the level averages the windows since the rank's layers or
        conditions last changed (a running mean's worth at most). The root mean square, not
        the robust spread of ``noise``: a change detector must look past a timer's swings,
        a planner must not, for it picks exactly the split the swings favour. A rank whose
        reading just moved beyond its threshold, unconfirmed, is as uncertain as that move
        (one window cannot tell an onset from a swing).
        """
        pooled = [x for xs in self.steps for x in xs[-_NOISE_KEEP:]]
        out = np.zeros(len(self.steps))
        for r, xs in enumerate(self.steps):
            use = xs[-_NOISE_KEEP:] if len(xs) >= _NOISE_MIN else pooled
            one = float(np.sqrt(np.mean(np.square(use)))) if use else 0.0
            held = self.owner == r
            n = max(1.0, float(self.n[held].min())) if held.any() else 1.0
            out[r] = max(one, float(self.within[r])) / np.sqrt(min(n, 2 * self.window - 1))
            if self._suspect[r] is not None:
                out[r] = max(out[r], self._suspect[r][4])
            if self._light_n[r] > 0:
                # Read by its probe: its slowdown is the probe's running mean.
                xs = self._light_steps[r][-_NOISE_KEEP:]
                one = float(np.sqrt(np.mean(np.square(xs)))) if xs else 0.0
                n = min(float(self._light_n[r]), 2 * self.window - 1)
                out[r] = max(out[r], one / np.sqrt(n))
            if self._light_suspect[r] is not None:
                out[r] = max(out[r], self._light_suspect[r][2])
        return out

    def update(self, w: Window, *, changed: bool = False, steady: bool = False) -> None:
        """Fold one trusted window into the running per-layer costs.

        A rank's reading is its stage's whole time per microbatch (its layers that stayed,
        plus the stage's overhead) over the running average of the same: interference that
        stalls a stage between its layers (a GPU time-sliced with another process hands the
        device back between kernels) shows in the overhead, not in any layer.
        ``changed``: the caller saw conditions change (the steps jumped): every rank's
        averages start afresh from this window, a new regime at once.
        ``steady``: the window ran the plan of the one before it and its steps did not move
        beyond their noise. A change of a rank's reading confirmed over two steady windows
        still names a new regime, but its reading is kept among the rank's noise readings
        (``uncertainty``) rather than set aside as a change: the steps did not show it, and
        on a launch-bound GPU a stage's timers swing 2x for several windows at a time while
        its steps do not. Set aside, every swing passed for a confirmed change, the rank's
        noise stayed small, and the planner piled layers on whichever device's timers read
        low (in the controller simulator a 4-stage resnet50 made seven moves, each measured
        slower). Only for a stage that bounds the steps (within its noise of the busiest
        stage's time): one that waits on another changes speed without the steps showing
        it (the demo's one-layer second stage, back from 5x to 1.2x after the end, was kept
        as noise of 130%, and its 25% faster plan stayed "within the estimates' noise").
        """
        mf, mb, of, ob, rf, rb = self._measure(w)
        self._within(w)
        limit = self.threshold()
        was_owner, was_raw = self.owner.copy(), self.raw_f + self.raw_b
        was_suspect = [x is not None for x in self._suspect]
        changed_now = bool(changed)
        left = self.regime
        self._left_for_new = None
        light = self._light_ranks(w)
        if changed:
            self._suspect = [None] * len(self._suspect)
            self._load_sum[:], self._load_weight[:] = 0.0, 0.0
        # Steady steps speak only for the stages that bound them: a stage that waits on
        # another can change speed without the steps showing it (``steady`` below).
        med_f, med_b = w.stage_medians()
        busy = med_f + med_b
        bounds_step = busy >= busy.max() * np.exp(-limit[list(w.ranks)])
        u = np.clip(busy / max(float(np.median(w.step_ms)), 1e-9), 0.0, 1.0)
        # A device's load changes with the plan (a move) or with its own speed (conditions):
        # only the first is read for its load coefficient.
        moved, self._last_bounds = self._last_bounds != w.bounds, w.bounds
        for s, ((a, b), r) in enumerate(zip(w.bounds, w.ranks, strict=True)):
            held = slice(a, b)
            steady_r = steady and bool(bounds_step[s])
            stay = (self.owner[held] == r) & np.isfinite(self.run_f[held])
            if changed:
                stay[:] = False
            new = float((mf[held] + mb[held])[stay].sum()) + of[r] + ob[r]
            old = float((self.run_f[held] + self.run_b[held])[stay].sum())
            old += self.over_f[r] + self.over_b[r]
            ratio = new / old if stay.any() and old > 0 else 1.0
            if stay.any() and moved and not changed and r not in light:
                # The stage's whole reading over the clean cost of what it holds, before the
                # move (``load``, the last window's) and now: window medians, not the sampled
                # step's split into layers (``_learn_load``).
                clean = float((self.clean_f[held] + self.clean_b[held]).sum())
                clean += self.clean_of[r] + self.clean_ob[r]
                s_now = float(busy[s]) / w.microbatches / max(clean, 1e-12)
                s_then = float(self.load[r])
                self._learn_load(r, float(u[s]), s_then, s_now / max(s_then, 1e-12), limit[r])
            self.busy[r] = float(u[s])
            history = list(self.steps[r])
            if stay.all() and ratio > 0 and r not in light:
                # A light rank's level is its probe's, and its noise too (``_light_noise``):
                # its stage timers against that level are no swing of its device. Filed
                # here, a gpt rank left one layer read -3.9 to -1.9 a window, and once it
                # held four layers again its estimate's standard error was 7x, which barred
                # a 24% gain under a `train` onset for 45 steps (controller simulator).
                self.steps[r] = [*history, float(np.log(ratio))][-_NOISE_KEEP:]
            if changed:
                pass
            elif r in light:
                pass  # its timers cannot see its device: its probe reads it (``_read_light``)
            elif self._suspect[r] is not None:
                regime = self.regime
                stay = self._confirm(r, a, b, mf, mb, of[r] + ob[r], limit[r], stay, steady_r)
                changed_now |= self.regime != regime
            elif ratio > 0 and abs(np.log(ratio)) > limit[r]:
                # The device seems to have changed speed: its averages start afresh at once
                # (an onset is followed in one window), but the change counts as a change of
                # conditions only if the next window confirms it (a spike does not).
                if not moved:
                    self._load_sum[r], self._load_weight[r] = 0.0, 0.0
                self._suspect[r] = (
                    np.sign(ratio - 1.0),
                    {
                        i: (self.run_f[i], self.run_b[i], self.n[i], self.raw_f[i], self.raw_b[i])
                        for i in range(a, b)
                    },
                    (self.over_f[r], self.over_b[r]),
                    history,
                    abs(float(np.log(ratio))),
                    steady_r,
                )
                stay[:] = False
            # Within a regime every window counts alike (a running mean), up to ``window``
            # of them; a layer new to the device, or a device that changed speed, starts over.
            self.n[held] = np.where(stay, self.n[held], 0)
            alpha = 1.0 / np.minimum(self.n[held] + 1, self.window)
            for run, meas in ((self.run_f, mf), (self.run_b, mb)):
                run[held] = np.where(stay, run[held] + alpha * (meas[held] - run[held]), meas[held])
            # A window that did not time a layer leaves its timer average as it was (or
            # empty, where the averages start afresh).
            for run, meas in ((self.raw_f, rf), (self.raw_b, rb)):
                timed = np.isfinite(meas[held])
                fold = np.where(
                    np.isfinite(run[held]), run[held] + alpha * (meas[held] - run[held]), meas[held]
                )
                run[held] = np.where(stay, np.where(timed, fold, run[held]), meas[held])
            k = 1.0 / min(float(self.n[held].min()) + 1, self.window) if stay.any() else 1.0
            self.over_f[r] += k * (of[r] - self.over_f[r])
            self.over_b[r] += k * (ob[r] - self.over_b[r])
            self.n[held] += 1
            self.owner[held] = r
        if changed_now:
            self._calibrating = False
        if self._calibrating and not any(x is not None for x in self._suspect):
            # Until conditions first change, the running averages are the clean costs, less
            # the slowdown of a device slowed from the start (``_calibrate``).
            self._calibrate(w, was_owner, was_raw, was_suspect, limit)
            scale = self.src_scale[np.maximum(self.owner, 0)]
            self.clean_f, self.clean_b = self.run_f / scale, self.run_b / scale
            self.clean_of, self.clean_ob = (
                self.over_f / self.src_scale,
                self.over_b / self.src_scale,
            )
            self.calibrated = True
        else:
            # A layer running clearly faster than its clean cost (beyond its device's noise)
            # shows that cost was taken under a transient or under interference: lower it.
            # Its share of the stage's time must say so and, where its timer read it, its
            # own readings too: a share scaled down on a slowed stage proves nothing (see
            # the module docstring). The cost lowered to is the share, which is what the
            # device's load compares with it. (Timers that read steadily above their shares
            # by more than the noise bar keep such a layer's clean cost where it is; comparing
            # the timers with what they read when the cost was taken cancels that bias, but
            # did worse in the simulator's scenarios with swinging timers.)
            for (a, b), r in zip(w.bounds, w.ranks, strict=True):
                run = self.run_f[a:b] + self.run_b[a:b]
                raw = self.raw_f[a:b] + self.raw_b[a:b]
                clean = self.clean_f[a:b] + self.clean_b[a:b]
                bar = clean * np.exp(-limit[r])
                faster = (run < bar) & ~(raw >= bar)  # NaN: never timed, the share alone
                low = np.flatnonzero(faster) + a
                self.clean_f[low], self.clean_b[low] = self.run_f[low], self.run_b[low]
                if self.over_f[r] + self.over_b[r] < (self.clean_of[r] + self.clean_ob[r]) * np.exp(
                    -limit[r]
                ):
                    self.clean_of[r], self.clean_ob[r] = self.over_f[r], self.over_b[r]
        self._share_classes(w, limit)
        for (a, b), r in zip(w.bounds, w.ranks, strict=True):
            self._probe_n[r] = 0  # a rank that holds layers again is measured by them
            self.slow[r] = self._slowdown(a, b)
            total = self.clean_f[a:b].sum() + self.clean_b[a:b].sum()
            total += self.clean_of[r] + self.clean_ob[r]
            run = self.run_f[a:b].sum() + self.run_b[a:b].sum() + self.over_f[r] + self.over_b[r]
            self.load[r] = float(run / max(total, 1e-12))
            pending, self._probe_pending[r] = self._probe_pending[r], None
            if pending is not None and not changed_now:
                # Idle until just now, its last probe suggested a change: its first reading
                # as a stage confirms or refutes it, as the next probe would have (the move
                # that gave it layers back came on that probe).
                changed_now = _confirms(pending, float(self.load[r]), np.log1p(self.jump))
        changed_now |= self._read_light(w, changed=changed)
        self._fold_host(w)
        if changed_now:
            self.regime = self._name_regime(limit, left=left)
        if not self.changing:
            # A window whose change is not yet confirmed belongs to no regime: an onset's
            # first window is not how the old conditions ran.
            total, count = self._regime_loads.get(self.regime, (np.zeros_like(self.load), 0))
            self._regime_loads[self.regime] = (total + self.load, count + 1)
            self._last_known = self.regime

    def _fold_host(self, w: Window) -> None:
        """Fold the window's host issue times in (GPU windows only): per layer the least
        seen, after a stall is taken out of the window's readings.

        Waiting only ever adds to a host time, and where in a stage's layers a wait lands is
        not the layers' doing: on 2 x H200, resnet50's second stage (9 of 18 layers at 128
        images, waiting on the first for two thirds of each step) read 26.5 ms of host time
        in one block's backward on every sampled microbatch, against 0.8-0.9 ms for its
        identical neighbours, and its host sum priced every layer moved there 3x high.
        Identical layers inside one stage are issued alike by one host, so a reading above
        theirs by more than the stage's whole device time for a microbatch (``_stalls``) is
        a wait, and the layer takes their median instead (a first block's steady 0.3 ms
        over its twins, bert on 4 x H200, is its own).
        Only inside one stage (hosts differ: on 4 x H200 bert's first host took 0.8 ms to
        issue a block's forward, the second 0.5) and not a stage's first or last layer,
        which carry its boundary's host work (receiving, casting, sending)."""
        if w.host_fwd_ms is None or w.host_bwd_ms is None:
            return
        # Each stage's device time for a microbatch, on the sampled step (none: no bar).
        bars = (
            w.sampled_fwd_ms + w.sampled_bwd_ms
            if w.sampled_fwd_ms is not None and w.sampled_bwd_ms is not None
            else None
        )
        for host, run in ((w.host_fwd_ms, self.host_f), (w.host_bwd_ms, self.host_b)):
            host = host.copy()
            if bars is not None:
                for (a, b), bar in zip(w.bounds, bars, strict=True):
                    _stalls(host, self.classes, a + 1, b - 1, float(bar))
            seen = np.isfinite(host)
            run[seen] = np.fmin(run[seen], host[seen])

    @property
    def has_host(self) -> bool:
        """Whether host issue times were measured (a GPU run; see the module docstring)."""
        return bool(np.isfinite(self.host_f).any())

    def stage_model(
        self, fwd: np.ndarray, bwd: np.ndarray, ranks: tuple[int, ...]
    ) -> dict[str, np.ndarray]:
        """``CostModel`` fields for stages on ``ranks`` (in that order) from per-layer costs
        ``fwd``/``bwd`` ``[R, L]`` (``costs``): those rows and the stage overheads, and where
        the host's issue times were measured, those too, so that a stage costs the longer of
        its device's sum and its host's. A layer whose host time was never measured adds
        none."""
        idx = list(ranks)
        of, ob = self.overheads(ranks)
        out = {"fwd_ms": fwd[idx], "bwd_ms": bwd[idx], "stage_fwd_ms": of, "stage_bwd_ms": ob}
        if self.has_host:
            out["host_fwd_ms"] = np.repeat(np.nan_to_num(self.host_f)[None], len(idx), axis=0)
            out["host_bwd_ms"] = np.repeat(np.nan_to_num(self.host_b)[None], len(idx), axis=0)
        return out

    def probe(self, probes: dict[int, tuple[int, float, float]]) -> bool:
        """Fold in idle ranks' probes: ``{rank: (layer, fwd_ms, bwd_ms)}``, one microbatch of
        ``layer`` timed on the rank's device. Its time over the layer's clean cost is the
        device's slowdown and its load (what it holds nothing to show otherwise): a running
        mean over up to ``window`` probes, started afresh when a probe moves beyond ``jump``.

        Two probes in a row beyond ``jump`` of the level before them, on the same side, are
        a change of conditions (an interferer's end on a device that holds nothing), and the
        regime is named again as for a stage's confirmed change; a lone spike is not. Without
        this the conditions an idle device was emptied under outlived it: on 4 x H100 the
        plan that took the GPU back was priced by its windows under the interferers averaged
        with its clean ones (221 ms against 112 measured) and left again. Returns True when
        a change was confirmed."""
        confirmed = False
        bar = float(np.log1p(self.jump))
        for r, (i, f, b) in probes.items():
            clean = float(self.clean_f[i] + self.clean_b[i])
            if not (np.isfinite(f) and np.isfinite(b)) or clean <= 0:
                continue
            ratio = max(float(f + b) / clean, 1e-6)
            n = self._probe_n[r]
            pending, self._probe_pending[r] = self._probe_pending[r], None
            if pending is not None:
                confirmed |= _confirms(pending, ratio, bar)
            level = max(float(self.slow[r]), 1e-9)
            if n == 0 or abs(np.log(ratio / level)) > bar:
                if n > 0 and pending is None:
                    self._probe_pending[r] = (float(np.sign(np.log(ratio / level))), level)
                self.slow[r], self._probe_n[r] = ratio, 1
            else:
                k = 1.0 / min(n + 1, self.window)
                self.slow[r] += k * (ratio - self.slow[r])
                self._probe_n[r] = n + 1
            self.load[r] = self.slow[r]
            # A stage moved back costs the device's clean overhead times its slowdown, as its
            # layers do: the overhead last measured there is the stage's before it went idle,
            # often under what emptied it (4 x H100, three `gemm` jobs: 4.2 ms a microbatch
            # against 0.01 clean, kept after the probe read the device clean again, so four
            # stages were priced at 128 ms where they ran 107 and the GPU was never taken back).
            self.over_f[r] = self.clean_of[r] * self.slow[r]
            self.over_b[r] = self.clean_ob[r] * self.slow[r]
        if confirmed and not self.changing:
            self.regime = self._name_regime(self.threshold(), left=self.regime)
        return confirmed

    # ---- ranks that hold too little work to read their device --------------------------
    def probe_layer(self) -> int:
        """The layer a light rank times (``light_probes``): the one in which the median unit
        of the model's clean work runs (layers by clean cost, the first whose running sum
        reaches half the total), as the first layer of its class, so that the choice holds
        while clean costs are refined. A transformer's block, VGG's middle convolutions:
        what moving layers back to a device would move, not the embedding or a norm."""
        i = median_work_layer(self.clean_f + self.clean_b)
        return int(np.flatnonzero(self.classes == self.classes[i])[0])

    def light_probes(self, key: tuple[tuple[int, int], ...]) -> dict[int, int]:
        """``{rank: layer}``: the ranks of a plan (one range per rank, an idle rank's
        empty) that hold too little work to read their device, and the layer each times.

        Too little work: the clean cost of the layers a rank holds is less than half that
        of one ``probe_layer`` (``_LIGHT``). A rank holding more times that much work per
        microbatch on every step, which reads its device about as well as the probe would
        (and costs nothing extra); one holding less, an embedding or a final norm,
        runs kernels short enough to fit between another process's on a time-sliced GPU, and
        its timers read the same with and without an interferer (4 x H200, gpt 12 x 2048,
        three ``gemm`` processes: the head's stage read clean throughout). Identical layers
        share one clean cost, so a light rank never holds the probe layer's class. Idle
        ranks are not listed: they probe the layer they last held (``probe``). The clean
        costs are measured from the first trusted window on (the prior before it: an
        analytic prior that prices a small model's layers alike by a per-kernel floor
        names no rank light until they are measured)."""
        i = self.probe_layer()
        cost = self.clean_f + self.clean_b
        bar = _LIGHT * float(cost[i])
        out = {}
        for r, (a, b) in enumerate(key):
            if b > a and not a <= i < b and float(cost[a:b].sum()) < bar:
                out[r] = i
        return out

    def _light_ranks(self, w: Window) -> set[int]:
        """Ranks of ``w`` that hold layers and probed their device (``light_probes``)."""
        return {r for r in (w.probes or {}) if r in w.ranks}

    def _light_noise(self, r: int) -> float:
        """Robust relative standard deviation of a light rank's probe reading, window to
        window (log ratios; 0 until it has enough of them). One microbatch of one layer on
        one step is noisier than a stage's median over a window's steps: where a light
        rank's reading is its probe's, so is its noise (``noise``, ``uncertainty``)."""
        xs = self._light_steps[r][-_NOISE_KEEP:]
        if len(xs) < _NOISE_MIN:
            return 0.0
        x = np.asarray(xs)
        return 1.4826 * float(np.median(np.abs(x - np.median(x))))

    def _light_limit(self, r: int) -> float:
        """A change of a light rank's probe reading (log ratio) that counts as a change of
        conditions: ``log(1 + jump)``, or three standard deviations of its noise."""
        return max(float(np.log1p(self.jump)), 3.0 * self._light_noise(r))

    def _read_light(self, w: Window, *, changed: bool) -> bool:
        """Read the light ranks of ``w`` by their probes; True if one confirmed a change of
        conditions (``update`` then names the regime).

        A light rank's timers see only its own short kernels: they still price the layers
        it holds (what those cost there is what they measure), but not its device. Its probe
        (one microbatch of ``probe_layer``, forward and backward) over that layer's clean
        cost is the rank's reading instead: its slowdown (what a layer moved there would
        cost more) and its load (how its conditions are compared with a regime's) are the
        probe's running mean, and the stage's own change detector leaves the rank to it.
        Changes are read the way a stage's are: a reading beyond ``_light_limit`` of the
        level restarts the level at once and is a change of conditions if the next probe
        confirms it (same direction, still beyond the limit of the level before).

        A rank that just became light (the controller moved its layers away, as it does
        when its device slows): its first probe starts the level at the rank's last reading
        as a whole stage and calibrates the probe to it (a stage's reading and one layer's
        of the same device differ by more than the noise of either, and that difference is
        not a change of conditions). A change its stage suspected on that last window,
        unconfirmed, is carried over: the next probe confirms or refutes it against the
        level before (an onset's confirmation is not lost to the move).
        """
        seen = self._seen_loads
        light = self._light_ranks(w)
        confirmed = False
        for r in light:
            i, f, b = w.probes[r]
            clean = float(self.clean_f[i] + self.clean_b[i])
            if not (np.isfinite(f) and np.isfinite(b)) or clean <= 0:
                continue
            x = max(float(f + b) / clean, 1e-6)
            self._light_layer[r] = int(i)
            limit = self._light_limit(r)
            n = self._light_n[r]
            if n == 0 and (not seen or r in self._light_held):
                self._light_scale[r] = 1.0  # no whole-stage reading to calibrate to (below)
            elif n == 0:
                # The first probe of a light period calibrates the probe to the device's
                # reading as a whole stage just before (the window that moved its layers
                # away): one microbatch of one layer, alone, costs more than that layer's
                # share of a stage's time by a fixed part (its own launch and autograd
                # work; on a 2-core CPU in the demo it read 2-2.4x the share with nothing
                # slowing it, so the device never read clean again). From then on the probe
                # reads the device's slowdown as changes of that level.
                # On a GPU it is not calibrated: its reading is the device's own time,
                # queued behind a spin (``PipelineEngine._probe``), which is what a layer's
                # clean cost is, with no part of its own to take out; and under a
                # time-sliced interferer one layer alone reads less slowed than a stage
                # (an idle probe 2.7x where the stage had read 3.9x, 4 x H100), so that a
                # probe calibrated there read the clean device 1.7x slow and the layers
                # never went back.
                ref = float(seen[-1][r])
                if w.device_fwd_ms is None:
                    self._light_scale[r] = x / max(ref, 1e-9)
                    x = ref
                else:
                    self._light_scale[r] = 1.0
                if self._suspect[r] is not None and len(seen) >= 2:
                    # A change the stage suspected in that window: the next probe confirms
                    # or refutes it, as the stage's next window would have.
                    before = float(seen[-2][r])
                    move = float(np.log(ref / max(before, 1e-9)))
                    self._light_suspect[r] = (float(np.sign(move)), before, abs(move))
                    self._light_suspect_move[r] = None
                self._suspect[r] = None
                self._light_level[r], self._light_n[r] = x, 1
                self.slow[r] = self.load[r] = x
                continue
            x /= self._light_scale[r]
            pending = None
            if self._light_suspect[r] is not None:
                sign, before, _ = self._light_suspect[r]
                pending = (sign, before)
            suspected = self._light_suspect_move[r]
            self._light_suspect[r], self._light_suspect_move[r] = None, None
            self._suspect[r] = None  # the probe decides it (its stage cannot)
            if changed or pending is not None:
                if pending is not None and not changed and _confirms(pending, x, limit):
                    confirmed = True
                    # A confirmed change's move is not noise of a steady device (as for a
                    # stage's: a spike's is).
                    xs = self._light_steps[r]
                    if suspected is not None and xs and xs[-1] == suspected:
                        self._light_steps[r] = xs[:-1]
                self._light_level[r], self._light_n[r] = x, 1
            elif n == 0:
                self._light_level[r], self._light_n[r] = x, 1
            else:
                level = float(self._light_level[r])
                move = float(np.log(x / max(level, 1e-9)))
                self._light_steps[r] = [*self._light_steps[r], move][-_NOISE_KEEP:]
                if abs(move) > limit:
                    self._load_sum[r], self._load_weight[r] = 0.0, 0.0  # new conditions
                    self._light_suspect[r] = (float(np.sign(move)), level, abs(move))
                    self._light_suspect_move[r] = move
                    self._light_level[r], self._light_n[r] = x, 1
                else:
                    self._light_level[r] = level + (x - level) / min(n + 1, self.window)
                    self._light_n[r] = n + 1
            self.slow[r] = self.load[r] = float(self._light_level[r])
        # A rank that only starts probing windows after it turned light (its device read
        # slowed later) has no whole-stage reading just before: its last one was a light
        # stage's (in the controller simulator, an embedding on a slowed device read 30x),
        # and a probe calibrated to that never read the device clean again. It reads the
        # probe against the layer's clean cost instead, as idle ranks do.
        self._light_held = frozenset(self.light_probes(w.key))
        for r in range(len(self._light_n)):
            if r not in light:
                pending = self._light_suspect[r]
                if pending is not None and r in w.ranks and not changed:
                    # Light until just now, its last probe suggested a change: its first
                    # reading as a stage confirms or refutes it, as the next probe would
                    # have (the move that gave it layers came on that probe: in the
                    # simulator an interferer's end, read one window early, was moved on
                    # and then dropped with the probe, and the clean conditions were
                    # counted as the interferer's for the rest of the run).
                    confirmed |= _confirms(pending[:2], float(self.load[r]), self._light_limit(r))
                self._light_n[r], self._light_suspect[r] = 0, None
                self._light_suspect_move[r] = None
        if confirmed:
            self._calibrating = False
        self._seen_loads = [*seen, self.load.copy()][-2:]
        return confirmed

    def _name_regime(self, limit: np.ndarray, *, left: int) -> int:
        """The regime conditions changed to: an earlier one whose ranks all ran within
        ``limit`` of how they run now (an interferer gone: the clean conditions again), else
        a new one; never ``left``, the one they changed from (a change the steps confirmed
        may be one that noisy timers cannot tell from it)."""
        known = self._known_regime(limit, left=left)
        if known is not None:
            return known
        self._left_for_new = self._last_known
        self._regimes += 1
        return self._regimes - 1

    def _known_regime(self, limit: np.ndarray, *, left: int) -> int | None:
        for rid, (total, count) in self._regime_loads.items():
            if rid == left:
                continue
            then = total / max(count, 1)
            if np.all(
                np.abs(np.log(np.maximum(self.load, 1e-9) / np.maximum(then, 1e-9))) <= limit
            ):
                return rid
        return None

    def regime_load(self, rid: int) -> np.ndarray | None:
        """``[R]`` the mean reading of every rank over regime ``rid``'s windows (None if
        none was counted under it)."""
        if rid not in self._regime_loads:
            return None
        total, count = self._regime_loads[rid]
        return total / max(count, 1)

    @property
    def returning(self) -> tuple[int, ...]:
        """While a change is unconfirmed (``changing``), or in the window that confirmed it
        as conditions not seen before: the earlier regimes the devices read as run again (an
        interferer gone), nearest first; else none.

        Read against the conditions last known (``left``): on every rank where an earlier
        regime and those ran apart (beyond the threshold), the reading is closer to the
        earlier one; on the ranks where they ran alike, within the threshold of it. A
        threshold that noisy timers have widened can hold several regimes at once (all are
        listed: which one's plans to go back to is the measurements' call, ``Controller``),
        and a reading still under the current conditions must not pass for an end.
        Not "within the threshold on every rank", as a regime is named again: a stage's
        reading depends on what it holds as well as on its device, and a stage left
        holding one small layer when its device slowed reads the clean device above its
        threshold once the interferer is gone (the demo's second stage, its head alone:
        1.2-1.4x clean, where its threshold was 1.1x). Such a reading names new conditions,
        under which no plan was measured, and the model, pricing the device 1.2x slow,
        took a split that ran 10% slower than the one measured fastest before the
        interferer. What an earlier regime's best plan does now is measured by going to
        it: the move is judged on the next window, as any move is."""
        left, fresh = self._last_known, None
        if self._left_for_new is not None and not self.changing:
            # The regime just named has this window's reading alone: not a candidate.
            left, fresh = self._left_for_new, self.regime
        elif not self.changing:
            return ()
        if left is None:  # no window counted under a regime yet
            return ()
        limit = self.threshold()
        now = np.log(np.maximum(self.load, 1e-9))

        def mean(rid: int) -> np.ndarray:
            return np.log(np.maximum(self.regime_load(rid), 1e-9))

        b = mean(left)
        found = []
        for rid in self._regime_loads:
            if rid in (left, fresh):
                continue
            a = mean(rid)
            apart = np.abs(a - b) > limit
            if not apart.any() or np.any(np.abs(now - a)[~apart] > limit[~apart]):
                continue
            if np.all((np.abs(now - a) < np.abs(now - b))[apart]):
                found.append((float(np.abs(now - a).sum()), rid))
        return tuple(rid for _, rid in sorted(found))

    def _confirm(
        self,
        r: int,
        a: int,
        b: int,
        mf: np.ndarray,
        mb: np.ndarray,
        over: float,
        limit: float,
        stay: np.ndarray,
        steady: bool = False,
    ) -> np.ndarray:
        """The window after a suspected change on rank ``r``: still beyond ``limit`` of the
        level before it, in the same direction, and conditions changed (a new regime); back
        within it, and it was a spike: the averages from before it come back."""
        sign, snap, (sf, sb), history, _, was_steady = self._suspect[r]
        self._suspect[r] = None
        # A confirmed change's reading is not noise of a steady device (a spike's is).
        this = self.steps[r][-1:] if len(self.steps[r]) > len(history) + 1 else []
        common = [i for i in range(a, b) if i in snap and self.owner[i] == r]
        if not common:
            self.regime = -1  # nothing left to compare with: count it as a change (named later)
            self.steps[r] = history
            return stay
        before = sum(snap[i][0] + snap[i][1] for i in common) + sf + sb
        now = float(sum(mf[i] + mb[i] for i in common)) + over
        change = float(np.log(max(now, 1e-12) / max(before, 1e-12)))
        if abs(change) > limit and np.sign(change) == sign:
            self.regime = -1  # a change (named once every rank is read)
            if not (steady and was_steady):
                self.steps[r] = history + this
            # else: the steps of an unchanged plan did not move in either window, so the
            # change may be the timers' own (see ``update``): its reading stays among the
            # rank's noise readings.
            held = float(sum(self.run_f[i] + self.run_b[i] for i in common))
            held += self.over_f[r] + self.over_b[r]
            if abs(float(np.log(max(now, 1e-12) / max(held, 1e-12)))) > limit:
                # The suspect window read neither level (the change came after it, or it
                # was a swing before it): the averages start from this window. On a loaded
                # 2-core machine the demo's second stage swung from 4.7x to 3.4x in the
                # last window of a 5x slowdown and read 1.2x in the next, and averaging the
                # two kept it at 2.1x for a window and on the slow plan past the end.
                return np.zeros_like(stay)
            return stay
        for i in common:
            self.run_f[i], self.run_b[i], self.n[i], self.raw_f[i], self.raw_b[i] = snap[i]
        self.over_f[r], self.over_b[r] = sf, sb
        return (self.owner[a:b] == r) & np.isfinite(self.run_f[a:b])

    def _calibrate(
        self,
        w: Window,
        was_owner: np.ndarray,
        was_raw: np.ndarray,
        was_suspect: list[bool],
        limit: np.ndarray,
    ) -> None:
        """While the clean costs are being taken: a layer that moved from rank ``s`` to rank
        ``r`` has run on both under the same conditions, and how much faster it runs on one
        (beyond both ranks' noise) is how much slower the other ran all along: a job that
        shared that device from the run's start. Without this, every layer that device held
        took its slowed time as its clean cost, the device read 1.0x, and the model priced
        any layer moved onto it at its clean cost (a 2-stage resnet50 under a 3-job
        ``train`` from step 0 stopped at 14|4, 72.5 ms a step, against 17|1 at 64.0). Read
        on the layers' own timers (a share of a stage's time carries the stage's overhead:
        on 2 x H200 vgg16's layers read 30% more as shares of the first stage than of the
        second, with nothing slowing either). Not from a rank whose last reading raised a
        change not yet confirmed: a layer moved off a stage in a spike's window would take
        the spike for the device's lasting slowdown."""
        now = self.raw_f + self.raw_b
        pairs: dict[tuple[int, int], list[float]] = {}
        for (a, b), r in zip(w.bounds, w.ranks, strict=True):
            for i in range(a + 1 if a > 0 else a, b):
                s = int(was_owner[i])
                if s < 0 or s == r or was_suspect[s] or (i > 0 and was_owner[i - 1] != s):
                    # Not moved, or the first layer of a stage there or here: on a GPU its
                    # timer also holds the wait for the stage's input (on 2 x H200 vgg16's
                    # conv3_1 read 0.57 ms as stage 1's first layer and 0.40 inside stage 0).
                    continue
                if np.isfinite(was_raw[i]) and np.isfinite(now[i]):
                    pairs.setdefault((s, r), []).append(float(np.log(was_raw[i] / now[i])))
        for (s, r), logs in pairs.items():
            q = float(np.median(logs))
            if abs(q) <= limit[s] + limit[r]:
                continue
            slow, fast = (s, r) if q > 0 else (r, s)
            was = float(self.src_scale[slow])
            self.src_scale[slow] = self.src_scale[fast] * float(np.exp(abs(q)))
            # What the device read so far was read against the slowed clean costs: the
            # conditions it ran under read as they do now. Left at 1.0, they made the
            # interferer's end read as the run's first conditions come back (2 x H200, vgg16
            # 256 under ``gemm`` from step 1: the split measured in the first steps, 4|12 at
            # 130.8 ms under the interferer, barred the move back to it after the end).
            f = float(self.src_scale[slow]) / was
            for total, _ in self._regime_loads.values():
                total[slow] *= f
            for seen in self._seen_loads:
                seen[slow] *= f

    def _learn_load(self, r: int, u_now: float, s_then: float, ratio: float, limit: float) -> None:
        """Learn rank ``r``'s load coefficient from a move's first window: its busy fraction
        went from ``busy[r]`` to ``u_now``, and its stage's reading over the clean cost of
        what the stage holds from ``s_then`` to ``ratio`` times that. Only a device read
        slowed by twice its change threshold (``limit``, a log ratio: ``jump``, or three
        standard deviations of its noise) says anything: in the controller simulator,
        swinging timers that read clean devices 1.3-1.8x taught them coefficients of 0.1.

        The whole stage, not the layers it kept: on a time-sliced device a layer's sampled
        time is either its clean time or that plus a slice of the interferer's (bert under
        ``gemm`` on 2 x H200: a block's forward read 1.1 or 2.9 ms from one layer to the
        next), so the kept layers' share of one sampled step moved the coefficient by 0.3-0.6
        between two launches of one configuration (0.29 and 0.89 from readings 1% apart;
        the sweep's readings say 0.7). The stage's medians over the window do not depend on
        which layers a slice fell in.

        A slowed device's excess over clean scales with ``g(u) = c + (1 - c) u``: on 2 x
        H200 under ``gemm``, gpt's slowed stage ran 1.7x its clean time when a split kept it
        15% busy and 2.05x at 85% (the oracle sweeps, ``bench/sweep_slowdown.py``). A move
        that takes layers off such a device lowers the reading of the layers it keeps, and
        the planner, pricing the device at that reading, gave them back: vgg16 under
        ``train`` read 1.74x at 5|11 and 1.40x at 8|8, the planner priced 6|10 at 1.40x, and
        it ran 1.81x. The stage's overhead counts with its layers: a time-sliced device's
        interference shows largely there (between the layers). Such a change still counts
        as a change of conditions if the next window confirms it (``update``); the
        coefficient outlives that. Such a change is not taken for the load's alone (no change
        of conditions): replayed over the 75 committed adaptive logs, doing so changed 34
        decisions, 12 of them to splits their runs' sweeps timed slower (against 2 of 14
        with this rule), for the regimes it merged mixed the measurements of conditions the
        timers could not tell apart."""
        u_then = float(self.busy[r])
        if not np.isfinite(u_then) or abs(u_now - u_then) < _LOAD_DU:
            return
        if np.log(max(s_then, 1e-9)) < 2.0 * limit:
            return
        q = (ratio * s_then - 1.0) / (s_then - 1.0)  # g(u_now) / g(u_then)
        den = (1.0 - u_now) - q * (1.0 - u_then)
        if abs(den) > 1e-9:
            c = float(np.clip((q * u_then - u_now) / den, _LOAD_C_MIN, 1.0))
            weight = abs(u_now - u_then)
            self._load_sum[r] += weight * c
            self._load_weight[r] += weight

    @property
    def load_c(self) -> np.ndarray:
        """``[R]`` each rank's load coefficient, as learned since its conditions last
        changed (1: its slowdown does not depend on its load, the prior until a move shows
        otherwise)."""
        w = self._load_weight
        return np.where(w > 0, self._load_sum / np.maximum(w, 1e-12), 1.0)

    def load_factor(self, u_now: np.ndarray, u_new: np.ndarray) -> np.ndarray:
        """``[R]`` how much slower each rank runs its stage at busy fraction ``u_new`` than
        at ``u_now`` (both ``[R]``): the excess of its reading (``load``, the stage's whole
        time over clean) scales with ``g``."""
        c, s = self.load_c, np.maximum(self.load, 1.0)
        g_now = np.maximum(_load_g(c, np.clip(u_now, 0.0, 1.0)), _LOAD_G_MIN)
        out = (1.0 + (s - 1.0) * _load_g(c, np.clip(u_new, 0.0, 1.0)) / g_now) / s
        # A light rank's reading is its probe's, one layer timed on its own, not its stage's
        # at the stage's busy fraction: no load to scale it from.
        return np.where(self._light_n > 0, 1.0, out)

    def _slowdown(self, a: int, b: int) -> float:
        run = self.run_f[a:b].sum() + self.run_b[a:b].sum()
        clean = self.clean_f[a:b].sum() + self.clean_b[a:b].sum()
        return float(run / max(clean, 1e-12))

    def _share_classes(self, w: Window, limit: np.ndarray) -> None:
        """Identical layers get one clean cost: the median over all members, unless the
        members one rank holds run clearly faster than that (beyond that rank's noise), which
        shows the others are slowed: then theirs."""
        for c in np.unique(self.classes):
            members = np.flatnonzero(self.classes == c)
            if len(members) < 2:
                continue
            total = self.clean_f[members] + self.clean_b[members]
            med = float(np.median(total))
            pick = members
            for (a, b), r in zip(w.bounds, w.ranks, strict=True):
                idx = members[(members >= a) & (members < b)]
                if len(idx):
                    mine = float(np.median(self.clean_f[idx] + self.clean_b[idx]))
                    if mine < med * np.exp(-limit[r]):
                        med, pick = mine, idx
            self.clean_f[members] = float(np.median(self.clean_f[pick]))
            self.clean_b[members] = float(np.median(self.clean_b[pick]))

    # ---- what the planner needs --------------------------------------------------------
    def costs(
        self,
        bounds: tuple[tuple[int, int], ...],
        ranks: tuple[int, ...],
        *,
        predicted: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer fwd/bwd ms per microbatch of every layer on every rank, ``[R, L]``.

        A layer on the rank that holds it costs what it measures there (identical layers on
        a rank that reads slowed beyond its noise: their mean, ``_pooled``). Elsewhere it costs
        its clean cost times that rank's slowdown: uniform (``predicted`` None), or the
        predicted per-layer slowdowns ``predicted = (fwd [R, L], bwd [R, L])`` scaled per
        rank so that they reproduce what the rank's held layers measure (a light rank's:
        what its probe measures, ``_read_light``).

        The slowdown counts the stage's time between its layers beyond its clean overhead
        as the layers' own: a time-sliced device's interference lands largely there, so a
        layer moved onto it brings its share of that excess. vgg16 256 under ``gemm`` on 2 x
        H200 read stage 1's layers at 0.93x clean and the stage at 1.91x; priced at 0.93x,
        6|10 promised 6% over 7|9, and the sweep timed it 4% slower. (Until this, a load
        coefficient near 0 learned from the layers' own readings hid that error.)
        """
        n_r = len(self.slow)
        limit = self.threshold()
        fwd = np.empty((n_r, self.num_layers))
        bwd = np.empty((n_r, self.num_layers))
        for (a, b), r in zip(bounds, ranks, strict=True):
            # The stage's time over clean beyond its layers' timers (between them, where a
            # time-sliced device's interference lands) goes with the work.
            excess = self.over_f[r] + self.over_b[r] - self.clean_of[r] - self.clean_ob[r]
            if self._light_n[r] > 0:
                excess = 0.0  # read by its probe (below), not by its stage's time
            clean_held = self.clean_f[a:b].sum() + self.clean_b[a:b].sum()
            if predicted is None:
                s_eff = self.slow[r] + excess / max(clean_held, 1e-12)
                fwd[r], bwd[r] = self.clean_f * s_eff, self.clean_b * s_eff
            else:
                pf, pb = predicted[0][r], predicted[1][r]
                held = self.run_f[a:b].sum() + self.run_b[a:b].sum() + excess
                guess = (self.clean_f[a:b] * pf[a:b]).sum() + (self.clean_b[a:b] * pb[a:b]).sum()
                if self._light_n[r] > 0:
                    # A light rank's layers cannot show its device: its probe layer does.
                    i = int(self._light_layer[r])
                    held = self._light_level[r] * (self.clean_f[i] + self.clean_b[i])
                    guess = self.clean_f[i] * pf[i] + self.clean_b[i] * pb[i]
                kappa = held / max(guess, 1e-12)
                fwd[r], bwd[r] = self.clean_f * pf * kappa, self.clean_b * pb * kappa
            # Slices land on some kernels and not others only where another process shares
            # the device: there, identical layers are priced at their mean (``_pooled``).
            if self.load[r] > np.exp(limit[r]):
                fwd[r, a:b] = _pooled(self.run_f, self.classes, a, b)
                bwd[r, a:b] = _pooled(self.run_b, self.classes, a, b)
            else:
                fwd[r, a:b], bwd[r, a:b] = self.run_f[a:b], self.run_b[a:b]
        return fwd, bwd

    def overheads(self, ranks: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Per-microbatch stage overhead of each stage (in ``ranks`` order)."""
        idx = list(ranks)
        return self.over_f[idx].copy(), self.over_b[idx].copy()

    # ---- persistence (the restart baseline's relaunch) ---------------------------------
    def state(self) -> dict[str, Any]:
        keys = (
            "clean_f", "clean_b", "run_f", "run_b", "n", "owner",
            "over_f", "over_b", "clean_of", "clean_ob", "slow", "load",
            "host_f", "host_b", "raw_f", "raw_b", "src_scale", "busy", "_load_sum",
            "_load_weight",
        )  # fmt: skip
        out: dict[str, Any] = {k: _jsonable(getattr(self, k)) for k in keys}
        out["calibrated"] = self.calibrated
        out["steps"] = self.steps
        out["regime"] = self.regime
        out["regimes"] = self._regimes
        out["regime_loads"] = {
            str(k): [_jsonable(t), c] for k, (t, c) in self._regime_loads.items()
        }
        out["calibrating"] = self._calibrating
        out["last_known"] = self._last_known
        return out

    def load_state(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            if k == "calibrated":
                self.calibrated = bool(v)
            elif k == "regime":
                self.regime = int(v)
            elif k == "regimes":
                self._regimes = int(v)
            elif k == "calibrating":
                self._calibrating = bool(v)
            elif k == "last_known":
                self._last_known = None if v is None else int(v)
            elif k == "regime_loads":
                self._regime_loads = {
                    int(rid): (np.array(t, float), int(c)) for rid, (t, c) in v.items()
                }
            elif k == "steps":
                self.steps = [list(map(float, xs)) for xs in v]
            elif k == "owner":
                self.owner = np.array(v, dtype=int)
            else:
                setattr(self, k, np.array([np.nan if x is None else x for x in v], float))


def _jsonable(a: np.ndarray) -> list:
    return [None if isinstance(x, float) and x != x else x for x in a.tolist()]
