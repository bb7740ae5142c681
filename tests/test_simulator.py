"""The controller simulator: the runtime's policy on 100 random scenarios against the exact
oracle (the best static split of every phase, from the true per-layer costs, zero pause).

The scenarios (seed 7, drawn before the policy's rules were written; changes since are also
checked on seed 11) draw true costs from the H200 profiles, onsets and ends at random steps
on one or two devices of 2, 4 or 8 stages, and measurement noise from every recorded static
GPU run: runs whose stage timers were sound (GPU-bound sizes: ``quiet``) and runs whose
timers swung 2x while their steps did not (launch- and loader-bound sizes). A scenario's
noise is drawn by index into that library, so every run committed under ``analysis/logs``
draws the seed's scenarios anew.

Every scenario is held to the adaptation issue's targets: mean ratio to the oracle <= 1.03,
p95 <= 1.10, none worse than static by more than 2% (at `f6f306b`: measured 1.0278 / 1.076 /
1.017x, adaptive 1.0273 / 1.072 / 1.017x; sound timers alone 1.020 / 1.056 / 1.000x in both
modes). Misleading timers are where the policy is near the targets rather than under them:
on 300 other scenarios (seed 11, ``bench/results/simulator.json``) the mean is 1.032-1.033
and 4-5 runs are past 2% of static (docs/results/simulator.md), so a change that makes this draw worse
fails here.
"""

from __future__ import annotations

import json
from functools import lru_cache

import numpy as np
import pytest

from dynpipe.runtime.runlog import code_revision
from dynpipe.sim import simulator as sim

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
    # Sound timers: the targets, and so for every scenario, misleading timers
    # included.
    for group in (quiet, np.ones_like(quiet)):
        assert to_oracle[group].mean() <= 1.03, summary
        assert np.percentile(to_oracle[group], 95) <= 1.10, summary
        assert to_static[group].max() <= 1.02, summary


def test_command_line_summary_names_its_draw(tmp_path) -> None:
    """A summary written by the command line says which scenarios and code made it: two
    summaries compare only where the draw (seed, steps, noise library) is the same."""
    out = tmp_path / "sim.json"
    assert sim.main(["--scenarios", "2", "--seed", "3", "--modes", "measured", "-o", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["run"]["seed"] == 3 and got["run"]["steps"] == 240
    assert got["run"]["predictor"] == "predictor/h200.json.gz"
    # The checkout's commit (None outside a git checkout, unless DYNPIPE_REVISION names it).
    assert got["run"]["revision"] == code_revision()
    assert got["scenarios"] == 2 and set(got["measured"]) >= {"all"}
