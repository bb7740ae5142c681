"""Replica simulator: the replica policy against the exact oracle, on random scenarios.

``simulator`` drives the single-pipeline ``Controller``; this drives ``ReplicaPolicy`` (a
run of ``dp`` pipeline replicas of ``pp`` stages) the same way: the same true per-layer
costs (the H200 profiles, each device's slowdown following its load), the same measurement
noise (every recorded static GPU run, one device per recorded stage) and pause costs, and
windows built the way the training loop builds a replicated window (``Window.replicas``:
one window per replica with its share of the batch, the job's step times on top).

A scenario is ``dp x pp`` ranks, one or two of them slowed (any replica, any stage) from
some step to some other. The job's true step is the slowest replica's pipeline step (each
replica runs its own share of microbatches on its own devices) plus what the stages'
gradient all-reduce adds past it (``planner.shape.tail_parts``, priced as the policy
prices it before any update is timed). A move pauses the job: a fixed part drawn per
scenario (a share shift moves no state: recorded ``reshare`` pauses were 20-30 ms, as
repartitions' fixed parts), plus, for layers, one replica's bytes over the link (the
replicas copy in parallel); the first step after it runs a little slower, as in
``simulator``.

Per scenario it reports each system's mean step (pauses included): the policy, the first
configuration held throughout (even split, even shares: static) and the oracle: per phase,
the static configuration best over that phase with zero pause, of every split (2 stages;
with more, the exact plan of each replica's true costs and of their worst, then a local
search one boundary by one layer at a time) each with its best batch shares and with even
ones. The shape (``dp x pp``) is the scenario's, and the policy runs without
``--reshape``; with ``--reshape`` the policy may change the shape live (a reshape pauses the
job for the fixed part and its busiest rank's copies over the link, and its first step
runs about 4x a step) and the oracle weighs every shape the policy may take. Never
partial reduce (which changes the training math).

    python -m dynpipe.sim.replica_simulator --scenarios 100 --seed 7 [--reshape]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dynpipe.planner.dp import plan_partition
from dynpipe.planner.shape import reduce_tail_ms
from dynpipe.runtime.adapt.config import AdaptConfig
from dynpipe.runtime.adapt.policy import Policy, moved_bytes
from dynpipe.runtime.adapt.record import Bounds
from dynpipe.runtime.adapt.replicas import ReplicaPolicy, best_shares, shape_options
from dynpipe.runtime.autodp import copy_plan
from dynpipe.sim.simulator import (
    DEFAULT_LOGS,
    DEFAULT_PROFILES,
    NoiseTrace,
    Scenario,
    ScenarioResult,
    Workload,
    _even,
    _load_coefficients,
    _phases,
    _Truth,
    _window,
    descend,
    draw_events,
    draw_noise,
    load_workloads,
    noise_from_logs,
    predictor_for,
    summarise,
)

__all__ = [
    "ReplicaScenario",
    "random_replica_scenarios",
    "replica_factory",
    "simulate_replicas",
]

# (dp, pp) shapes drawn: 2 to 8 ranks, DP only and pipelines of 2 and 4 stages.
SHAPES = ((2, 1), (4, 1), (2, 2), (4, 2), (2, 4))


@dataclass(frozen=True)
class ReplicaScenario:
    """One run of ``dp`` replicas of ``pp`` stages: per global rank ``g = r pp + s``
    (replica ``r``'s stage ``s``), ``events[g]`` and ``noise[g]`` as a ``Scenario``'s;
    ``microbatches``: each replica's share at even shares."""

    seed: int
    workload: str
    dp: int
    pp: int
    microbatches: int
    steps: int
    events: tuple[tuple[tuple[int, int, str], ...], ...]
    noise: tuple[tuple[int, int], ...]
    pause_fixed_ms: float
    link_bytes_per_ms: float
    stall: float = 0.0
    untimed: float = 0.0
    load_c: tuple[float, ...] = ()

    @property
    def stages(self) -> int:
        return self.pp

    @property
    def world(self) -> int:
        return self.dp * self.pp

    @property
    def total(self) -> int:
        """The step's microbatches, over every replica."""
        return self.dp * self.microbatches

    def replica(self, r: int, pp: int | None = None) -> Scenario:
        """Replica ``r``'s pipeline as a scenario of its own (its devices, its noise), in
        the shape of ``pp`` stages (default: the scenario's): global ranks ``r pp`` to
        ``r pp + pp - 1``, each running its even share of the microbatches."""
        p = pp or self.pp
        mine = slice(r * p, (r + 1) * p)
        return Scenario(
            seed=self.seed,
            workload=self.workload,
            stages=p,
            microbatches=self.total // (self.world // p),
            steps=self.steps,
            events=self.events[mine],
            noise=self.noise[mine],
            pause_fixed_ms=self.pause_fixed_ms,
            link_bytes_per_ms=self.link_bytes_per_ms,
            stall=self.stall,
            untimed=self.untimed,
            load_c=self.load_c[mine] if self.load_c else (),
        )


def random_replica_scenarios(
    n: int,
    *,
    workloads: Sequence[Workload],
    traces: Sequence[NoiseTrace],
    seed: int = 0,
    steps: int = 240,
    shapes: Sequence[tuple[int, int]] = SHAPES,
) -> list[ReplicaScenario]:
    """``n`` scenarios: a workload, a shape, one or two slowed ranks anywhere, onsets and
    ends at random steps (some at the start, some never ending), random conditions, each
    slowed device's load coefficient by its interferer's kind (``simulator._LOAD_C``)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        w = workloads[int(rng.integers(len(workloads)))]
        dp, pp = shapes[int(rng.integers(len(shapes)))]
        world = dp * pp
        m = int(max(pp, 2) * rng.choice([1, 2]))
        events = draw_events(rng, w.conditions, devices=world, steps=steps)
        noise = draw_noise(rng, traces, devices=world)
        out.append(
            ReplicaScenario(
                seed=seed * 100_000 + i,
                workload=w.name,
                dp=dp,
                pp=pp,
                microbatches=m,
                steps=steps,
                events=tuple(events),
                noise=noise,
                pause_fixed_ms=float(rng.uniform(5, 40)),
                link_bytes_per_ms=float(rng.uniform(10e6, 40e6)),
                stall=float(rng.uniform(0.0, 1.0)),
                untimed=float(rng.uniform(0.0, 0.5)),
                load_c=_load_coefficients(events, np.random.default_rng([seed, i])),
            )
        )
    return out


@dataclass(frozen=True)
class _Config:
    bounds: Bounds
    shares: tuple[int, ...]


class _ReplicaTruth:
    """True step times of a replica scenario: one ``_Truth`` per replica (its devices) of
    each shape the run may take, at whatever share of microbatches it runs. A configuration
    of ``p``-stage splits is one of ``world / p`` replicas (the shape follows the split)."""

    def __init__(self, sc: ReplicaScenario, w: Workload, traces: Sequence[NoiseTrace]) -> None:
        self.sc, self.w, self._traces = sc, w, traces
        self._replicas: dict[tuple[int, int], _Truth] = {}
        self._pipes: dict[tuple[int, int, Bounds], np.ndarray] = {}
        self._tails: dict[Bounds, float] = {}
        self._jobs: dict[_Config, np.ndarray] = {}

    def replicas(self, pp: int) -> list[_Truth]:
        """Every replica of the shape of ``pp`` stages."""
        return [self.truth(r, None, pp) for r in range(self.sc.world // pp)]

    def truth(self, r: int, m: int | None, pp: int) -> _Truth:
        """Replica ``r`` of the shape of ``pp`` stages, running ``m`` microbatches (None:
        its even share)."""
        if (pp, r) not in self._replicas:
            self._replicas[pp, r] = _Truth(self.sc.replica(r, pp), self.w, self._traces)
        got = self._replicas[pp, r]
        return got if m is None else got.at_microbatches(m)

    def pipe(self, r: int, m: int, bounds: Bounds) -> np.ndarray:
        """``[T]`` replica ``r``'s pipeline step running ``m`` microbatches of ``bounds``."""
        key = (r, m, bounds)
        if key not in self._pipes:
            self._pipes[key] = self.truth(r, m, len(bounds)).step_ms(bounds)
        return self._pipes[key]

    def tail(self, bounds: Bounds) -> float:
        """What the stages' gradient all-reduce adds past the slowest pipeline."""
        if bounds not in self._tails:
            d = self.sc.world // len(bounds)
            self._tails[bounds] = reduce_tail_ms(self.w.base, bounds=bounds, replicas=d)
        return self._tails[bounds]

    def step_ms(self, cfg: _Config) -> np.ndarray:
        """``[T]`` the job's true step under ``cfg``."""
        if cfg not in self._jobs:
            pipes = [self.pipe(r, m, cfg.bounds) for r, m in enumerate(cfg.shares)]
            self._jobs[cfg] = np.max(pipes, axis=0) + self.tail(cfg.bounds)
        return self._jobs[cfg]


def _shapes(sc: ReplicaScenario, reshape: bool, num_layers: int) -> list[tuple[int, int]]:
    """The shapes a run may hold: the scenario's, or with ``reshape`` every shape the
    replica policy weighs (``replicas.shape_options``)."""
    if not reshape:
        return [(sc.dp, sc.pp)]
    return shape_options(sc.world, total=sc.total, schedule="1f1b", num_layers=num_layers)


def _oracle(sc: ReplicaScenario, truth: _ReplicaTruth, *, reshape: bool = False) -> np.ndarray:
    """Per step, the job's step under the configuration best over that step's phase (see
    the module docstring); ``reshape``: over every shape, else the scenario's."""
    n = truth.w.num_layers
    out = np.empty(sc.steps)
    for a, b in _phases(sc):
        best = min(
            (_best_of_shape(sc, truth, d, p, a, b) for d, p in _shapes(sc, reshape, n)),
            key=lambda x: x[0],
        )
        out[a:b] = truth.step_ms(best[1])[a:b]
    return out


def _best_of_shape(
    sc: ReplicaScenario, truth: _ReplicaTruth, d: int, p: int, a: int, b: int
) -> tuple[float, _Config]:
    """The configuration of ``d`` replicas of ``p`` stages best over steps ``[a, b)``, with
    its mean step: every split (up to 2 stages), or the exact plans and a local search
    around the best of them; each split with its best batch shares and with even ones."""
    n, total = truth.w.num_layers, sc.total
    even = (total // d,) * d

    def cost(cfg: _Config) -> float:
        return float(truth.step_ms(cfg)[a:b].mean())

    cfgs: dict[Bounds, _Config] = {}

    def best_for(bounds: Bounds) -> float:
        shares, _ = best_shares(
            lambda r, m: float(truth.pipe(r, m, bounds)[a:b].mean()),
            total=total,
            low=[p] * d,  # 1F1B runs at least a microbatch per stage
        )
        ms, cfgs[bounds] = min(
            ((cost(c), c) for c in {_Config(bounds, shares), _Config(bounds, even)}),
            key=lambda x: x[0],
        )
        return ms

    seen: dict[Bounds, float] = {}
    if p == 1:
        splits: list[Bounds] = [((0, n),)]
    elif p == 2:
        splits = [((0, k), (k, n)) for k in range(1, n)]
    else:
        splits = [_even(n, p), *_planned(truth, p, total // d, a, b)]
    for bounds in splits:
        if bounds not in seen:
            seen[bounds] = best_for(bounds)
    best = min(seen, key=seen.__getitem__)
    if p > 2:  # a local search around the best planned split
        best = descend(best, n, best_for, seen)
    return seen[best], cfgs[best]


def _planned(truth: _ReplicaTruth, p: int, m: int, a: int, b: int) -> list[Bounds]:
    """The exact ``p``-stage plan of each replica's true mean costs over ``[a, b)`` (``m``
    microbatches) and of their element-wise worst."""
    mine = truth.replicas(p)
    fwd = [t.fwd[:, a:b].mean(axis=1) for t in mine]
    bwd = [t.bwd[:, a:b].mean(axis=1) for t in mine]
    over = [t.overhead[:, a:b].mean(axis=1) for t in mine]
    rows = [*zip(fwd, bwd, over, strict=True)]
    rows.append((np.max(fwd, axis=0), np.max(bwd, axis=0), np.max(over, axis=0)))
    out = []
    for f, bw, o in rows:
        cm = dataclasses.replace(
            truth.w.base.for_devices(p), fwd_ms=f, bwd_ms=bw, stage_fwd_ms=o, stage_bwd_ms=o
        )
        res = plan_partition(cm, num_stages=p, microbatches=m)
        out.append(tuple((int(x), int(y)) for x, y in res.bounds))
    return out


def _run(
    sc: ReplicaScenario,
    truth: _ReplicaTruth,
    policy: Policy | None,
    *,
    every: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, int]:
    """Per-step times of one run of ``policy`` (None: the first configuration throughout)
    and how many moves it made."""
    w = truth.w
    cfg = _Config(_even(w.num_layers, sc.pp), (sc.microbatches,) * sc.dp)
    out = np.empty(sc.steps)
    pause, moves = 0.0, 0
    wins: list[list[tuple[float, np.ndarray, np.ndarray]]] = [[] for _ in cfg.shares]
    jobs: list[float] = []
    for step in range(sc.steps):
        t = float(truth.step_ms(cfg)[step])
        out[step] = t + pause
        pause = 0.0
        if policy is None:
            continue
        jobs.append(t)
        ranks = tuple(range(len(cfg.bounds)))
        for r, m in enumerate(cfg.shares):
            tr = truth.truth(r, m, len(cfg.bounds))
            f, b = tr.stage_loads(cfg.bounds, step, ranks, timed=True)
            meas = tr.meas[list(ranks), step]
            sf, sb = f * m * meas, b * m * meas
            wins[r].append((float((sf + sb).max()), sf, sb))  # the busiest stage's compute
        if (step + 1) % every or step + 1 == sc.steps:
            continue
        window = _replicated_window(sc, truth, cfg, wins, jobs, step, rng)
        wins, jobs = [[] for _ in cfg.shares], []
        d = policy.observe(window)
        if d is None or not d.repartition:
            continue
        new = _Config(d.bounds or cfg.bounds, tuple(d.shares or cfg.shares))
        if new == cfg:
            continue
        wire, nbytes = _copies(sc, w, cfg, new)
        cost = sc.pause_fixed_ms + wire
        # The first step after a move runs slower (new buffers, kernel tuning); after a
        # reshape about 4x a step (new communicators: gpt 12 x 2048 from one pipeline to
        # 2 x 2 on 4 x H200, 558 ms against 145 after it).
        first = 3.0 if len(new.bounds) != len(cfg.bounds) else 0.3
        cfg = new
        wins = [[] for _ in cfg.shares]  # a reshape changes the replicas
        moves += 1
        pause = cost + first * float(truth.step_ms(cfg)[min(step + 1, sc.steps - 1)])
        policy.applied(step=step + 1, pause_ms=cost, moved_bytes=nbytes)
    return out, moves


def _copies(sc: ReplicaScenario, w: Workload, old: _Config, new: _Config) -> tuple[float, int]:
    """A move's time on the wire (ms) and its bytes: under one shape every replica moves
    its own layers at once, one replica's bytes over each link; a reshape copies every
    layer a rank lacks from a holder (``autodp.copy_plan``), the busiest rank's bytes in
    and out over its link."""
    if len(new.bounds) == len(old.bounds):
        ranks = tuple(range(len(old.bounds)))
        one = moved_bytes(w.base.state_bytes, old.bounds, new.bounds, ranks)
        return one / sc.link_bytes_per_ms, len(old.shares) * one

    def held(c: _Config) -> list[tuple[int, int]]:
        return [c.bounds[g % len(c.bounds)] for g in range(sc.world)]

    plan = copy_plan(held(old), held(new), names=w.base.layer_names, sizes=w.base.state_bytes)
    per_rank: dict[int, float] = {}
    for t in plan:
        for g in (t.src, t.dst):
            per_rank[g] = per_rank.get(g, 0.0) + float(t.nbytes or 0)
    total = int(sum(t.nbytes or 0 for t in plan))
    return max(per_rank.values(), default=0.0) / sc.link_bytes_per_ms, total


def _replicated_window(sc, truth, cfg, wins, jobs, step, rng):
    """The window the training loop builds for ``dp`` replicas: each replica's own (its
    stages, sampled layers and telemetry; ``step_ms`` its busiest stage's compute), the
    job's step times on top."""
    subs = []
    p = len(cfg.bounds)
    ranks = tuple(range(p))
    for r, m in enumerate(cfg.shares):
        one = dataclasses.replace(sc.replica(r, p), microbatches=m)
        tr = truth.truth(r, m, p)
        subs.append(_window(one, truth.w, tr, cfg.bounds, ranks, wins[r], step, rng))
    k = len(jobs)
    return dataclasses.replace(
        subs[0],
        step_ms=np.array(jobs),
        replicas=tuple(subs),
        shares=cfg.shares,
        dropped=(),
        reduce_ms=np.full((k, len(cfg.shares)), truth.tail(cfg.bounds)),
    )


ReplicaFactory = Callable[[Workload, ReplicaScenario, str], Policy]


def replica_factory(predictor: str | None = None, **overrides: Any) -> ReplicaFactory:
    """Replica policies as the runtime builds them (``make_policy`` with ``dp`` replicas),
    with ``AdaptConfig`` ``overrides``; ``adaptive`` loads ``predictor``."""
    loaded = predictor_for(predictor)

    def factory(w: Workload, sc: ReplicaScenario, mode: str) -> Policy:
        cfg = AdaptConfig(mode=mode, **overrides)
        est, prepared = loaded(w) if mode == "adaptive" else (None, None)
        return ReplicaPolicy(
            base=w.base,
            config=cfg,
            num_stages=sc.pp,
            dp=sc.dp,
            predictor=est,
            prepared=prepared,
        )

    return factory


def simulate_replicas(
    scenarios: Sequence[ReplicaScenario],
    *,
    workloads: Sequence[Workload],
    traces: Sequence[NoiseTrace],
    modes: Sequence[str] = ("measured",),
    factory: ReplicaFactory | None = None,
    monitor_every: int = 5,
    reshape: bool = False,
) -> list[ScenarioResult]:
    """Run every mode on every scenario; the same truth and noise for every system.
    ``reshape``: the oracle weighs every shape (the policies' ``factory`` should allow
    them too: ``replica_factory(reshape=True)``)."""
    factory = factory or replica_factory()
    by_name = {w.name: w for w in workloads}
    out = []
    for sc in scenarios:
        truth = _ReplicaTruth(sc, by_name[sc.workload], traces)
        oracle = _oracle(sc, truth, reshape=reshape)
        static, _ = _run(sc, truth, None, every=monitor_every, rng=np.random.default_rng(0))
        ms, moves = {}, {}
        for mode in modes:
            policy = factory(truth.w, sc, mode)
            t, k = _run(sc, truth, policy, every=monitor_every, rng=np.random.default_rng(sc.seed))
            ms[mode], moves[mode] = float(t.mean()), k
        out.append(
            ScenarioResult(
                scenario=sc,  # type: ignore[arg-type]  # summarise reads it as a dataclass
                oracle_ms=float(oracle.mean()),
                static_ms=float(static.mean()),
                policy_ms=ms,
                moves=moves,
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--modes", nargs="+", default=["measured", "adaptive"])
    ap.add_argument("--predictor", default="predictor/h200.json.gz")
    ap.add_argument("--profiles", nargs="+", default=list(DEFAULT_PROFILES))
    ap.add_argument("--logs", default=DEFAULT_LOGS)
    ap.add_argument("-o", "--out", default=None, help="write the summary JSON here")
    ap.add_argument(
        "--per-scenario", default=None, help="write every scenario's ms per system here (JSONL)"
    )
    ap.add_argument(
        "--reshape",
        action="store_true",
        help="the policies may change the data x pipeline shape live, and the oracle weighs "
        "every shape",
    )
    args = ap.parse_args(argv)
    workloads = load_workloads(args.profiles)
    traces = noise_from_logs(args.logs)
    scenarios = random_replica_scenarios(
        args.scenarios, workloads=workloads, traces=traces, seed=args.seed, steps=args.steps
    )
    res = simulate_replicas(
        scenarios,
        workloads=workloads,
        traces=traces,
        modes=args.modes,
        factory=replica_factory(args.predictor, reshape=args.reshape),
        reshape=args.reshape,
    )
    if args.per_scenario:
        with open(args.per_scenario, "w") as fh:
            for r in res:
                sc: Any = r.scenario  # a ReplicaScenario
                row = {"seed": sc.seed, "shape": [sc.dp, sc.pp], "workload": sc.workload}
                row |= {"oracle": r.oracle_ms, "static": r.static_ms}
                fh.write(json.dumps({**row, **r.policy_ms, "moves": r.moves}) + "\n")
    from dynpipe.runtime.runlog import code_revision  # torch: only for the command line

    # Which draw and which code: a summary is compared only with one of the same draw.
    run = {"seed": args.seed, "steps": args.steps, "revision": code_revision()}
    summary = {"run": run, **summarise(res, args.modes, traces)}
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
