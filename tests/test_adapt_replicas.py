"""The replica policy on synthetic windows (pure logic, no process group): it shifts batch
share away from a replica one of whose devices slows, moves every replica's layers when the
same stage slows in all of them, returns when the devices recover, drops a replica's share
only when partial reduce is switched on and only when that wins per counted sample."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from dynpipe.models import get_model
from dynpipe.planner.costs import CostModel
from dynpipe.planner.simulate import step_times
from dynpipe.runtime.adapt.config import AdaptConfig
from dynpipe.runtime.adapt.replicas import ReplicaConfig, ReplicaPolicy, best_shares
from dynpipe.runtime.adapt.window import Window

MODEL = get_model("mlp", depth=10, width=64)
L = len(MODEL)
_BASE = CostModel.from_model(MODEL, microbatch_size=4, num_devices=1)
# Milliseconds-sized layer costs (the analytic model's are microseconds for this mlp).
CF, CB = _BASE.fwd_ms[0] * 1e3, _BASE.bwd_ms[0] * 1e3
BASE = dataclasses.replace(_BASE, fwd_ms=CF[None], bwd_ms=CB[None])


def _window(step: int, cfg: ReplicaConfig, slow, *, schedule: str, k: int = 5) -> Window:
    """What a run of ``cfg`` measures when device (replica r, stage s) runs ``slow[r][s]``
    times slower: per-layer and per-stage times, the job's step (the slowest replica)."""
    subs, pipes = [], []
    for r, share in enumerate(cfg.shares):
        m = 0 if r in cfg.dropped else share
        lf = np.concatenate([CF[a:b] * slow[r][s] for s, (a, b) in enumerate(cfg.bounds)])
        lb = np.concatenate([CB[a:b] * slow[r][s] for s, (a, b) in enumerate(cfg.bounds)])
        sf = np.array([lf[a:b].sum() for a, b in cfg.bounds])
        sb = np.array([lb[a:b].sum() for a, b in cfg.bounds])
        if m:  # a left-out replica computes nothing
            pipe = step_times(
                sf[None],
                sb[None],
                np.zeros((1, len(cfg.bounds) - 1)),
                schedule=schedule,
                microbatches=m,
            )[0]
            pipes.append(float(pipe))
        subs.append(
            Window(
                step=step,
                bounds=cfg.bounds,
                ranks=tuple(range(len(cfg.bounds))),
                microbatches=m,
                schedule=schedule,
                step_ms=np.full(k, (sf + sb).max() * m),
                stage_fwd_ms=np.tile(sf * m, (k, 1)),
                stage_bwd_ms=np.tile(sb * m, (k, 1)),
                layer_fwd_ms=lf,
                layer_bwd_ms=lb,
                sampled_fwd_ms=sf,
                sampled_bwd_ms=sb,
            )
        )
    job = max(pipes) * 1.02  # the all-reduce and the optimizer
    return dataclasses.replace(
        subs[0],
        step_ms=np.full(k, job),
        replicas=tuple(subs),
        shares=cfg.shares,
        dropped=cfg.dropped,
        reduce_ms=np.zeros((k, len(cfg.shares))),
    )


def _run(slowdowns, *, schedule="gpipe", partial=False, windows=40, stages=2):
    """Drive the policy over ``windows`` windows; ``slowdowns(w)`` gives ``slow[r][s]``.
    Returns the configuration held in each window and the decisions that moved."""
    policy = ReplicaPolicy(
        base=BASE,
        config=AdaptConfig(
            mode="measured", settle_windows=0, partial_reduce=partial, horizon_steps=50
        ),
        num_stages=stages,
        dp=2,
    )
    half = ((0, L // 2), (L // 2, L))
    cfg = ReplicaConfig(bounds=half if stages == 2 else ((0, L),), shares=(4, 4))
    held, moves = [], []
    for w in range(windows):
        held.append(cfg)
        d = policy.observe(_window(w * 5 + 4, cfg, slowdowns(w), schedule=schedule))
        if d is not None and d.repartition:
            moves.append((w, d))
            cfg = ReplicaConfig(bounds=d.bounds, shares=d.shares, dropped=d.dropped)
            policy.applied(step=w * 5 + 5, pause_ms=1.0, moved_bytes=d.moved_bytes)
    return held, moves


def test_one_slow_device_shifts_batch_share_away_and_back() -> None:
    onset, end = 10, 25
    held, moves = _run(lambda w: [[1, 1], [1, 3.0 if onset <= w < end else 1]])
    assert [w for w, _ in moves] == [onset, end], [(w, d.reason) for w, d in moves]
    during = held[onset + 1]
    assert during.shares[0] > during.shares[1] and sum(during.shares) == 8
    assert not during.dropped
    assert held[-1] == held[0]  # back to the even split and shares


def test_the_same_stage_slowed_in_every_replica_moves_layers_of_all() -> None:
    held, moves = _run(lambda w: [[1, 2.0 if 10 <= w < 20 else 1]] * 2)
    assert [w for w, _ in moves] == [10, 20]
    during = held[11]
    a, b = during.bounds[0]
    assert b - a > L // 2 and during.shares == (4, 4)  # layers left the slowed stage
    assert moves[0][1].moved_bytes > 0


def test_partial_reduce_only_when_on_and_only_when_it_wins_per_sample() -> None:
    # Data parallelism alone (one stage), one replica's device 12x slower: the best shares
    # still wait for its one microbatch (12 units against 4 clean); leaving its share out
    # takes 4 units for half the samples, 8 per batch.
    onset, end = 10, 30

    def slow(w: int):
        return [[1], [12.0 if onset <= w < end else 1]]

    held, moves = _run(slow, partial=True, stages=1, windows=50)
    dropped = [w for w, c in enumerate(held) if c.dropped]
    assert dropped and all(held[w].dropped == (1,) for w in dropped)
    # First the best exact move; once the next window confirms the slowdown, partial.
    assert dropped[0] == onset + 2, [(w, d.reason) for w, d in moves]
    assert "partial reduce" in next(d.reason for _, d in moves if d.dropped)
    # Left out, its device is not measured: its share comes back to re-measure it (every
    # horizon), goes again while the device is slow, and stays once it has recovered.
    assert any("re-measure" in d.reason for _, d in moves)
    assert not held[-1].dropped and held[-1].shares == (4, 4)
    exact, _ = _run(slow, partial=False, stages=1, windows=50)
    assert not any(c.dropped for c in exact) and exact[onset + 1].shares == (7, 1)
    # A slowdown the exact options absorb is handled exactly even with partial reduce on.
    mild, _ = _run(lambda w: [[1, 1], [1, 3.0 if 10 <= w < 25 else 1]], partial=True)
    assert not any(c.dropped for c in mild)


def test_noisy_estimates_that_steps_do_not_follow_move_nothing() -> None:
    # A device's stage timers jump 3x, but the job's steps do not move: not acted on.
    policy = ReplicaPolicy(
        base=BASE, config=AdaptConfig(mode="measured", settle_windows=0), num_stages=2, dp=2
    )
    cfg = ReplicaConfig(bounds=((0, L // 2), (L // 2, L)), shares=(4, 4))
    clean = _window(4, cfg, [[1, 1], [1, 1]], schedule="gpipe")
    decisions = [policy.observe(dataclasses.replace(clean, step=4 + 5 * w)) for w in range(4)]
    liar = _window(24, cfg, [[1, 1], [1, 3.0]], schedule="gpipe")
    liar = dataclasses.replace(liar, step_ms=clean.step_ms)
    d = policy.observe(liar)
    assert not any(x.repartition for x in decisions)
    assert not d.repartition and "not acted on" in d.reason


@pytest.mark.parametrize("total,low", [(8, (1, 1)), (12, (2, 2, 2)), (9, (3, 1))])
def test_best_shares_is_the_min_max_optimum(total: int, low: tuple[int, ...]) -> None:
    rng = np.random.default_rng(total)
    per = rng.uniform(1, 5, size=len(low))
    fixed = rng.uniform(0, 3, size=len(low))

    def step(r: int, m: int) -> float:
        return float(fixed[r] + per[r] * m)

    shares, worst = best_shares(step, total=total, low=low)
    assert sum(shares) == total and all(s >= lo for s, lo in zip(shares, low, strict=True))
    brute = min(
        max(step(r, m) for r, m in enumerate(c))
        for c in itertools.product(*[range(lo, total + 1) for lo in low])
        if sum(c) == total
    )
    assert worst == pytest.approx(brute)


def test_policy_state_round_trips() -> None:
    held, _ = _run(lambda w: [[1, 1], [1, 3.0 if w >= 3 else 1]], windows=6)
    policy = ReplicaPolicy(
        base=BASE, config=AdaptConfig(mode="measured", settle_windows=0), num_stages=2, dp=2
    )
    for w, cfg in enumerate(held):
        win = _window(w * 5 + 4, cfg, [[1, 1], [1, 3.0 if w >= 3 else 1]], schedule="gpipe")
        policy.observe(_with_updates(win, [[1.0, 2.0], [1.5, 6.0]]))
    again = ReplicaPolicy(
        base=BASE, config=AdaptConfig(mode="measured", settle_windows=0), num_stages=2, dp=2
    )
    again.load_state(policy.state())
    assert again.memory.entries == policy.memory.entries
    assert np.allclose(again.est[1].run_f, policy.est[1].run_f)
    rates = policy.state()["update_rates"]
    assert None not in rates and again.state()["update_rates"] == rates


def test_a_move_that_falls_short_of_its_promise_raises_the_gain_the_next_needs() -> None:
    policy = ReplicaPolicy(
        base=BASE, config=AdaptConfig(mode="measured", settle_windows=0), num_stages=2, dp=2
    )
    # Clean devices, uneven shares: the model proposes even shares once it has seen this
    # configuration for a window (conditions do not change in between).
    cfg = ReplicaConfig(bounds=((0, L // 2), (L // 2, L)), shares=(6, 2))
    clean = [[1, 1], [1, 1]]
    first = policy.observe(_window(4, cfg, clean, schedule="gpipe"))
    before = _window(9, cfg, clean, schedule="gpipe")
    d = policy.observe(before)
    assert not first.repartition and d.repartition and d.shares == (4, 4)
    assert policy.required_gain() == pytest.approx(policy.config.min_gain)
    policy.applied(step=10, pause_ms=1.0, moved_bytes=0)
    moved = ReplicaConfig(bounds=d.bounds, shares=d.shares, dropped=d.dropped)
    # The steps did not get faster at all: the promised gain was not there.
    after = _window(14, moved, clean, schedule="gpipe")
    policy.observe(dataclasses.replace(after, step_ms=before.step_ms))
    promised = d.proposed_ms / d.current_ms
    assert policy.required_gain() == pytest.approx(1 / promised - 1, rel=1e-6)
    assert policy.required_gain() > 0.2


def test_layer_moves_stay_within_every_replicas_free_memory() -> None:
    from dynpipe.planner.evaluate import stage_costs

    half = ((0, L // 2), (L // 2, L))
    need = stage_costs(BASE, half, schedule="gpipe", microbatches=4).mem_bytes[0]
    policy = ReplicaPolicy(
        base=BASE, config=AdaptConfig(mode="measured", settle_windows=0), num_stages=2, dp=2
    )
    cfg = ReplicaConfig(bounds=half, shares=(4, 4))
    moves = []
    for w in range(8):
        slow = [[1, 2.0 if w >= 3 else 1]] * 2
        win = _window(4 + 5 * w, cfg, slow, schedule="gpipe")
        # Replica 1's first device has room for no more than the layers it holds.
        mem = [np.array([np.inf, np.inf]), np.array([need * 1.01, np.inf])]
        subs = tuple(
            dataclasses.replace(s, memory_bytes=m) for s, m in zip(win.replicas, mem, strict=True)
        )
        d = policy.observe(dataclasses.replace(win, replicas=subs))
        if d.repartition:
            moves.append(d)
            cfg = ReplicaConfig(bounds=d.bounds, shares=d.shares, dropped=d.dropped)
            policy.applied(step=5 + 5 * w, pause_ms=1.0, moved_bytes=0)
    assert all(d.bounds[0][1] <= L // 2 for d in moves), [d.bounds for d in moves]
    # Without the limit the same slowdown moves layers onto the first stage.
    _, free = _run(lambda w: [[1, 2.0 if w >= 3 else 1]] * 2, windows=8)
    assert any(d.bounds[0][1] > L // 2 for _, d in free)


def test_a_one_stage_replica_prices_no_layer_from_predicted_slowdowns() -> None:
    """Every layer of a one-stage replica is on the device that measures it: its costs are
    the same whatever the predictor says (so the replica policy does not ask it)."""
    policy = ReplicaPolicy(
        base=BASE, config=AdaptConfig(mode="measured", settle_windows=0), num_stages=1, dp=2
    )
    cfg = ReplicaConfig(bounds=((0, L),), shares=(4, 4))
    for w in range(3):
        policy.observe(_window(4 + 5 * w, cfg, [[1.0], [2.5]], schedule="gpipe"))
    rng = np.random.default_rng(0)
    for est in policy.est:
        plain = est.costs(((0, L),), (0,))
        for _ in range(3):
            pred = (rng.uniform(0.5, 4, (1, L)), rng.uniform(0.5, 4, (1, L)))
            got = est.costs(((0, L),), (0,), predicted=pred)
            assert np.array_equal(got[0], plain[0]) and np.array_equal(got[1], plain[1])


def test_priced_lists_what_the_decision_weighed_the_current_configuration_first() -> None:
    policy = ReplicaPolicy(
        base=BASE,
        config=AdaptConfig(mode="measured", settle_windows=0, reshape=True),
        num_stages=2,
        dp=2,
    )
    cfg = ReplicaConfig(bounds=((0, L // 2), (L // 2, L)), shares=(4, 4))
    for w in range(4):  # up to the first move (the configuration held throughout)
        win = _window(4 + 5 * w, cfg, [[1, 1], [1, 3.0]], schedule="gpipe")
        d = policy.observe(win)
        if d.repartition:
            break
    priced = policy.priced(win)
    assert priced[0][1] == cfg and priced[0][0] == pytest.approx(d.current_ms)
    assert {c.shape for _, c in priced} == {(2, 2), (1, 4), (4, 1)}
    assert d.repartition and min(priced, key=lambda x: x[0])[0] == pytest.approx(d.proposed_ms)
    # Pricing changes nothing: the same window decides the same again.
    again = policy.priced(win)
    assert [(round(t, 9), c) for t, c in again] == [(round(t, 9), c) for t, c in priced]


def _with_updates(win: Window, per_rank: list[list[float]]) -> Window:
    """``win`` with each replica's stages timing ``per_rank[r][s]`` ms of optimizer update."""
    k = len(win.step_ms)
    subs = tuple(
        dataclasses.replace(sub, update_ms=np.tile(np.asarray(per_rank[r], float), (k, 1)))
        for r, sub in enumerate(win.replicas or ())
    )
    return dataclasses.replace(win, replicas=subs, update_ms=subs[0].update_ms)


def test_the_update_is_priced_per_device_by_the_parameters_it_would_hold() -> None:
    """Measured updates price every shape: a device's rate (ms per parameter byte, from
    what it holds now) times the bytes it would hold, after the stage's last backward and
    reduce; a reduce is exposed only beyond the stage's own last backward (DDP's buckets
    overlap it). Without updates in the windows the pricing is as before."""
    from dynpipe.planner.shape import tail_parts

    def priced(updates: list[list[float]] | None) -> dict[tuple[int, int], float]:
        policy = ReplicaPolicy(
            base=BASE,
            config=AdaptConfig(mode="measured", settle_windows=0, reshape=True),
            num_stages=1,
            dp=2,
        )
        cfg = ReplicaConfig(bounds=((0, L),), shares=(4, 4))
        for w in range(2):
            win = _window(4 + 5 * w, cfg, [[1.0], [1.0]], schedule="gpipe")
            if updates is not None:
                win = _with_updates(win, updates)
            policy.observe(win)
        best: dict[tuple[int, int], float] = {}
        for ms, c in policy.priced(win):
            # The even split of one pipeline and DP only's even shares, as planned.
            if c.shape == (2, 1) and c.shares == (4, 4):
                best[(2, 1)] = ms
            if c.shape == (1, 2) and c.bounds == ((0, L // 2), (L // 2, L)):
                best[(1, 2)] = ms
        return best

    u0, u1 = 3.0, 7.0  # DP only: rank 1's device updates the same parameters slower
    plain, timed = priced(None), priced([[u0], [u1]])
    reduce, _, own = tail_parts(BASE, bounds=((0, L),), replicas=2)
    assert timed[(2, 1)] - plain[(2, 1)] == pytest.approx(
        max(reduce[0] - own[0], 0.0) + u1 - reduce[0]
    )
    # One pipeline: each half's update at the rate of the device that would hold it, the
    # second stage's hidden by the first stage's last backward.
    half = ((0, L // 2), (L // 2, L))
    pb = BASE.param_bytes
    share = [pb[a:b].sum() / pb.sum() for a, b in half]
    _, lead, _ = tail_parts(BASE, bounds=half, replicas=1)
    want = max(u0 * share[0] - lead[0], u1 * share[1] - lead[1], 0.0)
    assert want > 0
    assert timed[(1, 2)] - plain[(1, 2)] == pytest.approx(want)


def test_a_moves_cost_counts_its_first_step_and_stand_beyond_the_others() -> None:
    """The pause a move logs is what the ranks timed; its first step (communicators and
    buffers set up on first use) and the job's stand before it can cost more. Once the
    window starting with the move's first step is in, that whole cost is the move's."""
    policy = ReplicaPolicy(
        base=BASE, config=AdaptConfig(mode="measured", settle_windows=0), num_stages=2, dp=2
    )
    cfg = ReplicaConfig(bounds=((0, L // 2), (L // 2, L)), shares=(4, 4))
    policy.observe(_window(4, cfg, [[1, 1], [1, 1]], schedule="gpipe"))
    policy.applied(step=5, pause_ms=40.0, moved_bytes=0)
    assert policy.pause_ms == pytest.approx(40.0)
    win = _window(9, cfg, [[1, 1], [1, 1]], schedule="gpipe")
    steps = win.step_ms.copy()
    steps[0] += 400.0  # the first step under the new plan
    between = np.array([70.0, 1.0, 1.5, 1.0, 0.5])  # the stand before it, then the others'
    d = policy.observe(dataclasses.replace(win, step_ms=steps, between_ms=between))
    assert policy.pause_ms == pytest.approx(69.0 + 400.0)
    assert d is not None and d.pause_ms == pytest.approx(469.0)
    # A later window is not the move's: nothing changes.
    later = dataclasses.replace(_window(14, cfg, [[1, 1], [1, 1]], schedule="gpipe"), step_ms=steps)
    policy.observe(later)
    assert policy.pause_ms == pytest.approx(469.0)
