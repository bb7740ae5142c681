"""The replica simulator: the replica policy on 100 random dp x pp scenarios against the
exact oracle (the best static split and batch shares of every phase, from the true
per-layer costs, zero pause).

The scenarios (seed 202, drawn once the policy's changes were done and never used to
develop it) take 2 to 8 ranks as 2 or 4 replicas of 1, 2 or 4 stages, true costs from the
H200 profiles, one or two slowed devices anywhere, and measurement noise from every
recorded static GPU run. Held to the adaptation targets: mean ratio to the oracle <=
1.03, p95 <= 1.10. The policy before this simulator existed gave 1.0318 and 1.1311 here
and fails both. Not yet to "none worse than static by more than 2%": one run is 2.9%
slower (a 2 x 1 gpt run on noisy timers), and on the seeds it was developed on (7, 11,
23, 101) 0, 2, 0 and 3 runs a seed are (docs/results/simulator.md).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest

from dynpipe.sim import replica_simulator as rs
from dynpipe.sim import simulator as sim

pytestmark = pytest.mark.slow

SCENARIOS = 100
SEED = 202


@lru_cache(maxsize=1)
def _setup():
    workloads = sim.load_workloads()
    traces = sim.noise_from_logs()
    scenarios = rs.random_replica_scenarios(
        SCENARIOS, workloads=workloads, traces=traces, seed=SEED
    )
    return workloads, traces, scenarios


@pytest.mark.parametrize("mode", ["measured", "adaptive"])
def test_replica_policy_against_the_oracle(mode: str) -> None:
    workloads, traces, scenarios = _setup()
    assert {(sc.dp, sc.pp) for sc in scenarios} == set(rs.SHAPES)
    results = rs.simulate_replicas(
        scenarios,
        workloads=workloads,
        traces=traces,
        modes=[mode],
        factory=rs.replica_factory(predictor="predictor/h200.json.gz"),
    )
    to_oracle = np.array([r.ratio(mode) for r in results])
    to_static = np.array([r.ratio(mode, "static") for r in results])
    static = np.array([r.static_ms / r.oracle_ms for r in results])
    # The scenarios are worth adapting to: holding the first configuration costs far more.
    assert static.mean() > 1.08, static.mean()
    summary = {
        "mean": to_oracle.mean(),
        "p95": np.percentile(to_oracle, 95),
        "worst to static": to_static.max(),
        "past 2% of static": int((to_static > 1.02).sum()),
    }
    assert to_oracle.mean() <= 1.03, summary
    assert np.percentile(to_oracle, 95) <= 1.10, summary
    # What it does not yet meet, bounded where it stands (see the module docstring).
    assert (to_static > 1.02).sum() <= 1 and to_static.max() <= 1.05, summary


def test_the_oracle_is_no_slower_than_any_static_configuration_it_weighs() -> None:
    """Per phase, the oracle's configuration is at least as fast as the first one held
    and as the best split at even shares (both among what it weighs)."""
    workloads, traces, scenarios = _setup()
    by_name = {w.name: w for w in workloads}
    for sc in scenarios[:10]:
        truth = rs._ReplicaTruth(sc, by_name[sc.workload], traces)
        oracle = rs._oracle(sc, truth)
        n = truth.w.num_layers
        even = (sc.microbatches,) * sc.dp
        first = rs._Config(sim._even(n, sc.pp), even)
        for a, b in sim._phases(sc):
            assert oracle[a:b].mean() <= truth.step_ms(first)[a:b].mean() + 1e-9
            if sc.pp == 2:
                splits = [((0, k), (k, n)) for k in range(1, n)]
                best = min(truth.step_ms(rs._Config(x, even))[a:b].mean() for x in splits)
                assert oracle[a:b].mean() <= best + 1e-9


def test_the_oracle_over_every_shape_is_no_slower_than_over_the_scenarios_own() -> None:
    """``--reshape``: the oracle weighs every shape the policy may take, the scenario's
    among them."""
    workloads, traces, scenarios = _setup()
    by_name = {w.name: w for w in workloads}
    for sc in scenarios[:6]:
        truth = rs._ReplicaTruth(sc, by_name[sc.workload], traces)
        own = rs._oracle(sc, truth)
        every = rs._oracle(sc, truth, reshape=True)
        assert every.mean() <= own.mean() + 1e-9
        assert len(rs._shapes(sc, True, truth.w.num_layers)) > 1


def test_an_interferers_end_after_reshapes_returns_to_the_shape_measured_clean() -> None:
    """Clean conditions read alike in every shape: a 2 x 2 resnet50 run (seed 7's scenario
    37, ``--reshape``) went to 4 x 1 clean, to one pipeline of 4 stages under a ``train``
    onset at step 85 and, once the interferer left at 120, held that pipeline to the end
    (1.7x the 4 x 1 measured clean before): every reshape had set what was measured
    before it aside. It goes back to 4 x 1 in the first window after the end."""
    workloads = sim.load_workloads()
    traces = sim.noise_from_logs()
    sc = rs.random_replica_scenarios(38, workloads=workloads, traces=traces, seed=7)[37]
    assert (sc.dp, sc.pp, sc.events[2]) == (2, 2, ((85, 120, "train@1x2"),))
    truth = rs._ReplicaTruth(sc, {w.name: w for w in workloads}[sc.workload], traces)
    policy = rs.replica_factory("predictor/h200.json.gz", reshape=True)(truth.w, sc, "measured")
    shapes: list[tuple[int, tuple[int, int]]] = []
    observe = policy.observe

    def recorded(window):
        d = observe(window)
        if d is not None and d.repartition:
            shapes.append((d.step, (len(d.shares), len(d.bounds))))
        return d

    policy.observe = recorded
    steps, _ = rs._run(sc, truth, policy, every=5, rng=np.random.default_rng(sc.seed))
    after = [(step, shape) for step, shape in shapes if step > 120]
    assert after and after[0][1] == (4, 1) and after[0][0] <= 130, shapes
    oracle = rs._oracle(sc, truth, reshape=True)
    assert steps[130:].mean() <= 1.05 * oracle[130:].mean(), (steps[130:].mean(), shapes)


def test_a_move_measured_slower_under_the_same_conditions_is_undone() -> None:
    """A 4 x 1 resnet50 run on swinging timers (seed 11's scenario 113) shifted batch
    shares to 3/2/1/2 at step 30, in a window whose change of conditions was unconfirmed
    (filed under no regime), measured 96 ms per batch against the even shares' 68, and
    held the shift to the end: 1.35x static. The window that measures it undoes it."""
    workloads = sim.load_workloads()
    traces = sim.noise_from_logs()
    sc = rs.random_replica_scenarios(114, workloads=workloads, traces=traces, seed=11)[113]
    assert (sc.workload, sc.dp, sc.pp, sc.events[0]) == (
        "resnet50-bs64",
        4,
        1,
        ((182, 202, "copy@1x1"),),
    )
    truth = rs._ReplicaTruth(sc, {w.name: w for w in workloads}[sc.workload], traces)
    policy = rs.replica_factory()(truth.w, sc, "measured")
    moves: list[tuple[int, tuple[int, ...]]] = []
    observe = policy.observe

    def recorded(window):
        d = observe(window)
        if d is not None and d.repartition:
            moves.append((d.step, tuple(d.shares)))
        return d

    policy.observe = recorded
    steps, _ = rs._run(sc, truth, policy, every=5, rng=np.random.default_rng(sc.seed))
    static, _ = rs._run(sc, truth, None, every=5, rng=np.random.default_rng(0))
    shifted = [i for i, (_, shares) in enumerate(moves) if shares != (2, 2, 2, 2)]
    assert shifted, moves
    for i in shifted:  # every shift measured slower is followed, one window on, by the way back
        assert i + 1 < len(moves) and moves[i + 1] == (moves[i][0] + 10, (2, 2, 2, 2)), moves
    assert steps.mean() <= 1.05 * static.mean(), (steps.mean() / static.mean(), moves)
