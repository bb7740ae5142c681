"""The replica policy replayed over a recorded 4 x H200 data x pipeline run
(``bench/replay_replicas.py``): the windows it rebuilds are the ones the run's policy read,
and the policy makes the run's decisions on them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOG = ROOT / "analysis" / "logs" / "dp-pp-h200x4-6bdb40a" / "vgg16-adaptive.jsonl"


def _tool():
    spec = importlib.util.spec_from_file_location(
        "replay_replicas", ROOT / "bench" / "replay_replicas.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def replayed():
    return _tool().replay(LOG, device_mib=143771)


def test_windows_are_the_runs_windows_under_the_plans_it_held(replayed) -> None:
    from dynpipe.runtime.records import read_log

    log = read_log(LOG)
    logged = {e["window_step"] for e in log.events("decision")}
    steps = [r.window.step for r in replayed]
    assert logged <= set(steps)
    # Each window's replicas and shares are the plan its steps ran under.
    shapes = {r.window.step: (r.window.dp, r.window.num_stages) for r in replayed}
    assert shapes[9] == (2, 2) and shapes[24] == (4, 1)  # reshaped at step 16
    shares = {r.window.step: r.window.shares for r in replayed}
    assert shares[74] == (2, 3, 2, 1) and shares[134] == (2, 2, 2, 2)


# Windows whose plan in force the model prices differently since the run was recorded, and
# the price now. A microbatch's host time is one total over its forward and backward since
# ``host_factor``: the 2 x 2 plan that ran 50.40 / 50.32 ms was priced 50.26 / 50.14 by each
# phase's longer time, and 49.66 now; every decision stays the run's.
REPRICED = {9: 49.66, 14: 49.66}


def test_the_policy_decides_what_the_run_decided(replayed) -> None:
    """The recorded run's decisions, window by window (its reasons carry the numbers). A
    change of the replica policy that changes them fails here: say so and update the log
    (or, where only the price of the plan in force moved, ``REPRICED``)."""
    got = [r for r in replayed if r.logged is not None]
    assert len(got) == 31
    for r in got:
        assert r.decision is not None
        want_ms, reason = r.logged["current_ms"], r.logged["reason"]
        if r.window.step in REPRICED:
            reason = reason.replace(f"{want_ms:.2f} ->", f"{REPRICED[r.window.step]:.2f} ->")
            want_ms = REPRICED[r.window.step]
        assert r.decision.reason == reason, r.window
        rel = 1e-3 if r.window.step in REPRICED else 1e-4  # REPRICED holds two decimals
        assert r.decision.current_ms == pytest.approx(want_ms, rel=rel)
