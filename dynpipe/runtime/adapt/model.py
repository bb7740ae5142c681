"""``ModelPolicy``: the adaptation core as a model of its own uncertainty (``--adapt-core
model``).

One window at a time:

1. **Readings.** Each stage's compute per microbatch is the median of the window's steps
   (its spread gives the reading's own noise); the sampled step's per-layer times give the
   stage's shape, scaled to that median.
2. **Layer costs.** A layer's clean cost is the mean of its readings while its device was in
   its first segment, pooled over identical layers (``layer_classes``). A layer held by a
   device costs its clean cost times the device's slowdown times its own measured ratio to
   that slowdown there; a layer elsewhere, its clean cost times the device's slowdown (times,
   in ``adaptive`` mode, the predictor's per-layer slowdown relative to the layers the device
   holds: the predictor answers only how a layer would slow where it is not measured).
3. **Devices.** Each device's log-slowdown is filtered (``belief.Device``): learned
   observation noise, change points from standardised innovations, segments that return.
4. **Plans.** Per segment (one per device, together), each plan's measured log step time.
   A candidate's step time relative to the current plan's is the cost model's ratio, with a
   variance from the model's learned error on past moves and from the device beliefs'
   variances; where the candidate was measured in this segment, that measurement is
   combined with it. A model that misleads widens its own interval and stops moving.
5. **The rule** (``belief.move_lcb``): move to the candidate whose lower confidence bound of
   ``horizon * (T_now - T_candidate) - pause`` is largest, iff it is positive.

Its whole state is one dataclass (``ModelState``), saved and restored by ``state`` /
``load_state``, so a relaunched run decides as the uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynpipe.planner.costs import CostModel
from dynpipe.planner.dp import plan_partition
from dynpipe.planner.plan import PlanError
from dynpipe.runtime.adapt.belief import Device, PlanStat, combine, move_lcb, z_of
from dynpipe.runtime.adapt.config import AdaptConfig
from dynpipe.runtime.adapt.policy import (
    Decision,
    layer_classes,
    moved_bytes,
    predicted_slowdowns,
    predicted_step_ms,
    stage_memory,
)
from dynpipe.runtime.adapt.record import Bounds, as_bounds
from dynpipe.runtime.adapt.window import Window

__all__ = ["ModelPolicy", "ModelState"]


@dataclass
class ModelState:
    """Everything ``ModelPolicy`` learns (plain data; see the module docstring).

    clean_f / clean_b / clean_n: per layer, the sums and count of its clean readings;
    over_f / over_b / over_n: per rank, the same of its stage's fixed overhead; host_f /
    host_b / host_n: per layer, the host's issue time (GPU runs); rho / rho_n: per rank and
    layer, the sum and count of a held layer's ratio to its device's slowdown in the device's
    segment; seg_f / seg_b / seg_n: per rank, its stage overhead's sums and count in the
    device's segment (an interferer's stall per action lands there, not in the layers); devices: the device beliefs; plans: ``[segments, plan, mean, n]`` rows;
    step_r / step_n: learned variance of one window's log step time about its plan's mean;
    errors: the model's misses on past moves (measured minus predicted log gain);
    move_r / move_n: learned variance of a device's level across a move of its load;
    track / track_r / track_n: ``[plan, residual]`` of the last window (measured log step
    less the model's) and the learned variance of its change from window to window under
    one plan (timers that swing while the steps do not make it large);
    pauses: measured pauses; pending: ``[plan left, predicted log gain, its mean log step,
    segments, first step, plan taken]`` of the move decided, until judged; last_key: the plan of the last trusted
    window (None right after a move); settle: windows still to ignore.
    """

    clean_f: list[float] = field(default_factory=list)
    clean_b: list[float] = field(default_factory=list)
    clean_n: list[float] = field(default_factory=list)
    over_f: list[float] = field(default_factory=list)
    over_b: list[float] = field(default_factory=list)
    over_n: list[float] = field(default_factory=list)
    host_f: list[float] = field(default_factory=list)
    host_b: list[float] = field(default_factory=list)
    host_n: list[float] = field(default_factory=list)
    rho: list[list[float]] = field(default_factory=list)
    rho_n: list[list[float]] = field(default_factory=list)
    seg_f: list[float] = field(default_factory=list)
    seg_b: list[float] = field(default_factory=list)
    seg_n: list[float] = field(default_factory=list)
    devices: list[Device] = field(default_factory=list)
    plans: list[list[Any]] = field(default_factory=list)
    step_r: float = 0.0
    step_n: int = 0
    errors: list[float] = field(default_factory=list)
    move_r: float = 0.0
    move_n: int = 0
    track: list[Any] | None = None
    track_r: float = 0.0
    track_n: int = 0
    pauses: list[float] = field(default_factory=list)
    pending: list[Any] | None = None
    last_key: list[list[int]] | None = None
    settle: int = 0


def _dump(state: ModelState) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(state)))


def _load(d: dict[str, Any]) -> ModelState:
    d = dict(d)
    d["devices"] = [Device(**x) for x in d.get("devices", [])]
    return ModelState(**d)


class ModelPolicy:
    """The model core for one pipeline over a fixed set of ranks (see the module docstring).

    base: the model's cost model (layer names, state bytes, links; its per-layer times are
        only the shape of a stage none of whose layers was timed).
    predictor / prepared: a loaded slowdown predictor and its prepared layers (``adaptive``).
    """

    def __init__(
        self,
        *,
        base: CostModel,
        config: AdaptConfig,
        num_ranks: int,
        predictor: Any = None,
        prepared: Any = None,
    ) -> None:
        self.config, self.base, self.num_ranks = config, base, num_ranks
        self.predictor, self.prepared = predictor, prepared
        use = config.mode in ("adaptive", "restart") and predictor is not None
        self.mode_used = "adaptive" if use else "measured"
        self.classes = layer_classes(base)
        self.z = z_of(config.confidence)
        self.st = ModelState(settle=config.settle_windows)
        self.predict_ms: float | None = None

    def describe(self) -> str:
        return (
            f"{self.config.mode} (model core): per-device slowdown beliefs, plan step-time "
            f"beliefs; move when the {self.config.confidence:.0%} lower bound of the gain "
            f"over {self.config.horizon_steps} steps beats the pause"
        )

    # ---- persistence ---------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return _dump(self.st)

    def load_state(self, state: dict[str, Any]) -> None:
        if state:
            self.st = _load(state)

    # ---- after a move ----------------------------------------------------------------------
    def applied(self, *, step: int, pause_ms: float, moved_bytes: int) -> None:
        del moved_bytes
        if self.st.pending is not None:
            self.st.pending[4] = int(step)
        self.st.pauses.append(float(pause_ms))
        self.st.settle = self.config.settle_windows
        self.st.last_key = None

    # ---- one window ----------------------------------------------------------------------
    def observe(self, window: Window) -> Decision | None:
        self.predict_ms = None
        st = self.st
        if st.settle > 0:
            st.settle -= 1
            return None
        w = window
        key = w.key
        after_move = st.last_key is not None and as_bounds(st.last_key) != key
        after_move = after_move or (st.last_key is None and bool(st.pauses))
        total, noise, lf, lb, of, ob = self._readings(w)
        if not st.devices:
            self._start(w, lf, lb, of, ob)
        segs_before = self._segments()
        r_prior = self._noise_prior()
        for s, (a, b) in enumerate(w.bounds):
            r = w.ranks[s]
            dev = st.devices[r]
            clean = self._clean_stage(r, a, b)
            y = math.log(max(total[s], 1e-9) / max(clean, 1e-9))
            r0 = max(noise[s], self.config.noise_floor**2)
            if after_move:
                # What the move's change of load did to the device's level teaches how far
                # a move may move it (at most 3 sd of that belief per move: an interferer
                # that comes or goes during the move is a change point, not a load effect).
                var = self._move_var()
                inn = min((y - dev.s) ** 2, 9.0 * var) - dev.p - max(dev.r, r0)
                st.move_n += 1
                st.move_r += (max(inn, 0.0) - st.move_r) / min(st.move_n, 16)
                dev.loosen(var)
            seg = dev.seg
            dev.update(y, r0=r0, r_prior=r_prior, change_h=self.config.change_h, check=True)
            if dev.seg != seg:
                self._reset_rho(r)
            self._learn_layers(r, a, b, lf, lb, of[s], ob[s], clean=dev.seg == 0)
        self._learn_host(w)
        segs = self._segments()
        y_step = math.log(max(w.median_step_ms, 1e-9))
        stat = self._stat(segs, key)
        if stat.n and not after_move:
            inn = (y_step - stat.mean) ** 2 * stat.n / (stat.n + 1)
            st.step_n += 1
            st.step_r += (inn - st.step_r) / min(st.step_n, 16)
        stat.add(y_step)
        judged = self._judge(segs_before, segs, y_step)
        st.last_key = [list(x) for x in key]
        return self._decide(w, segs, judged, changed=segs != segs_before)

    # ---- readings ------------------------------------------------------------------------
    def _readings(self, w: Window):
        """Per stage: compute per microbatch (window median), the log variance of that
        median, and per layer / stage the sampled shape scaled to it."""
        m = max(w.microbatches, 1)
        per = (w.stage_fwd_ms + w.stage_bwd_ms) / m  # [k, S]
        total = np.median(per, axis=0)
        k = per.shape[0]
        logs = np.log(np.maximum(per, 1e-9))
        var = logs.var(axis=0, ddof=1) / k if k > 1 else np.zeros(per.shape[1])
        n = w.num_layers
        lf, lb = np.full(n, np.nan), np.full(n, np.nan)
        of, ob = np.zeros(w.num_stages), np.zeros(w.num_stages)
        pf, pb = self.base.fwd_ms[0], self.base.bwd_ms[0]
        for s, (a, b) in enumerate(w.bounds):
            xf = None if w.layer_fwd_ms is None else w.layer_fwd_ms[a:b]
            xb = None if w.layer_bwd_ms is None else w.layer_bwd_ms[a:b]
            timed = xf is not None and xb is not None and np.isfinite(xf).all()
            timed = timed and np.isfinite(xb).all()
            if timed and w.sampled_fwd_ms is not None and w.sampled_bwd_ms is not None:
                sf, sb = float(w.sampled_fwd_ms[s]), float(w.sampled_bwd_ms[s])
                o_f, o_b = max(sf - xf.sum(), 0.0), max(sb - xb.sum(), 0.0)
            elif timed:
                o_f = o_b = 0.0
            else:
                # No layer timed: the prior's shape, no overhead.
                xf, xb, o_f, o_b = pf[a:b], pb[a:b], 0.0, 0.0
            scale = total[s] / max(xf.sum() + xb.sum() + o_f + o_b, 1e-9)
            lf[a:b], lb[a:b] = xf * scale, xb * scale
            of[s], ob[s] = o_f * scale, o_b * scale
        return total, var, lf, lb, of, ob

    def _start(self, w: Window, lf, lb, of, ob) -> None:
        st, n, r = self.st, w.num_layers, self.num_ranks
        st.clean_f, st.clean_b, st.clean_n = [0.0] * n, [0.0] * n, [0.0] * n
        st.over_f, st.over_b, st.over_n = [0.0] * r, [0.0] * r, [0.0] * r
        st.host_f, st.host_b, st.host_n = [0.0] * n, [0.0] * n, [0.0] * n
        st.rho, st.rho_n = [[0.0] * n for _ in range(r)], [[0.0] * n for _ in range(r)]
        st.seg_f, st.seg_b, st.seg_n = [0.0] * r, [0.0] * r, [0.0] * r
        st.devices = [Device() for _ in range(r)]
        # The first window sets every layer's clean cost (pooled over identical layers, so
        # a device slowed from the start reads slow against the others).
        for s, (a, b) in enumerate(w.bounds):
            self._learn_layers(w.ranks[s], a, b, lf, lb, of[s], ob[s], clean=True)

    def _learn_layers(self, r, a, b, lf, lb, o_f, o_b, *, clean: bool) -> None:
        st = self.st
        if clean:
            for i in range(a, b):
                st.clean_f[i] += float(lf[i])
                st.clean_b[i] += float(lb[i])
                st.clean_n[i] += 1
            st.over_f[r] += float(o_f)
            st.over_b[r] += float(o_b)
            st.over_n[r] += 1
        st.seg_f[r] += float(o_f)
        st.seg_b[r] += float(o_b)
        st.seg_n[r] += 1
        dev = st.devices[r]
        cf, cb = self._clean()
        expect = (cf[a:b] + cb[a:b]) * math.exp(dev.s)
        ratio = (lf[a:b] + lb[a:b]) / np.maximum(expect, 1e-12)
        for i, x in zip(range(a, b), ratio, strict=True):
            st.rho[r][i] += float(x)
            st.rho_n[r][i] += 1

    def _learn_host(self, w: Window) -> None:
        if w.host_fwd_ms is None or w.host_bwd_ms is None:
            return
        st = self.st
        for i in range(w.num_layers):
            hf, hb = w.host_fwd_ms[i], w.host_bwd_ms[i]
            if np.isfinite(hf) and np.isfinite(hb):
                st.host_f[i] += float(hf)
                st.host_b[i] += float(hb)
                st.host_n[i] += 1

    def _reset_rho(self, r: int) -> None:
        n = len(self.st.clean_f)
        self.st.rho[r], self.st.rho_n[r] = [0.0] * n, [0.0] * n
        self.st.seg_f[r] = self.st.seg_b[r] = self.st.seg_n[r] = 0.0

    def _clean(self) -> tuple[np.ndarray, np.ndarray]:
        """Per layer, the clean fwd / bwd cost, pooled over each class of identical layers."""
        st = self.st
        sf, sb, n = np.array(st.clean_f), np.array(st.clean_b), np.array(st.clean_n)
        out_f, out_b = np.empty_like(sf), np.empty_like(sb)
        for c in np.unique(self.classes):
            idx = self.classes == c
            k = max(n[idx].sum(), 1e-9)
            out_f[idx], out_b[idx] = sf[idx].sum() / k, sb[idx].sum() / k
        return out_f, out_b

    def _overhead(self) -> tuple[np.ndarray, np.ndarray]:
        st = self.st
        n = np.maximum(np.array(st.over_n), 1e-9)
        of, ob = np.array(st.over_f) / n, np.array(st.over_b) / n
        seen = np.array(st.over_n) > 0
        if seen.any():  # a rank that never ran a stage: the mean of those that did
            of[~seen], ob[~seen] = of[seen].mean(), ob[seen].mean()
        return of, ob

    def _clean_stage(self, r: int, a: int, b: int) -> float:
        cf, cb = self._clean()
        of, ob = self._overhead()
        return float(cf[a:b].sum() + cb[a:b].sum() + of[r] + ob[r])

    def _noise_prior(self) -> float:
        """What a device's reading noise is believed to be before it has shown its own:
        the configured prior as one window, pooled with what every device has learned
        (noise is a property of the run: launch-bound timers swing on every stage)."""
        devs = self.st.devices
        n = sum(d.n_r for d in devs)
        return (self.config.noise_prior**2 + sum(d.n_r * d.r for d in devs)) / (1 + n)

    def _move_var(self) -> float:
        """How far a device's level may move when a move changes its load: learned from the
        windows after moves, the model-error prior before any."""
        e2 = self.config.model_error**2
        return (e2 + self.st.move_n * self.st.move_r) / (1 + self.st.move_n)

    def _segments(self) -> list[int]:
        return [d.seg for d in self.st.devices]

    def _stat(self, segs: list[int], key: Bounds) -> PlanStat:
        for row in self.st.plans:
            if row[0] == segs and as_bounds(row[1]) == key:
                return _RowStat(row)
        row = [list(segs), [list(x) for x in key], 0.0, 0]
        self.st.plans.append(row)
        return _RowStat(row)

    def _measured(self, segs: list[int]) -> dict[Bounds, tuple[float, int]]:
        return {as_bounds(r[1]): (r[2], r[3]) for r in self.st.plans if r[0] == segs and r[3]}

    # ---- the model's verdict on its last move ----------------------------------------------
    def _judge(self, before: list[int], segs: list[int], y: float) -> dict[str, Any] | None:
        st = self.st
        if st.pending is None or st.last_key is not None:
            return None
        left, d_pred, y_before, segs_then, step, dst = st.pending
        st.pending = None
        out: dict[str, Any] = {
            "step": step,
            "src": left,
            "dst": dst,
            "before_ms": round(math.exp(y_before), 4),
            "after_ms": round(math.exp(y), 4),
        }
        if segs != segs_then or before != segs_then:
            return {**out, "verdict": "conditions changed"}
        d_meas = y_before - y
        # At most 3 sd of the model's error so far (Huber): one move across a change of
        # conditions the devices did not show must not silence the model for good.
        cap = 3.0 * math.sqrt(self._model_var())
        st.errors.append(max(-cap, min(cap, d_meas - d_pred)))
        return {
            **out,
            "verdict": "faster" if d_meas > 0 else "slower",
            "predicted_gain": round(d_pred, 4),
            "achieved_gain": round(d_meas, 4),
        }

    def _model_var(self) -> float:
        """The cost model's error variance on a move's log gain: the prior ``model_error``
        as one pseudo-move, pooled with the misses of the moves made."""
        e = self.st.errors
        return (self.config.model_error**2 + sum(x * x for x in e)) / (1 + len(e))

    # ---- pricing ----------------------------------------------------------------------------
    def _rows(
        self,
        w: Window,
        shift: dict[int, float] | None = None,
        layers: tuple[int, int, float] | None = None,
    ) -> CostModel:
        """The cost model of ``w``'s ranks (rows in stage order), each device at its belief's
        slowdown (``shift``: plus these log amounts; ``layers``: ``(a, b, h)``, the clean
        costs of layers ``[a, b)`` times ``exp(h)``)."""
        st = self.st
        cf, cb = self._clean()
        if layers is not None:
            a, b, h = layers
            cf, cb = cf.copy(), cb.copy()
            cf[a:b] *= math.exp(h)
            cb[a:b] *= math.exp(h)
        of, ob = self._overhead()
        ranks = list(w.ranks)
        rel = self._relative(w, cf, cb)
        f = np.empty((len(ranks), len(cf)))
        b = np.empty_like(f)
        sf, sb = np.empty(len(ranks)), np.empty(len(ranks))
        for k, r in enumerate(ranks):
            g = math.exp(st.devices[r].s + (shift or {}).get(r, 0.0))
            held = np.array(st.rho_n[r]) > 0
            shape = np.where(held, np.array(st.rho[r]) / np.maximum(st.rho_n[r], 1), rel[r])
            f[k], b[k] = cf * g * shape, cb * g * shape
            if st.seg_n[r] > 0:
                sf[k], sb[k] = st.seg_f[r] / st.seg_n[r], st.seg_b[r] / st.seg_n[r]
            else:
                sf[k], sb[k] = of[r] * g, ob[r] * g
        out = dataclasses.replace(
            self.base.for_devices(len(ranks)),
            fwd_ms=f,
            bwd_ms=b,
            stage_fwd_ms=sf,
            stage_bwd_ms=sb,
        )
        n = np.array(st.host_n)
        if (n > 0).any():
            hf = np.array(st.host_f) / np.maximum(n, 1)
            hb = np.array(st.host_b) / np.maximum(n, 1)
            out = dataclasses.replace(
                out,
                host_fwd_ms=np.repeat(hf[None], len(ranks), axis=0),
                host_bwd_ms=np.repeat(hb[None], len(ranks), axis=0),
            )
        return out

    def _relative(self, w: Window, cf: np.ndarray, cb: np.ndarray) -> np.ndarray:
        """``[R, L]`` each layer's slowdown on each device relative to the device's level:
        1, or (``adaptive``) the predictor's, over its mean on the layers the device holds."""
        ones = np.ones((self.num_ranks, len(cf)))
        if self.mode_used != "adaptive" or not w.telemetry:
            return ones
        t0 = time.perf_counter()
        pf, pb = predicted_slowdowns(self.predictor, self.prepared, cf, cb, list(w.telemetry))
        self.predict_ms = (time.perf_counter() - t0) * 1e3
        work = cf + cb
        p = (pf * cf + pb * cb) / np.maximum(work, 1e-12)
        out = ones.copy()
        for s, (a, b) in enumerate(w.bounds):
            r = w.ranks[s]
            if r < p.shape[0]:
                level = float((p[r, a:b] * work[a:b]).sum() / max(work[a:b].sum(), 1e-12))
                out[r] = p[r] / max(level, 1e-9)
        return out

    def _log_gain(
        self,
        w: Window,
        cand: Bounds,
        shift: dict[int, float] | None = None,
        layers: tuple[int, int, float] | None = None,
    ) -> float:
        """The cost model's ``log T_now - log T_cand`` (``shift``, ``layers``: ``_rows``)."""
        rows = self._rows(w, shift, layers)
        kw = {"schedule": w.schedule, "microbatches": w.microbatches}
        now = predicted_step_ms(rows, w.bounds, **kw)
        new = predicted_step_ms(rows, cand, **kw)
        return math.log(max(now, 1e-9) / max(new, 1e-9))

    def _state_var(self, w: Window, cand: Bounds, d: float) -> float:
        """The variance the device beliefs give the predicted log gain (each device's
        standard deviation as a finite difference)."""
        out = 0.0
        for r in w.ranks:
            sd = math.sqrt(self.st.devices[r].p)
            if sd > 1e-4:
                h = min(sd, 0.5)
                out += ((self._log_gain(w, cand, {r: h}) - d) / h) ** 2 * sd * sd
        return out

    def _clean_var(self, w: Window, cand: Bounds, d: float) -> float:
        """The variance the clean costs give the predicted log gain. The clean cost of the
        layers a stage holds is the mean of what its device's timers read of them, so it
        carries that device's reading noise over the readings averaged (identical layers
        pooled): a timer that reads 30% high prices those layers 30% high on every device.
        Each stage's layers as one finite difference."""
        st = self.st
        r_prior = self._noise_prior()
        n = np.array(st.clean_n)
        pooled = np.empty_like(n)
        for c in np.unique(self.classes):
            idx = self.classes == c
            pooled[idx] = n[idx].sum()
        out = 0.0
        for s, (a, b) in enumerate(w.bounds):
            var = st.devices[w.ranks[s]].noise(r_prior) / max(float(pooled[a:b].mean()), 1.0)
            sd = math.sqrt(var)
            if sd > 1e-4:
                h = min(sd, 0.5)
                out += ((self._log_gain(w, cand, layers=(a, b, h)) - d) / h) ** 2 * var
        return out

    # ---- the decision -----------------------------------------------------------------------
    def _track(self, w: Window, cur_ms: float, *, changed: bool) -> None:
        """The step time as an observation of the device beliefs: under one plan, how much
        the model's step moves from window to window beyond the measured step's. Not
        learned across a change point (``changed``): the windows around an onset straddle
        it, so the model's step and the measured one part there for a window by design,
        and one onset's share would distrust the model for the next 16 windows."""
        st = self.st
        e = math.log(max(w.median_step_ms, 1e-9) / max(cur_ms, 1e-9))
        key = [list(x) for x in w.key]
        if st.track is not None and st.track[0] == key and not changed:
            st.track_n += 1
            st.track_r += ((e - st.track[1]) ** 2 / 2 - st.track_r) / min(st.track_n, 16)
        st.track = [key, e]

    def _decide(
        self, w: Window, segs: list[int], judged: dict[str, Any] | None, *, changed: bool
    ) -> Decision:
        cfg, st = self.config, self.st
        kw = {"schedule": w.schedule, "microbatches": w.microbatches}
        rows = self._rows(w)
        cur_ms = predicted_step_ms(rows, w.bounds, **kw)
        self._track(w, cur_ms, changed=changed)
        measured = self._measured(segs)
        y_now, n_now = measured[w.key]
        now_ms = math.exp(y_now)
        step_var = max(st.step_r, w.step_noise**2, cfg.noise_floor**2)
        cands: set[Bounds] = {b for b in measured if b != w.key}
        try:
            res = plan_partition(
                rows, num_stages=w.num_stages, memory_bytes=stage_memory(self.base, w), **kw
            )
            cands.add(tuple((int(a), int(b)) for a, b in res.bounds))
        except PlanError:
            pass
        cands.discard(w.key)
        pause = float(np.mean(st.pauses)) if st.pauses else w.median_step_ms
        best: tuple[float, Bounds, float, float] | None = None
        for c in sorted(cands):
            d = self._log_gain(w, c)
            var = self._model_var() + st.track_r + self._state_var(w, c, d)
            var += self._clean_var(w, c, d)
            if c in measured:
                y_c, n_c = measured[c]
                d, var = combine(d, var, y_now - y_c, step_var / n_now + step_var / n_c)
            lcb = move_lcb(
                now_ms=now_ms, d=d, var_d=var, pause_ms=pause, horizon=cfg.horizon_steps, z=self.z
            )
            if best is None or lcb > best[0]:
                best = (lcb, c, d, var)
        slow = tuple(float(math.exp(dev.s)) for dev in st.devices)
        move = best is not None and best[0] > 0
        if best is None:
            reason = "no other plan fits"
        elif move:
            reason = f"gain beats the pause at {cfg.confidence:.0%} (bound {best[0]:.1f} ms)"
        else:
            reason = f"no plan's gain beats the pause at {cfg.confidence:.0%}"
        proposed = cur_ms * math.exp(-best[2]) if best is not None else cur_ms
        nbytes = moved_bytes(self.base.state_bytes, w.bounds, best[1], w.ranks) if move else 0
        if move:
            dst = [list(x) for x in best[1]]
            st.pending = [[list(x) for x in w.key], best[2], y_now, list(segs), w.step + 1, dst]
        return Decision(
            step=w.step + 1,
            mode=self.mode_used,
            slowdown=slow,
            current_ms=cur_ms,
            proposed_ms=proposed,
            pause_ms=pause,
            moved_bytes=nbytes,
            repartition=move,
            reason=reason,
            bounds=best[1] if move else None,
            judged=judged,
        )


class _RowStat(PlanStat):
    """A ``PlanStat`` that writes through to its ``ModelState.plans`` row."""

    def __init__(self, row: list[Any]) -> None:
        super().__init__(mean=row[2], n=row[3])
        self._row = row

    def add(self, y: float) -> None:
        super().add(y)
        self._row[2], self._row[3] = self.mean, self.n
