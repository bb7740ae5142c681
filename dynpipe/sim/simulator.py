"""Controller simulator: the real policy against the exact oracle, on hundreds of scenarios.

A scenario is a model's true per-layer costs on every device over time: clean, or under an
interference condition that starts and ends at some step on one or two devices (any stage).
The true costs come from the offline profiles (``profiles/*.parquet``: every layer's forward
and backward measured alone and beside real interferers, with the telemetry seen then), so
layers slow by different amounts under different interferers exactly as they did on the
card. A slowed device shows that slowdown in full only when the plan keeps it busy: its
excess over clean scales with ``c + (1 - c) u``, ``u`` its stage's busy fraction under the
plan, ``c`` per device drawn by interferer kind from the range the committed oracle sweeps
show (``_LOAD_C``; ``--flat-slowdown``: 1, every split seeing the profile's slowdown, the
simulator's truth until load dependence was measured). Measurement noise comes from real
run logs: each device's stage-time swings follow a stretch of a recorded static run (per
step, relative to its median; within-run swings of up to 2x included), plus a per-layer
jitter on the sampled step. A move pauses training for a
fixed part plus its bytes over the link, drawn per scenario around what recorded
repartitions cost.

Blind stages (``--blind``): on a time-sliced GPU a stage holding very little work (an
embedding alone) runs its short kernels between an interferer's, at clean speed, and its
timers read so, while a heavy layer moved back there would run slowed (4 x H200, gpt 12 x
2048, three ``gemm`` processes). A blind scenario models that: a stage holding less than
the light share of one probe layer's clean work (``CostEstimates.light_probes``, on the
true clean costs) runs and reads clean whatever its device's condition. Light ranks probe
their device as the runtime's do (the policy's ``light_probes``): on each window's sampled
step one microbatch of the probe layer at its true cost there, with the per-layer jitter
and, as an action of its own, the condition's stall per action (its timed share);
a light first stage's probe delays that step by its time (a later stage's hides in the
pipeline's fill). ``--no-light-probes`` runs the policy without them (what it did before).

The policy under test is the one the runtime uses (``make_policy``), fed ``Window`` objects
built the way the training loop builds them. Per scenario the simulator reports the mean
step time (pauses included) of the policy, of the initial plan held throughout (static),
and of the oracle: per phase (a stretch of constant conditions), the static split that is
best over that phase, with zero pause: from an exact plan on the phase's true mean costs,
or where slowdowns follow the load, every split of 2 stages timed and, with more, a local
search around the exact plan (``_oracle``).

    python -m dynpipe.sim.simulator --scenarios 300 --modes measured adaptive
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dynpipe.planner.costs import CostModel
from dynpipe.planner.dp import plan_partition
from dynpipe.planner.simulate import step_times
from dynpipe.runtime.adapt.config import AdaptConfig
from dynpipe.runtime.adapt.estimates import _LIGHT, median_work_layer
from dynpipe.runtime.adapt.policy import Decision, Policy, moved_bytes
from dynpipe.runtime.adapt.record import Bounds
from dynpipe.runtime.adapt.window import Window
from dynpipe.runtime.records import glob_logs, log_stem, open_text

__all__ = [
    "NoiseTrace",
    "Scenario",
    "ScenarioResult",
    "Workload",
    "load_workloads",
    "noise_from_logs",
    "quiet_timers",
    "random_scenarios",
    "simulate",
    "summarise",
]

CLEAN = "none"
DEFAULT_PROFILES = ("profiles/h200-bs32.parquet", "profiles/h200-bs64.parquet")
DEFAULT_LOGS = "analysis/logs"


@dataclass(frozen=True, eq=False)
class Workload:
    """One model at one microbatch size on one kind of device, as profiled.

    base: what the policy knows before measuring (FLOP-based prior costs, layer bytes,
        links); times: condition -> true (fwd ``[L]``, bwd ``[L]``) ms per microbatch;
    telemetry: condition -> the ``tel_*`` readings seen under it; overhead_ms: a stage's
        fixed cost per microbatch beyond its layers; rows: the profile's clean rows (what a
        predictor needs of each layer).
    """

    name: str
    base: CostModel
    times: dict[str, tuple[np.ndarray, np.ndarray]]
    telemetry: dict[str, dict[str, float]]
    overhead_ms: float
    rows: Any = None

    @property
    def conditions(self) -> list[str]:
        return [c for c in self.times if c != CLEAN]

    @property
    def num_layers(self) -> int:
        return self.base.num_layers


def load_workloads(paths: Sequence[str | Path] = DEFAULT_PROFILES) -> list[Workload]:
    """Every (model, batch size) of the profile datasets ``paths``."""
    import pandas as pd

    from dynpipe.devices.columns import TELEMETRY_COLUMNS

    out = []
    df = pd.concat([pd.read_parquet(_path(p)) for p in paths], ignore_index=True)
    for (model, bs), g in df.groupby(["model", "batch_size"], sort=True):
        g = g.sort_values("layer_index")
        times = {}
        for cond, c in g.groupby("condition"):
            f = c[c.phase == "fwd"].set_index("layer_index")["time_ms"].sort_index()
            b = c[c.phase == "bwd"].set_index("layer_index")["time_ms"].sort_index()
            times[str(cond)] = (f.to_numpy(float), b.to_numpy(float))
        tel = {
            str(cond): {k: float(v) for k, v in c[list(TELEMETRY_COLUMNS)].mean().items()}
            for cond, c in g.groupby("condition")
        }
        one = g[(g.condition == CLEAN) & (g.phase == "fwd")].sort_values("layer_index")
        bwd = g[(g.condition == CLEAN) & (g.phase == "bwd")].sort_values("layer_index")
        # The prior a run starts from: FLOPs at a nominal rate (what the analytic model knows).
        rate = 200e12 / 1e3
        n = len(one)
        base = CostModel(
            model=f"{model}-bs{bs}",
            layer_names=tuple(one["layer"]),
            fwd_ms=np.maximum(one["flops"].to_numpy(float) / rate, 1e-3),
            bwd_ms=np.maximum(bwd["flops"].to_numpy(float) / rate, 1e-3),
            param_bytes=one["param_bytes"].to_numpy(float),
            out_bytes=one["out_bytes"].to_numpy(float),
            act_bytes=one["out_bytes"].to_numpy(float),
            opt_mult=np.full(n, 2.0),
            buffer_bytes=np.zeros(n),
            bandwidth=np.zeros(0),
            latency_ms=np.zeros(0),
            microbatch_size=int(bs),
            meta={"link_bandwidth": 100e9, "link_latency_ms": 0.02},
        )
        clean = times[CLEAN][0] + times[CLEAN][1]
        out.append(
            Workload(
                name=f"{model}-bs{bs}",
                base=base,
                times=times,
                telemetry=tel,
                overhead_ms=float(0.02 * clean.sum() / n),
                rows=g[g.condition == CLEAN].reset_index(drop=True),
            )
        )
    return out


def _path(p: str | Path) -> Path:
    """A data path as given (relative ones to the working directory: the command line and
    the tests run from the repository root)."""
    return Path(p)


@dataclass(frozen=True, eq=False)
class NoiseTrace:
    """How one stage of a recorded static run varied from step to step (median 1 each).

    real: the run's step time over its median: what the device really did (a stage timer
    alone cannot say it: in the recorded runs a stage's compute timer swung up to 2.3x while
    the step swung 1.2x, the timers carrying the pipeline's waits). meas: the stage timer
    over its median, divided by ``real``: what measurement adds on top.
    """

    name: str
    real: np.ndarray
    meas: np.ndarray


def noise_from_logs(root: str | Path = DEFAULT_LOGS) -> list[NoiseTrace]:
    """Every stage of every static GPU run under ``root`` (its header's backend is
    ``nccl``: a CPU run's timers are not a GPU's), over its clean steps."""
    out = []
    for path in glob_logs(_path(root), "**/*static*"):
        steps, onset = [], None
        with open_text(path) as fh:
            lines = fh.readlines()
        if not lines or json.loads(lines[0]).get("backend") != "nccl":
            continue
        for line in lines:
            if '"interference_start"' in line and onset is None:
                onset = json.loads(line)["step"]
            elif line.startswith('{"type": "step"'):
                steps.append(json.loads(line))
        clean = [r for r in steps if r["step"] >= 10 and (onset is None or r["step"] < onset)]
        if len(clean) < 30:
            continue
        comp = np.array([[s["fwd_ms"] + s["bwd_ms"] for s in r["stages"]] for r in clean])
        step = np.array([r["step_ms"] for r in clean])
        real = step / np.median(step)
        for s in range(comp.shape[1]):
            x = comp[:, s] / np.median(comp[:, s])
            out.append(NoiseTrace(f"{path.parent.name}/{log_stem(path)}#{s}", real, x / real))
    return out


@dataclass(frozen=True)
class Scenario:
    """One run: ``events[d]`` lists ``(start, stop, condition)`` on rank ``d``."""

    seed: int
    workload: str
    stages: int
    microbatches: int
    steps: int
    events: tuple[tuple[tuple[int, int, str], ...], ...]
    noise: tuple[tuple[int, int], ...]  # per rank: (trace index, offset)
    pause_fixed_ms: float
    link_bytes_per_ms: float
    stall: float = 0.0
    untimed: float = 0.0
    blind: bool = False
    # Per rank, how a slowed device's excess over clean follows its busy fraction u: it
    # scales with ``c + (1 - c) u`` (1: it does not; empty: 1 on every rank).
    load_c: tuple[float, ...] = ()

    def coefficient(self, rank: int) -> float:
        return float(self.load_c[rank]) if self.load_c else 1.0

    def condition(self, rank: int, step: int) -> str:
        for a, b, c in self.events[rank]:
            if a <= step < b:
                return c
        return CLEAN


def random_scenarios(
    n: int,
    *,
    workloads: Sequence[Workload],
    traces: Sequence[NoiseTrace],
    seed: int = 0,
    steps: int = 240,
    stage_counts: Sequence[int] = (2, 4, 8),
    blind: bool = False,
    load_dependent: bool = True,
) -> list[Scenario]:
    """``n`` scenarios: a workload, 2/4/8 stages, one or two slowed ranks (any), onsets and
    ends at random steps (some at the start, some never ending), random conditions;
    ``blind``: light stages run and read clean (see the module docstring);
    ``load_dependent``: each slowed rank's load coefficient drawn by its interferer's kind
    (``_LOAD_C``; else 1 everywhere, the load-independent truth). The coefficients come
    from a generator of their own, so every other draw of a seed is the same either way."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        w = workloads[int(rng.integers(len(workloads)))]
        s = int(rng.choice([c for c in stage_counts if c <= w.num_layers]))
        m = int(s * rng.choice([1, 2]))
        events = draw_events(rng, w.conditions, devices=s, steps=steps)
        noise = draw_noise(rng, traces, devices=s)
        out.append(
            Scenario(
                seed=seed * 100_000 + i,
                workload=w.name,
                stages=s,
                microbatches=m,
                steps=steps,
                events=tuple(events),
                noise=noise,
                pause_fixed_ms=float(rng.uniform(5, 40)),
                stall=float(rng.uniform(0.0, 1.0)),
                untimed=float(rng.uniform(0.0, 0.5)),
                link_bytes_per_ms=float(rng.uniform(10e6, 40e6)),
                blind=blind,
                load_c=_load_coefficients(events, np.random.default_rng([seed, i]))
                if load_dependent
                else (),
            )
        )
    return out


def draw_events(
    rng: np.random.Generator, conditions: Sequence[str], *, devices: int, steps: int
) -> list[tuple[tuple[int, int, str], ...]]:
    """Per device, its ``(start, stop, condition)``: one or two of ``devices`` slowed, from
    a random step (a tenth from the start) to another (a fifth never ending)."""
    slowed = rng.choice(devices, size=int(rng.choice([1, 2], p=[0.6, 0.4])), replace=False)
    events: list[tuple[tuple[int, int, str], ...]] = [() for _ in range(devices)]
    for d in slowed:
        start = 0 if rng.random() < 0.1 else int(rng.integers(10, steps - 20))
        stop = steps if rng.random() < 0.2 else int(rng.integers(start + 10, steps + 1))
        cond = str(rng.choice(conditions))
        events[int(d)] = ((start, stop, cond),)
    return events


def draw_noise(
    rng: np.random.Generator, traces: Sequence[NoiseTrace], *, devices: int
) -> tuple[tuple[int, int], ...]:
    """Per device, ``(trace index, offset)``: one recorded run's noise for every device
    (noise is a property of a configuration: a launch-bound run's timers are noisy on every
    stage), its stages in turn, each device from its own offset."""
    runs = sorted({t.name.rpartition("#")[0] for t in traces})
    run = runs[int(rng.integers(len(runs)))]
    mine = [k for k, t in enumerate(traces) if t.name.rpartition("#")[0] == run]
    return tuple((mine[d % len(mine)], int(rng.integers(1000))) for d in range(devices))


# Per interferer kind, the range a slowed device's load coefficient is drawn from: what the
# committed oracle sweeps show (``bench/sweep_slowdown.py``; the excess over clean of the
# slowed stage at each split's busy fraction): ``gemm`` 0.43-0.55 (gpt 1.7x at u 0.15 and
# 2.05x at 0.85+, vgg16 1.57x at 0.22 and 1.9x at 0.9, bert 1.42x at 0.03 and 1.94x at
# 0.92), drawn a little wider; ``train`` from 0 (vgg16 128: 1.38x at 0.57, 1.59x at 0.86)
# to 1 (bert, vgg16 256); ``copy`` flat (1.40x at every u).
_LOAD_C = {"gemm": (0.4, 0.65), "train": (0.0, 1.0)}
_LOAD_C_OTHER = (0.9, 1.0)


def _load_coefficients(
    events: Sequence[tuple[tuple[int, int, str], ...]], rng: np.random.Generator
) -> tuple[float, ...]:
    """Per rank, the load coefficient of its first event's interferer kind (1: none)."""
    out = []
    for ev in events:
        if not ev:
            out.append(1.0)
            continue
        lo, hi = _LOAD_C.get(ev[0][2].partition("@")[0], _LOAD_C_OTHER)
        out.append(float(rng.uniform(lo, hi)))
    return tuple(out)


class _Truth:
    """True per-step costs of a scenario: per rank ``[T, L]`` fwd / bwd, and overhead.

    Those arrays hold a slowed device's full excess over clean. Under a plan, a rank whose
    load coefficient ``c`` is below 1 shows ``g = c + (1 - c) u`` of it, ``u`` the busy
    fraction the plan gives its stage at each step (``gain``): the plan's step with the full
    excess gives ``u``, and the step is taken again with ``g`` (one fixed-point iteration:
    ``u`` is read under the full excess, so it is a little high where ``c < 1``).
    """

    def __init__(self, sc: Scenario, w: Workload, traces: Sequence[NoiseTrace]) -> None:
        t, n = sc.steps, w.num_layers
        self.fwd = np.empty((sc.stages, t, n))
        self.bwd = np.empty((sc.stages, t, n))
        self._exf = np.zeros((sc.stages, t, n))  # the parts of fwd / bwd that are excess
        self._exb = np.zeros((sc.stages, t, n))
        self.noise = np.empty((sc.stages, t))
        self.meas = np.empty((sc.stages, t))
        stall = np.zeros((sc.stages, t))
        c0f, c0b = w.times[CLEAN]
        per_action = (c0f.sum() + c0b.sum()) / 2 / sc.stages  # a stage's action at an even split
        for d in range(sc.stages):
            k, off = sc.noise[d]
            idx = (off + np.arange(t)) % len(traces[k].real)
            self.noise[d], self.meas[d] = traces[k].real[idx], traces[k].meas[idx]
            for step in range(t):
                cf, cb = w.times[sc.condition(d, step)]
                # A share ``stall`` of what the interferer costs is a stall per action (a
                # time-sliced GPU handing the device to the other process between kernels),
                # the rest slows each layer as profiled.
                extra = (cf.sum() + cb.sum()) / (c0f.sum() + c0b.sum()) - 1.0
                stall[d, step] = sc.stall * extra * per_action
                self.fwd[d, step] = c0f + (1.0 - sc.stall) * (cf - c0f)
                self.bwd[d, step] = c0b + (1.0 - sc.stall) * (cb - c0b)
                self._exf[d, step] = (1.0 - sc.stall) * (cf - c0f)
                self._exb[d, step] = (1.0 - sc.stall) * (cb - c0b)
            self.fwd[d] *= self.noise[d][:, None]
            self.bwd[d] *= self.noise[d][:, None]
            self._exf[d] *= self.noise[d][:, None]
            self._exb[d] *= self.noise[d][:, None]
        self.overhead = (w.overhead_ms + stall) * self.noise  # [S, T]
        self._exo = stall * self.noise  # the overhead's excess: the stall
        self.c = np.array([sc.coefficient(d) for d in range(sc.stages)])
        self.flat = bool(np.all(self.c >= 1.0))
        self._gains: dict[tuple, np.ndarray] = {}
        # The share ``untimed`` of a stall falls between the stage's timed actions (seen on
        # a time-sliced GPU: steps +76% where the stage timers said +56%): in the step,
        # not in what the timers read.
        self.untimed = sc.untimed * stall * self.noise
        # A probe is an action of its own (one forward, one backward): its timers see a
        # stall each, less the share that falls between timed actions.
        self.probe_stall = (1.0 - sc.untimed) * stall * self.noise
        z = np.zeros((sc.stages, t, 1))
        self._cf = np.concatenate([z, np.cumsum(self.fwd, axis=2)], axis=2)
        self._cb = np.concatenate([z, np.cumsum(self.bwd, axis=2)], axis=2)
        self._xf = np.concatenate([z, np.cumsum(self._exf, axis=2)], axis=2)
        self._xb = np.concatenate([z, np.cumsum(self._exb, axis=2)], axis=2)
        self._m, self._base = sc.microbatches, w.base
        self._cache: dict[tuple, np.ndarray] = {}
        # Blind scenarios: what a light stage runs at (clean, with the device's noise), and
        # the work under which a stage is light (the runtime's rule on the true clean costs).
        self._blind = sc.blind
        work = c0f + c0b
        self._light_bar = _LIGHT * float(work[median_work_layer(work)])
        self._work = work
        self.clean_fwd = c0f[None, None, :] * self.noise[:, :, None]
        self.clean_bwd = c0b[None, None, :] * self.noise[:, :, None]
        self.clean_over = w.overhead_ms * self.noise
        self._c0f = np.concatenate([z, np.cumsum(self.clean_fwd, axis=2)], axis=2)
        self._c0b = np.concatenate([z, np.cumsum(self.clean_bwd, axis=2)], axis=2)

    def at_microbatches(self, m: int) -> _Truth:
        """The same devices running ``m`` microbatches a step (a replica's batch share): the
        costs per microbatch are the same, the step and each device's busy fraction not."""
        if m == self._m:
            return self
        out = copy.copy(self)
        out._m, out._gains, out._cache = m, {}, {}
        return out

    def blind(self, a: int, b: int) -> bool:
        """Whether a stage of layers ``[a, b)`` is too light for interference to reach it
        (blind scenarios only): the runtime's light rule on the true clean costs."""
        return self._blind and float(self._work[a:b].sum()) < self._light_bar

    def _stage(self, s: int, a: int, b: int, phase: str, g: np.ndarray | None = None) -> np.ndarray:
        """``[T]`` stage ``s``'s true time per microbatch for layers ``[a, b)``, its device
        showing ``g`` ``[T]`` of its excess (None: all of it)."""
        if self.blind(a, b):
            cum = self._c0f if phase == "fwd" else self._c0b
            return cum[s, :, b] - cum[s, :, a] + self.clean_over[s]
        cum = self._cf if phase == "fwd" else self._cb
        out = cum[s, :, b] - cum[s, :, a] + self.overhead[s]
        if g is not None:
            ex = self._xf if phase == "fwd" else self._xb
            out = out - (1.0 - g) * (ex[s, :, b] - ex[s, :, a] + self._exo[s])
        return out

    def _stages(
        self, bounds: Sequence[tuple[int, int]], gains: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``[T, S]`` fwd and bwd time per microbatch of each stage of ``bounds``, stage
        ``s`` at ``gains[s]`` (None: every device's full excess)."""

        def stages(phase: str) -> np.ndarray:
            return np.stack(
                [
                    self._stage(s, a, b, phase, None if gains is None else gains[s])
                    for s, (a, b) in enumerate(bounds)
                ],
                axis=1,
            )

        return stages("fwd"), stages("bwd")

    def _steps(
        self,
        bounds: Sequence[tuple[int, int]],
        gains: np.ndarray | None,
        stages: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> np.ndarray:
        """``[T]`` the pipeline step of ``bounds`` with each stage at ``gains[s]``
        (``stages``: ``_stages``' answer for them, where already at hand)."""
        f, b_ = stages if stages is not None else self._stages(bounds, gains)
        comm = [float(self._base.out_bytes[hi - 1] / 100e9 * 1e3 + 0.02) for _, hi in bounds[:-1]]
        c = np.tile(np.array(comm), (f.shape[0], 1))
        return step_times(f, b_, c, schedule="1f1b", microbatches=self._m)

    def gain(self, bounds: Sequence[tuple[int, int]]) -> np.ndarray:
        """``[S, T]`` the share of its full excess each stage's device shows under
        ``bounds``: ``c + (1 - c) u`` (see the class docstring); 1 where ``c`` is."""
        key = tuple(bounds)
        if key not in self._gains:
            if self.flat:
                self._gains[key] = np.ones((len(bounds), len(self.noise[0])))
            else:
                f, b_ = self._stages(bounds, None)
                step = self._steps(bounds, None, (f, b_))
                busy = (f + b_).T
                u = np.clip(self._m * busy / np.maximum(step, 1e-9)[None, :], 0.0, 1.0)
                c = self.c[: len(bounds), None]
                self._gains[key] = c + (1.0 - c) * u
        return self._gains[key]

    def step_ms(self, bounds: Sequence[tuple[int, int]]) -> np.ndarray:
        """``[T]`` true step time of ``bounds`` (stage ``s`` on rank ``s``) at every step."""
        key = tuple(bounds)
        if key not in self._cache:
            gains = None if self.flat else self.gain(bounds)
            self._cache[key] = self._steps(bounds, gains)
        return self._cache[key]

    def phase_costs(
        self, bounds: Sequence[tuple[int, int]], a: int, b: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per rank, the mean fwd / bwd ``[L]`` and overhead over steps ``[a, b)`` with each
        device at the share of its excess it shows under ``bounds``."""
        g = self.gain(bounds)[:, a:b]
        fwd = (self.fwd[:, a:b] - (1.0 - g)[:, :, None] * self._exf[:, a:b]).mean(axis=1)
        bwd = (self.bwd[:, a:b] - (1.0 - g)[:, :, None] * self._exb[:, a:b]).mean(axis=1)
        over = (self.overhead[:, a:b] - (1.0 - g) * self._exo[:, a:b]).mean(axis=1)
        return fwd, bwd, over

    def stage_loads(
        self,
        bounds: Sequence[tuple[int, int]],
        step: int,
        ranks: Sequence[int],
        *,
        timed: bool = False,
    ):
        """Per-stage fwd and bwd ms per microbatch at ``step`` (``timed``: what the stage's
        timers read of it)."""
        f, b_, o = [], [], []
        gains = self.gain(bounds)[:, step]
        for s, ((a, b), r) in enumerate(zip(bounds, ranks, strict=True)):
            g = float(gains[s])
            fwd, bwd, over = self.layers(r, step, a, b, g)
            f.append(fwd.sum())
            b_.append(bwd.sum())
            blind = self.blind(a, b)
            o.append(over - (g * self.untimed[r, step] if timed and not blind else 0.0))
        return np.array(f) + np.array(o), np.array(b_) + np.array(o)

    def layers(
        self, r: int, step: int, a: int, b: int, g: float = 1.0
    ) -> tuple[np.ndarray, np.ndarray, float]:
        """True fwd and bwd ms of layers ``[a, b)`` held by rank ``r`` at ``step``, its
        device showing ``g`` of its excess, and the stage's overhead (clean for a blind
        stage)."""
        if self.blind(a, b):
            return (
                self.clean_fwd[r, step, a:b],
                self.clean_bwd[r, step, a:b],
                float(self.clean_over[r, step]),
            )
        if g == 1.0:
            return self.fwd[r, step, a:b], self.bwd[r, step, a:b], float(self.overhead[r, step])
        k = 1.0 - g
        return (
            self.fwd[r, step, a:b] - k * self._exf[r, step, a:b],
            self.bwd[r, step, a:b] - k * self._exb[r, step, a:b],
            float(self.overhead[r, step] - k * self._exo[r, step]),
        )


def _even(n: int, s: int) -> tuple[tuple[int, int], ...]:
    q, r = divmod(n, s)
    sizes = [q + (1 if i < r else 0) for i in range(s)]
    cuts = [0, *itertools.accumulate(sizes)]
    return tuple(itertools.pairwise(cuts))


def _phases(sc: Any) -> list[tuple[int, int]]:
    """The stretches of constant conditions of a scenario (anything with ``events`` per
    device and ``steps``)."""
    marks = {0, sc.steps}
    for ev in sc.events:
        for a, b, _ in ev:
            marks |= {min(a, sc.steps), min(b, sc.steps)}
    cuts = sorted(marks)
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


@dataclass
class ScenarioResult:
    """Mean step time (ms) of each system over one scenario, pauses included."""

    scenario: Scenario
    oracle_ms: float
    static_ms: float
    policy_ms: dict[str, float]
    moves: dict[str, int]

    def ratio(self, mode: str, to: str = "oracle") -> float:
        ref = self.oracle_ms if to == "oracle" else self.static_ms
        return self.policy_ms[mode] / ref


def _oracle(sc: Scenario, w: Workload, truth: _Truth) -> np.ndarray:
    """Per step, the step time of the static plan best over that step's phase.

    Load-independent truth: the exact plan on the phase's mean costs. Otherwise a device's
    costs depend on the plan: with 2 stages every split is timed (exact); with more, the
    exact plan is planned again on the costs its devices show under it (up to 3 times),
    and the best of those is improved one boundary by one layer at a time while that
    gains: a local optimum around the exact plan."""
    out = np.empty(sc.steps)
    for a, b in _phases(sc):
        over = truth.overhead[:, a:b].mean(axis=1)
        cm = dataclasses.replace(
            w.base.for_devices(sc.stages),
            fwd_ms=truth.fwd[:, a:b].mean(axis=1),
            bwd_ms=truth.bwd[:, a:b].mean(axis=1),
            stage_fwd_ms=over,
            stage_bwd_ms=over,
        )
        best = plan_partition(cm, num_stages=sc.stages, microbatches=sc.microbatches).bounds
        best = tuple((int(x), int(y)) for x, y in best)
        if not truth.flat:
            best = _oracle_under_load(sc, w, truth, best, a, b)
        out[a:b] = truth.step_ms(best)[a:b]
    return out


def _oracle_under_load(
    sc: Scenario, w: Workload, truth: _Truth, start: Bounds, a: int, b: int
) -> Bounds:
    """The best plan over steps ``[a, b)`` when devices slow with their load (``_oracle``)."""
    n = w.num_layers

    def cost(bounds: Bounds) -> float:
        return float(truth.step_ms(bounds)[a:b].mean())

    if sc.stages == 2:
        return min((((0, k), (k, n)) for k in range(1, n)), key=cost)
    seen = {start: cost(start)}
    pick = start
    for _ in range(3):
        fwd, bwd, over = truth.phase_costs(pick, a, b)
        cm = dataclasses.replace(
            w.base.for_devices(sc.stages),
            fwd_ms=fwd,
            bwd_ms=bwd,
            stage_fwd_ms=over,
            stage_bwd_ms=over,
        )
        nxt = plan_partition(cm, num_stages=sc.stages, microbatches=sc.microbatches).bounds
        nxt = tuple((int(x), int(y)) for x, y in nxt)
        if nxt in seen:
            break
        seen[nxt] = cost(nxt)
        pick = nxt
    return descend(min(seen, key=seen.__getitem__), n, cost, seen)


def descend(
    best: Bounds, n: int, cost: Callable[[Bounds], float], seen: dict[Bounds, float]
) -> Bounds:
    """From ``best``, move one boundary one layer at a time while that lowers ``cost``
    (memoised in ``seen``, which holds ``best``'s): a local optimum around it."""
    while True:
        around = neighbours(best, n)
        for bounds in around:
            if bounds not in seen:
                seen[bounds] = cost(bounds)
        nxt = min(around, key=seen.__getitem__, default=best)
        if seen[nxt] >= seen[best]:
            return best
        best = nxt


def neighbours(bounds: Bounds, n: int) -> list[Bounds]:
    """The splits of ``n`` layers one boundary of ``bounds`` one layer away."""
    cuts = [hi for _, hi in bounds[:-1]]
    out = []
    for i in range(len(cuts)):
        for d in (-1, 1):
            edges = [0, *cuts[:i], cuts[i] + d, *cuts[i + 1 :], n]
            if all(y > x for x, y in itertools.pairwise(edges)):
                out.append(tuple(itertools.pairwise(edges)))
    return out


def _run(
    sc: Scenario,
    w: Workload,
    truth: _Truth,
    policy: Policy | None,
    *,
    every: int,
    rng: np.random.Generator,
    light_probes: bool = True,
) -> tuple[np.ndarray, int]:
    """Per-step times of one run of ``policy`` (None: the initial plan throughout);
    ``light_probes``: its light ranks probe their devices (if it names them)."""
    bounds = _even(w.num_layers, sc.stages)
    ranks = tuple(range(sc.stages))
    m = sc.microbatches
    out = np.empty(sc.steps)
    pause = 0.0
    moves = 0
    win: list[tuple[float, np.ndarray, np.ndarray]] = []
    for step in range(sc.steps):
        t = float(truth.step_ms(bounds)[step])
        out[step] = t + pause
        pause = 0.0
        if policy is None:
            continue
        f, b = truth.stage_loads(bounds, step, ranks, timed=True)
        meas = truth.meas[list(ranks), step]
        win.append((t, f * m * meas, b * m * meas))
        if (step + 1) % every or step + 1 == sc.steps:
            continue
        ask = getattr(policy, "light_probes", None) if light_probes else None
        light = ask(tuple(bounds)) if ask is not None else {}
        if 0 in light:
            # The first stage's probe runs before its part of the sampled step.
            i = light[0]
            pf, pb, _ = truth.layers(0, step, i, i + 1, float(truth.gain(bounds)[0, step]))
            out[step] += float(pf[0] + pb[0])
        window = _window(sc, w, truth, bounds, ranks, win, step, rng, light=light)
        win = []
        d = policy.observe(window)
        if d is None or not d.repartition or d.bounds is None:
            continue
        nbytes = moved_bytes(w.base.state_bytes, bounds, d.bounds, ranks)
        cost = sc.pause_fixed_ms + nbytes / sc.link_bytes_per_ms
        bounds = d.bounds
        moves += 1
        # The first step under a new plan also runs slower (new buffers, kernel tuning).
        pause = cost + 0.3 * float(truth.step_ms(bounds)[min(step + 1, sc.steps - 1)])
        policy.applied(step=step + 1, pause_ms=cost, moved_bytes=nbytes)
    return out, moves


def _window(sc, w, truth, bounds, ranks, win, step, rng, light=None) -> Window:
    m = sc.microbatches
    lf = np.empty(w.num_layers)
    lb = np.empty(w.num_layers)
    sf, sb = np.empty(sc.stages), np.empty(sc.stages)
    gains = truth.gain(bounds)[:, step]
    for s, ((a, b), r) in enumerate(zip(bounds, ranks, strict=True)):
        # The sampled step: each layer's median over m microbatches, a few % of jitter.
        jf = rng.lognormal(0.0, 0.03 / np.sqrt(m), size=b - a)
        jb = rng.lognormal(0.0, 0.03 / np.sqrt(m), size=b - a)
        fwd, bwd, over = truth.layers(r, step, a, b, float(gains[s]))
        untimed = 0.0 if truth.blind(a, b) else float(gains[s]) * truth.untimed[r, step]
        lf[a:b] = fwd * jf * truth.meas[r, step]
        lb[a:b] = bwd * jb * truth.meas[r, step]
        sf[s] = lf[a:b].sum() + over - untimed
        sb[s] = lb[a:b].sum() + over - untimed
    probes = {}
    for r, i in sorted((light or {}).items()):
        # One microbatch of a heavy layer: not blind; the per-layer jitter of one sample.
        jf, jb = rng.lognormal(0.0, 0.03, size=2)
        g = float(gains[r])  # the device's, at the load its stage gives it
        stall = g * truth.probe_stall[r, step]
        pf, pb, _ = truth.layers(r, step, i, i + 1, g)
        probes[r] = (
            i,
            float((pf[0] + stall) * jf * truth.meas[r, step]),
            float((pb[0] + stall) * jb * truth.meas[r, step]),
        )
    tel = tuple(dict(w.telemetry[sc.condition(r, step)]) for r in range(sc.stages))
    return Window(
        step=step,
        bounds=tuple(bounds),
        ranks=ranks,
        microbatches=m,
        schedule="1f1b",
        step_ms=np.array([x[0] for x in win]),
        stage_fwd_ms=np.array([x[1] for x in win]),
        stage_bwd_ms=np.array([x[2] for x in win]),
        layer_fwd_ms=lf,
        layer_bwd_ms=lb,
        sampled_fwd_ms=sf,
        sampled_bwd_ms=sb,
        telemetry=tel,
        probes=probes or None,
    )


PolicyFactory = Callable[[Workload, Scenario, str], Policy]


class _Clairvoyant:
    """The reaction floor (mode ``clairvoyant``): knows every phase's true mean costs and
    moves to its best split at the first window end inside it, paying the same pauses."""

    mode_used = "clairvoyant"

    def __init__(self, sc: Scenario, w: Workload, truth: _Truth) -> None:
        self.sc, self.w, self.truth = sc, w, truth
        self.best: dict[tuple[int, int], Bounds] = {}

    def observe(self, window: Window) -> Decision:
        a, b = next(p for p in _phases(self.sc) if p[0] <= window.step < p[1])
        if (a, b) not in self.best:
            over = self.truth.overhead[:, a:b].mean(axis=1)
            cm = dataclasses.replace(
                self.w.base.for_devices(self.sc.stages),
                fwd_ms=self.truth.fwd[:, a:b].mean(axis=1),
                bwd_ms=self.truth.bwd[:, a:b].mean(axis=1),
                stage_fwd_ms=over,
                stage_bwd_ms=over,
            )
            res = plan_partition(cm, num_stages=self.sc.stages, microbatches=self.sc.microbatches)
            self.best[(a, b)] = tuple((int(x), int(y)) for x, y in res.bounds)
        best = self.best[(a, b)]
        move = best != window.bounds
        return Decision(
            step=window.step + 1,
            mode=self.mode_used,
            slowdown=(),
            current_ms=0.0,
            proposed_ms=0.0,
            pause_ms=0.0,
            moved_bytes=0,
            repartition=move,
            reason="the phase's best split",
            bounds=best if move else None,
        )

    def applied(self, *, step: int, pause_ms: float, moved_bytes: int) -> None:
        del step, pause_ms, moved_bytes

    def describe(self) -> str:
        return "clairvoyant: every phase's true best split at its first window end"

    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        del state


def default_factory(predictor: str | None = None, **overrides: Any) -> PolicyFactory:
    """Controllers as the runtime builds them, with ``AdaptConfig`` ``overrides``; the
    ``adaptive`` mode loads ``predictor`` (prepared once per workload)."""
    from dynpipe.runtime.adapt.model import ModelPolicy
    from dynpipe.runtime.adapt.policy import Controller

    loaded = predictor_for(predictor)

    def factory(w: Workload, sc: Scenario, mode: str) -> Policy:
        # A mode may name its core: ``measured:model`` runs the model core beside the rules.
        mode, _, core = mode.partition(":")
        cfg = AdaptConfig(mode=mode, **({"core": core} if core else {}), **overrides)
        est, prepared = loaded(w) if mode == "adaptive" else (None, None)
        kind = ModelPolicy if cfg.core == "model" else Controller
        return kind(base=w.base, config=cfg, num_ranks=sc.stages, predictor=est, prepared=prepared)

    return factory


def predictor_for(predictor: str | None) -> Callable[[Workload], tuple[Any, Any]]:
    """``workload -> (predictor, its layers prepared)``: ``predictor`` loaded on first use
    (one thread: the simulator's calls are small) and each workload's layers prepared once;
    ``(None, None)`` without one."""
    cache: dict[str, Any] = {}

    def get(w: Workload) -> tuple[Any, Any]:
        if predictor is None:
            return None, None
        from dynpipe.predictor import load_predictor, prepare_layers

        if "predictor" not in cache:
            cache["predictor"] = load_predictor(_path(predictor))
            est = cache["predictor"].estimator
            if hasattr(est, "set_predict_threads"):
                est.set_predict_threads(1)
        if w.name not in cache:
            cache[w.name] = prepare_layers(cache["predictor"], w.rows)
        return cache["predictor"], cache[w.name]

    return get


def simulate(
    scenarios: Sequence[Scenario],
    *,
    workloads: Sequence[Workload],
    traces: Sequence[NoiseTrace],
    modes: Sequence[str] = ("measured",),
    factory: PolicyFactory | None = None,
    monitor_every: int = 5,
    light_probes: bool = True,
) -> list[ScenarioResult]:
    """Run every mode on every scenario; same truth and noise for every system
    (``light_probes``: the policies' light ranks probe their devices)."""
    factory = factory or default_factory()
    by_name = {w.name: w for w in workloads}
    out = []
    for sc in scenarios:
        w = by_name[sc.workload]
        truth = _Truth(sc, w, traces)
        oracle = _oracle(sc, w, truth)
        static, _ = _run(sc, w, truth, None, every=monitor_every, rng=np.random.default_rng(0))
        ms, moves = {}, {}
        for mode in modes:
            policy = _Clairvoyant(sc, w, truth) if mode == "clairvoyant" else factory(w, sc, mode)
            t, k = _run(
                sc,
                w,
                truth,
                policy,
                every=monitor_every,
                rng=np.random.default_rng(sc.seed),
                light_probes=light_probes,
            )
            ms[mode], moves[mode] = float(t.mean()), k
        out.append(
            ScenarioResult(
                scenario=sc,
                oracle_ms=float(oracle.mean()),
                static_ms=float(static.mean()),
                policy_ms=ms,
                moves=moves,
            )
        )
    return out


def quiet_timers(sc: Scenario, traces: Sequence[NoiseTrace]) -> bool:
    """Whether the scenario's noise comes from a run whose stage timers tracked its steps
    (GPU-bound sizes), rather than swinging on their own (launch- or loader-bound ones)."""
    return float(np.median(np.abs(np.log(traces[sc.noise[0][0]].meas)))) <= 0.02


def summarise(
    results: Sequence[ScenarioResult],
    modes: Sequence[str],
    traces: Sequence[NoiseTrace] | None = None,
) -> dict[str, Any]:
    """Mean and p95 ratio to the oracle, and the worst ratio to static, per mode (and per
    kind of timer noise, given the traces)."""
    out: dict[str, Any] = {"scenarios": len(results)}
    groups: dict[str, list[ScenarioResult]] = {"all": list(results)}
    if traces is not None:
        groups["quiet timers"] = [r for r in results if quiet_timers(r.scenario, traces)]
        groups["noisy timers"] = [r for r in results if not quiet_timers(r.scenario, traces)]
    for mode in modes:
        out[mode] = {}
        for name, rs in groups.items():
            if not rs:
                continue
            r_o = np.array([r.ratio(mode) for r in rs])
            r_s = np.array([r.ratio(mode, "static") for r in rs])
            worst = int(np.argmax(r_s))
            out[mode][name] = {
                "scenarios": len(rs),
                "mean_to_oracle": round(float(r_o.mean()), 4),
                "p95_to_oracle": round(float(np.percentile(r_o, 95)), 4),
                "max_to_oracle": round(float(r_o.max()), 4),
                "mean_to_static": round(float(r_s.mean()), 4),
                "worst_to_static": round(float(r_s.max()), 4),
                "worse_than_static_by_2pct": int((r_s > 1.02).sum()),
                "worst_scenario": dataclasses.asdict(rs[worst].scenario),
                "moves_per_scenario": round(float(np.mean([r.moves[mode] for r in rs])), 2),
            }
    static = np.array([r.static_ms / r.oracle_ms for r in results])
    out["static"] = {"mean_to_oracle": round(float(static.mean()), 4)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["measured", "adaptive", "clairvoyant"],
        help="policies to run; clairvoyant: the reaction floor (true costs, moves at window "
        "ends); MODE:model runs MODE on the model core (--adapt-core model)",
    )
    ap.add_argument("--predictor", default="predictor/h200.json.gz")
    ap.add_argument("--profiles", nargs="+", default=list(DEFAULT_PROFILES))
    ap.add_argument("--logs", default=DEFAULT_LOGS)
    ap.add_argument("-o", "--out", default=None, help="write the summary JSON here")
    ap.add_argument(
        "--blind",
        action="store_true",
        help="light stages run and read clean whatever their device (see the docstring)",
    )
    ap.add_argument(
        "--no-light-probes",
        action="store_true",
        help="light ranks do not probe their devices (the policy reads their stages only)",
    )
    ap.add_argument(
        "--flat-slowdown",
        action="store_true",
        help="a slowed device's slowdown does not depend on its load (see the docstring)",
    )
    ap.add_argument(
        "--per-scenario", default=None, help="write every scenario's ms per system here (JSONL)"
    )
    args = ap.parse_args(argv)
    workloads = load_workloads(args.profiles)
    traces = noise_from_logs(args.logs)
    scenarios = random_scenarios(
        args.scenarios,
        workloads=workloads,
        traces=traces,
        seed=args.seed,
        steps=args.steps,
        blind=args.blind,
        load_dependent=not args.flat_slowdown,
    )
    res = simulate(
        scenarios,
        workloads=workloads,
        traces=traces,
        modes=args.modes,
        factory=default_factory(args.predictor),
        light_probes=not args.no_light_probes,
    )
    if args.per_scenario:
        with open(args.per_scenario, "w") as fh:
            for r in res:
                row = {"seed": r.scenario.seed, "oracle": r.oracle_ms, "static": r.static_ms}
                fh.write(json.dumps({**row, **r.policy_ms, "moves": r.moves}) + "\n")
    from dynpipe.runtime.runlog import code_revision  # torch: only for the command line

    # Which draw and which code: a summary is compared only with one of the same draw.
    run = {
        "seed": args.seed,
        "steps": args.steps,
        "predictor": args.predictor,
        "revision": code_revision(),
    }
    summary = {"run": run, **summarise(res, args.modes, traces)}
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
