"""The model core (``ModelPolicy``, ``belief``): scenario tests that assert where a run ends
and how fast, the device filter's change points, and a relaunch that decides as the
uninterrupted run does. Pure logic on synthetic windows; no process group."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dynpipe.errors import UserError
from dynpipe.planner.costs import CostModel
from dynpipe.planner.simulate import step_times
from dynpipe.runtime.adapt.belief import Device, move_lcb
from dynpipe.runtime.adapt.config import AdaptConfig
from dynpipe.runtime.adapt.model import ModelPolicy
from dynpipe.runtime.adapt.window import Window

L, S, M, EVERY = 12, 2, 4, 5


def _base() -> CostModel:
    n = L
    return CostModel(
        model="toy",
        layer_names=tuple(f"l{i}" for i in range(n)),
        fwd_ms=np.full(n, 1.0),
        bwd_ms=np.full(n, 2.0),
        param_bytes=np.full(n, 1e6),
        out_bytes=np.full(n, 1e3),
        act_bytes=np.full(n, 1e3),
        opt_mult=np.full(n, 2.0),
        buffer_bytes=np.zeros(n),
        bandwidth=np.zeros(0),
        latency_ms=np.zeros(0),
        microbatch_size=1,
        meta={"link_bandwidth": 100e9, "link_latency_ms": 0.0},
    )


def _window(step: int, bounds, slow: list[float], rng: np.random.Generator) -> Window:
    """One window of a toy pipeline: every layer 1 + 2 ms clean, device ``d`` ``slow[d]``
    times slower, a little timer noise."""
    k = EVERY
    f = np.array([[slow[s] * (b - a) * 1.0 for s, (a, b) in enumerate(bounds)]] * k)
    b_ = 2.0 * f
    noise = rng.lognormal(0.0, 0.005, size=f.shape)
    f, b_ = f * noise, b_ * noise
    comm = np.zeros((k, S - 1))
    steps = step_times(f, b_, comm, schedule="1f1b", microbatches=M)
    lf = np.empty(L)
    for s, (a, b) in enumerate(bounds):
        lf[a:b] = slow[s] * rng.lognormal(0.0, 0.01, size=b - a)
    return Window(
        step=step,
        bounds=tuple(bounds),
        ranks=tuple(range(S)),
        microbatches=M,
        schedule="1f1b",
        step_ms=steps,
        stage_fwd_ms=f * M,
        stage_bwd_ms=b_ * M,
        layer_fwd_ms=lf,
        layer_bwd_ms=2.0 * lf,
        sampled_fwd_ms=np.array([lf[a:b].sum() for a, b in bounds]),
        sampled_bwd_ms=np.array([2.0 * lf[a:b].sum() for a, b in bounds]),
    )


def _best(slow: list[float]):
    """The truly best split of the toy pipeline (every split timed)."""

    def step(k: int) -> float:
        f = np.array([[slow[0] * k, slow[1] * (L - k)]])
        return float(step_times(f, 2 * f, np.zeros((1, 1)), schedule="1f1b", microbatches=M)[0])

    k = min(range(1, L), key=step)
    return ((0, k), (k, L))


def _run(slowdown_at: int | None, *, steps: int = 200, policy=None, seed: int = 0, start=None):
    """Drive a policy over a toy run (device 1 slows 2x at ``slowdown_at``); returns the
    policy, the decisions and the step of every move."""
    rng = np.random.default_rng(seed)
    policy = policy or ModelPolicy(
        base=_base(), config=AdaptConfig(mode="measured", core="model"), num_ranks=S
    )
    bounds = start or ((0, 6), (6, 12))
    decisions, moves = [], []
    for end in range(EVERY - 1, steps, EVERY):
        slow = [1.0, 2.0 if slowdown_at is not None and end >= slowdown_at else 1.0]
        d = policy.observe(_window(end, bounds, slow, rng))
        decisions.append(None if d is None else (d.repartition, d.bounds))
        if d is not None and d.repartition:
            moves.append(end)
            bounds = d.bounds
            policy.applied(step=end + 1, pause_ms=5.0, moved_bytes=0)
    return policy, decisions, moves, bounds


def test_holds_the_best_split_without_a_slowdown():
    _, _, moves, bounds = _run(None)
    assert moves == [] and bounds == _best([1.0, 1.0]) == ((0, 6), (6, 12))


def test_moves_off_a_slowed_device_at_once_and_holds_there():
    onset = 102
    _, _, moves, bounds = _run(onset)
    assert bounds == _best([1.0, 2.0]), bounds
    assert moves and moves[0] - onset <= 2 * EVERY, moves  # the first full window acts
    assert len(moves) == 1, moves  # and it holds there


def test_starts_from_a_bad_split_and_reaches_the_best():
    _, _, moves, bounds = _run(None, start=((0, 2), (2, 12)))
    assert bounds == ((0, 6), (6, 12)) and len(moves) == 1


@pytest.mark.parametrize("cut", [10, 13])  # windows before the relaunch: before the onset
def test_relaunch_mid_run_decides_as_the_uninterrupted_run(cut):  # or between move and verdict
    onset = 60
    _, full, _, _ = _run(onset, steps=240)
    rng = np.random.default_rng(0)
    cfg = AdaptConfig(mode="measured", core="model")
    a = ModelPolicy(base=_base(), config=cfg, num_ranks=S)
    bounds, got = ((0, 6), (6, 12)), []
    for i, end in enumerate(range(EVERY - 1, 240, EVERY)):
        if i == cut:  # a relaunch: the saved state through JSON into a fresh policy
            b = ModelPolicy(base=_base(), config=cfg, num_ranks=S)
            b.load_state(json.loads(json.dumps(a.state())))
            assert b.state() == a.state()
            a = b
        slow = [1.0, 2.0 if end >= onset else 1.0]
        d = a.observe(_window(end, bounds, slow, rng))
        got.append(None if d is None else (d.repartition, d.bounds))
        if d is not None and d.repartition:
            bounds = d.bounds
            a.applied(step=end + 1, pause_ms=5.0, moved_bytes=0)
    assert got == full
    assert any(x is not None and x[0] for x in got)  # the run moved


def test_device_filter_finds_a_change_and_a_return():
    rng = np.random.default_rng(1)
    dev = Device()
    changes = []
    levels = [0.0] * 20 + [0.4] * 20 + [0.0] * 20
    for i, y in enumerate(levels):
        if dev.update(y + rng.normal(0, 0.02), r0=4e-4, r_prior=4e-4, change_h=4.0, check=True):
            changes.append(i)
    assert changes[:1] == [20] and 40 in changes[1:3], changes
    assert dev.seg == 0  # the return rejoined the first segment
    assert abs(dev.s) < 0.05


def test_device_filter_learns_swinging_timers_and_stays_put():
    rng = np.random.default_rng(2)
    dev = Device()
    changes = [
        dev.update(rng.normal(0, 0.2), r0=1e-4, r_prior=1e-4, change_h=4.0, check=True)
        for _ in range(80)
    ]
    assert dev.r > 0.01  # it learned a wide noise
    assert sum(changes[20:]) <= 2  # and once learned, swings seldom read as changes


def test_noise_prior_keeps_early_swings_from_reading_as_changes():
    # Timers that swing by 15% from the first window (a launch-bound run): with no prior
    # the first windows teach a narrow noise and the swings open segments; with a prior
    # as wide as the swings they do not, and a real 2x onset is still found at once.
    def changes(r_prior: float) -> list[int]:
        rng = np.random.default_rng(3)
        dev, out = Device(), []
        for i in range(30):
            y = rng.normal(0, 0.15) + (0.7 if i >= 20 else 0.0)
            if dev.update(y, r0=1e-4, r_prior=r_prior, change_h=4.0, check=True):
                out.append(i)
        return out

    assert any(i < 20 for i in changes(1e-4))
    assert not any(i < 20 for i in changes(0.15**2))
    assert 20 in changes(0.15**2) or 21 in changes(0.15**2)


def test_move_rule_weighs_gain_against_pause_and_doubt():
    kw = {"now_ms": 100.0, "pause_ms": 50.0, "horizon": 100, "z": 1.28}
    assert move_lcb(d=0.1, var_d=1e-4, **kw) > 0  # a sure 10% gain pays 50 ms
    assert move_lcb(d=0.1, var_d=0.04, **kw) < 0  # the same gain, doubted by 20%
    assert move_lcb(d=0.003, var_d=0.0, **kw) < 0  # too small to pay the pause


@pytest.mark.parametrize(
    "kw",
    [
        {"core": "fast"},
        {"confidence": 1.0},
        {"model_error": 0},
        {"change_h": 0},
        {"noise_prior": 0},
    ],
)
def test_bad_model_settings_are_refused(kw):
    with pytest.raises(UserError):
        AdaptConfig(**kw)
