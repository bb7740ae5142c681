"""The controller simulator: the runtime's policy on 100 random scenarios against the exact
oracle (the best static split of every phase, from the true per-layer costs, zero pause).

The scenarios (seed 7, never used while the policy was developed) draw true costs from the
H200 profiles, onsets and ends at random steps on one or two devices of 2, 4 or 8 stages,
and measurement noise from every recorded static GPU run: runs whose stage timers were sound
(GPU-bound sizes: ``quiet``) and runs whose timers swung 2x while their steps did not
(launch- and loader-bound sizes). A scenario's noise is drawn by index into that library,
so every run committed under ``analysis/logs`` draws the seed's scenarios anew.

Sound timers are held to the adaptation issue's targets: mean ratio to the oracle <= 1.03,
p95 <= 1.10, none worse than static by more than 2% (here 1.020 / 1.054 / 1.007x in both
modes). Over every scenario, misleading timers included, the policy is at the mean's
target and not under it: with the `0860a81` oracle logs in the library, 1.0300 (measured)
and 1.0306 (adaptive), the draw before them 1.0299 and 1.0280; on 300 other scenarios
(``bench/results/simulator.json``) some runs are past 2% of static (see the README). The
test holds those two where they stand, so that a change making them worse fails; p95 is
held to the target.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest

from dynpipe.runtime.adapt import simulator as sim

pytestmark = pytest.mark.slow

SCENARIOS = 100
SEED = 7


@lru_cache(maxsize=1)
def _setup():
    workloads = sim.load_workloads()
    traces = sim.noise_from_logs()
    scenarios = sim.random_scenarios(SCENARIOS, workloads=workloads, traces=traces, seed=SEED)
    return workloads, traces, scenarios


@pytest.mark.parametrize("mode", ["measured", "adaptive"])
def test_policy_against_the_oracle(mode: str) -> None:
    workloads, traces, scenarios = _setup()
    results = sim.simulate(
        scenarios,
        workloads=workloads,
        traces=traces,
        modes=[mode],
        factory=sim.default_factory(predictor="predictor/h200.json.gz"),
    )
    to_oracle = np.array([r.ratio(mode) for r in results])
    to_static = np.array([r.ratio(mode, "static") for r in results])
    quiet = np.array([sim.quiet_timers(r.scenario, traces) for r in results])
    assert 20 <= quiet.sum() <= SCENARIOS - 20, "the scenarios must cover both kinds of noise"
    static = np.array([r.static_ms / r.oracle_ms for r in results])
    # The scenarios are worth adapting to: holding the first plan costs far more.
    assert static.mean() > 1.10, static.mean()
    summary = {
        "quiet": (to_oracle[quiet].mean(), np.percentile(to_oracle[quiet], 95)),
        "all": (to_oracle.mean(), np.percentile(to_oracle, 95)),
        "worst to static": (to_static[quiet].max(), to_static.max()),
        "past 2% of static": int((to_static > 1.02).sum()),
    }
    # Sound timers: the targets.
    assert to_oracle[quiet].mean() <= 1.03, summary
    assert np.percentile(to_oracle[quiet], 95) <= 1.10, summary
    assert to_static[quiet].max() <= 1.02, summary
    # Every scenario, misleading timers included: p95 at the target; the mean and the
    # worst run against static where the policy stands (the docstring), not at the
    # issue's 1.03 and 1.02, which this policy does not meet on every draw.
    assert np.percentile(to_oracle, 95) <= 1.10, summary
    assert to_oracle.mean() <= 1.035, summary
    assert to_static.max() <= 1.035, summary
