"""Light ranks: a rank that holds too little work for its timers to see its device probes it.

Pure logic on synthetic windows (the estimates and the controller), then one gloo run in
which a light active rank's probes reach the window and the run log.
"""

from __future__ import annotations

import numpy as np
import pytest

# Layer 0 an embedding, 1..10 identical blocks, 11 a final norm: ms per microbatch forward
# (backward twice that).
COST = np.array([0.05] + [1.0] * 10 + [0.05])
N = len(COST)
MB = 4
# Rank 0 holds the embedding alone: too little work to read its device.
LIGHT = ((0, 1), (1, 6), (6, 12))
EVEN = ((0, 4), (4, 8), (8, 12))


def _base():
    from dynpipe.planner.costs import CostModel

    return CostModel(
        model="toy",
        layer_names=tuple(f"l{i}" for i in range(N)),
        fwd_ms=COST.copy(),
        bwd_ms=2 * COST,
        param_bytes=np.full(N, 1e5),
        out_bytes=np.full(N, 1e3),
        act_bytes=np.full(N, 1e3),
        opt_mult=np.full(N, 2.0),
        buffer_bytes=np.zeros(N),
        bandwidth=np.zeros(0),
        latency_ms=np.zeros(0),
        microbatch_size=8,
        meta={"link_bandwidth": 1e12, "link_latency_ms": 0.0},
    )


def _win(step: int, wide, seen, *, probes=None, k: int = 5):
    """A window of ``wide`` (one range per rank) where rank ``r``'s timers read every layer
    it holds at ``seen[r]`` x clean, and the steps follow the stages; ``probes``: rank ->
    slowdown its probe of layer 1 reads."""
    from dynpipe.runtime.adapt.window import Window

    active = [r for r, (a, b) in enumerate(wide) if b > a]
    bounds = tuple(wide[r] for r in active)
    lf = np.full(N, np.nan)
    for r in active:
        a, b = wide[r]
        lf[a:b] = COST[a:b] * seen[r]
    sf = np.array([lf[a:b].sum() for a, b in bounds])
    true = 3 * sf
    step_ms = MB * true.max() + true.sum()
    return Window(
        step=step,
        bounds=bounds,
        ranks=tuple(active),
        microbatches=MB,
        schedule="1f1b",
        step_ms=np.full(k, float(step_ms)),
        stage_fwd_ms=np.tile(sf * MB, (k, 1)),
        stage_bwd_ms=np.tile(2 * sf * MB, (k, 1)),
        layer_fwd_ms=lf,
        layer_bwd_ms=2 * lf,
        sampled_fwd_ms=sf,
        sampled_bwd_ms=2 * sf,
        idle=tuple(r for r in range(len(wide)) if r not in active),
        probes={r: (1, 1.0 * x, 2.0 * x) for r, x in probes.items()} if probes else None,
    )


def _estimates():
    from dynpipe.runtime.adapt.estimates import CostEstimates
    from dynpipe.runtime.adapt.policy import layer_classes

    base = _base()
    return CostEstimates(
        prior_fwd=base.fwd_ms[0],
        prior_bwd=base.bwd_ms[0],
        classes=layer_classes(base),
        num_ranks=3,
        window=8,
        jump=0.1,
    )


def _clean_windows(est, count: int) -> int:
    """Fold ``count`` windows of the EVEN plan on clean devices; returns the last step."""
    step = 0
    for _ in range(count):
        step += 5
        est.update(_win(step, EVEN, (1.0, 1.0, 1.0)))
    return step


def test_light_ranks_are_those_holding_less_than_half_a_probe_layer() -> None:
    est = _estimates()
    assert est.probe_layer() == 1  # a block (the median unit of work), first of its class
    assert est.light_probes(LIGHT) == {0: 1}
    assert est.light_probes(EVEN) == {}
    # A final norm alone is light too; an idle rank is not listed (it probes on its own).
    assert est.light_probes(((0, 11), (11, 12), (12, 12))) == {1: 1}
    # One block's work is enough to read the device: not light.
    assert est.light_probes(((0, 2), (2, 12), (12, 12))) == {}


def _feed(est, phases, *, probed: bool, step: int = 0):
    """Fold ``(windows, probe slowdown)`` phases of the LIGHT plan, the stages reading clean
    throughout (rank 0's timers cannot see its device); per window: (regime, slow[0],
    returning)."""
    out = []
    for count, x in phases:
        for _ in range(count):
            step += 5
            w = _win(step, LIGHT, (1.0, 1.0, 1.0), probes={0: x} if probed else None)
            est.update(w)
            out.append((est.regime, float(est.slow[0]), est.returning))
    return out


def test_a_light_ranks_probe_prices_its_device_and_shows_onset_and_end() -> None:
    est = _estimates()
    got = _feed(est, [(4, 1.0), (4, 3.0)], probed=True)
    regimes = [g[0] for g in got]
    assert regimes[:4] == [0] * 4
    # The onset: seen on its first probe (unconfirmed: no regime yet), confirmed on the
    # next, as a new regime.
    assert regimes[4] == 0 and got[4][2] == ()
    assert regimes[5] != 0 and len(set(regimes[5:8])) == 1
    slowed = regimes[5]
    # Priced slowed: a block moved to rank 0 would cost 3x its clean cost.
    assert got[7][1] == pytest.approx(3.0)
    fwd, bwd = est.costs(LIGHT, (0, 1, 2))
    assert fwd[0, 3] == pytest.approx(3.0) and bwd[0, 3] == pytest.approx(6.0)
    # Its own layer stays priced as its timers read it (they measure the embedding right).
    assert fwd[0, 0] == pytest.approx(COST[0])
    # The end: read as the clean regime one window early, then named so.
    got = _feed(est, [(4, 1.0)], probed=True, step=40)
    assert got[0][2] == (0,) and got[0][0] == slowed
    assert [g[0] for g in got[1:]] == [0] * 3
    assert got[-1][1] == pytest.approx(1.0)
    fwd, _ = est.costs(LIGHT, (0, 1, 2))
    assert fwd[0, 3] == pytest.approx(1.0)


def test_a_light_ranks_suspected_end_is_confirmed_by_its_first_reading_as_a_stage() -> None:
    # The interferer's end, seen on one probe (unconfirmed), and the controller gives the
    # rank layers on it: the rank's first reading as a stage confirms it, as its next probe
    # would have. Dropped with the probe, the clean conditions were counted as the
    # interferer's regime for the rest of a simulated run.
    est = _estimates()
    _feed(est, [(4, 1.0), (4, 3.0)], probed=True)
    slowed = est.regime
    _feed(est, [(1, 1.0)], probed=True, step=40)
    assert est.changing and est.regime == slowed
    est.update(_win(50, EVEN, (1.0, 1.0, 1.0)))
    assert not est.changing and est.regime == 0
    # A probe's dip that the stage does not bear out is refuted, not confirmed.
    est = _estimates()
    _feed(est, [(4, 1.0), (4, 3.0), (1, 1.0)], probed=True)
    slowed = est.regime
    est.update(_win(50, EVEN, (3.0, 1.0, 1.0)))
    assert est.regime == slowed


def test_predicted_slowdowns_are_calibrated_on_a_light_ranks_probe() -> None:
    # The predictor says rank 0's device runs every layer 3x slower (its telemetry); its
    # embedding's timers read clean, its probe 3x. Calibrated on the embedding the block
    # would be priced clean; on the probe, 3x.
    est = _estimates()
    _feed(est, [(4, 3.0)], probed=True)
    pred = np.ones((3, N)), np.ones((3, N))
    pred[0][0], pred[1][0] = 3.0, 3.0
    fwd, bwd = est.costs(LIGHT, (0, 1, 2), predicted=pred)
    assert fwd[0, 3] == pytest.approx(3.0, rel=0.02) and bwd[0, 3] == pytest.approx(6.0, rel=0.02)
    assert fwd[0, 0] == pytest.approx(COST[0])  # its own layer: as its timers read it


def test_without_its_probe_a_light_rank_reads_clean_throughout() -> None:
    # The blind spot itself: the same conditions, no probe, no change seen.
    est = _estimates()
    got = _feed(est, [(4, 1.0), (4, 3.0), (4, 1.0)], probed=False)
    assert [g[0] for g in got] == [0] * 12
    assert all(g[1] == pytest.approx(1.0) for g in got)


def test_a_probe_spike_is_not_a_change() -> None:
    est = _estimates()
    got = _feed(est, [(4, 1.0), (1, 3.0), (4, 1.0)], probed=True)
    assert [g[0] for g in got] == [0] * 9
    assert not est.changing


def test_a_rank_made_light_confirms_the_onset_its_stage_suspected() -> None:
    """Onset on rank 0's full stage, layers moved off it the next window: the probe (not the
    stage, which now reads its embedding at clean speed) confirms the change. Its first
    reading calibrates it to the stage's last (here a probe that reads 2x a layer's share,
    as one layer alone on a CPU did); the next confirms."""
    est = _estimates()
    step = _clean_windows(est, 4)
    step += 5
    est.update(_win(step, EVEN, (3.0, 1.0, 1.0)))
    assert est.changing and est.regime == 0
    step += 5
    est.update(_win(step, LIGHT, (1.0, 1.0, 1.0), probes={0: 6.0}))
    assert est.changing and est.regime == 0
    assert est.slow[0] == pytest.approx(3.0)
    step += 5
    est.update(_win(step, LIGHT, (1.0, 1.0, 1.0), probes={0: 6.0}))
    assert not est.changing and est.regime != 0
    assert est.slow[0] == pytest.approx(3.0) and est.load[0] == pytest.approx(3.0)
    # The interference ends: the biased probe reads 2x, which is clean for it.
    for _ in range(3):
        step += 5
        est.update(_win(step, LIGHT, (1.0, 1.0, 1.0), probes={0: 2.0}))
    assert est.regime == 0 and est.slow[0] == pytest.approx(1.0)
    # Without the probe, the light stage reads clean and the onset is taken for a spike.
    blind = _estimates()
    step = _clean_windows(blind, 4)
    blind.update(_win(step + 5, EVEN, (3.0, 1.0, 1.0)))
    blind.update(_win(step + 10, LIGHT, (1.0, 1.0, 1.0)))
    assert blind.regime == 0 and blind.slow[0] == pytest.approx(1.0)


def _controller(elastic: bool = False):
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.adapt.policy import Controller

    cfg = AdaptConfig(mode="measured", settle_windows=0, elastic=elastic)
    return Controller(base=_base(), config=cfg, num_ranks=3)


def _on_gpu(w):
    """``w`` as a GPU run logs it: the device's own times beside the layers' costs."""
    import dataclasses

    return dataclasses.replace(w, device_fwd_ms=w.layer_fwd_ms, device_bwd_ms=w.layer_bwd_ms)


@pytest.mark.parametrize("gpu", [True, False])
def test_on_a_gpu_a_light_ranks_probe_reads_its_device_uncalibrated(gpu: bool) -> None:
    # Rank 0's stage reads its device 4x slowed; its layers leave it (LIGHT) and its probe
    # reads 2.7x under the same interferer (one layer alone on a time-sliced GPU reads less
    # slowed than a whole stage), then 1.0 once the interferer is gone.
    est = _estimates()
    step = _clean_windows(est, 4)
    wrap = _on_gpu if gpu else (lambda w: w)
    for _ in range(2):
        step += 5
        est.update(wrap(_win(step, EVEN, (4.0, 1.0, 1.0))))
    for x in [2.7] * 3 + [1.0] * 3:
        step += 5
        est.update(wrap(_win(step, LIGHT, (1.0, 1.0, 1.0), probes={0: x})))
    if gpu:
        # The probe's reading is the device's time, as a clean cost is: the clean device
        # reads clean.
        assert est.slow[0] == pytest.approx(1.0, rel=0.02)
    else:
        # On a CPU one layer alone costs a part of its own (launch, autograd): the probe is
        # calibrated to the stage's last reading, and its changes read from there.
        assert est.slow[0] == pytest.approx(4.0 / 2.7, rel=0.02)


def _moves_back(probed: bool) -> list:
    """The controller on the LIGHT plan (rank 0's device slowed 3x, then clean again), its
    stages reading clean throughout: per window, the bounds it moves to (None: stays)."""
    ctl = _controller()
    out, step = [], 0
    for x in [3.0] * 6 + [1.0] * 6:
        step += 5
        d = ctl.observe(_win(step, LIGHT, (1.0, 1.0, 1.0), probes={0: x} if probed else None))
        out.append(d.bounds if d.repartition else None)
        if d.repartition:
            break  # the test reads the first move only
    return out


def test_only_a_light_rank_whose_device_reads_slowed_probes() -> None:
    ctl = _controller()
    # Clean: nothing to see end, so no probe (it would cost the first stage its time).
    assert ctl.est.light_probes(LIGHT) == {0: 1}
    assert ctl.light_probes(LIGHT) == {}
    step = 0
    for _ in range(4):
        step += 5
        ctl.observe(_win(step, EVEN, (1.0, 1.0, 1.0)))
    # Rank 0's full stage slows 3x: once its layers leave it (the LIGHT plan), it probes.
    for _ in range(2):
        step += 5
        ctl.observe(_win(step, EVEN, (3.0, 1.0, 1.0)))
    assert ctl.light_probes(LIGHT) == {0: 1}
    # Its probe reads the device slowed (its first reading calibrates it), then clean
    # again: probing stops.
    for x in (3.0, 3.0, 1.0, 1.0, 1.0):
        step += 5
        ctl.observe(_win(step, LIGHT, (1.0, 1.0, 1.0), probes={0: x}))
    assert ctl.est.slow[0] == pytest.approx(1.0, abs=0.05)
    assert ctl.light_probes(LIGHT) == {}


def test_the_controller_moves_layers_back_only_once_the_probe_reads_clean() -> None:
    # Probed: the slowed device keeps its light share while the probe reads 3x, and gets
    # layers back once it reads clean.
    probed = _moves_back(True)
    assert probed[:6] == [None] * 6, probed
    assert probed[-1] is not None and probed[-1][0][1] - probed[-1][0][0] > 1, probed
    # Blind: the stage reads clean, so the slowed device is priced clean and layers go
    # back to it while the interference lasts (the run measured on 4 x H200).
    blind = _moves_back(False)
    assert len(blind) <= 6 and blind[-1] is not None, blind


# ---- the training loop: a light active rank's probes reach the window and the log ----------

GPT = {"depth": 4, "width": 128, "heads": 2, "seq_len": 32, "vocab": 64}  # 6 layers
STEPS, EVERY = 25, 5


class _Recorder:
    """The real controller, recording the probes of every window it reads."""

    def __init__(self, inner) -> None:
        self.inner, self.mode_used = inner, inner.mode_used
        self.probes: list = []

    def observe(self, window):
        self.probes.append((window.step, dict(window.probes or {}), tuple(window.idle)))
        return self.inner.observe(window)

    def light_probes(self, key):
        # Every light rank probes here (the controller asks only on GPUs, and only for
        # devices that read slowed; these are clean CPUs): the test is of the probe's path
        # through the engine, the gather, the window and the log.
        return self.inner.est.light_probes(key)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _train(rank: int, world: int, log: str, plan: str, adapt: bool) -> dict:
    from dynpipe.models import get_model
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.adapt.make import make_policy
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.optim import OptimConfig
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    # min_gain 0.99: the controller reads every window but never moves layers.
    cfg_adapt = AdaptConfig(
        mode="measured" if adapt else "static",
        monitor_every=EVERY,
        settle_windows=0,
        min_gain=0.99,
    )
    cfg = TrainConfig(
        model="gpt",
        model_args=GPT,
        steps=STEPS,
        batch_size=8,
        microbatches=4,
        plan=plan,
        progress=False,
        log=log,
        telemetry=False,
        optim=OptimConfig(name="adamw", lr=1e-3, clip_grad=1.0),
        adapt=cfg_adapt,
    )
    policy = None
    if adapt:
        inner = make_policy(
            cfg_adapt, model=get_model("gpt", **GPT), microbatch_size=2, num_ranks=world
        )
        policy = _Recorder(inner)
    probed: list[int] = []
    final: dict = {}

    def on_step(engine, res) -> None:
        if res.probe is not None:
            probed.append(res.step)
        if res.step == STEPS - 1:
            final.update(model=engine.model_state(), optim=engine.optim_state())

    out = train(cfg, topo=Topology.from_env(device="cpu"), policy=policy, on_step=on_step)
    return {
        "losses": out["losses"],
        "probed": probed,
        "windows": policy.probes if policy is not None else [],
        **final,
    }


@pytest.mark.slow
def test_light_ranks_probe_in_training_without_changing_what_it_computes(tmp_path) -> None:
    import torch
    from distutil import run_ranks

    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.records import read_log

    model = get_model("gpt", **GPT)
    plan = tmp_path / "plan.json"
    # The embedding alone on rank 0, the head alone on rank 2: both light.
    Plan.from_bounds(model, [1, 4, 1], schedule="1f1b", microbatches=4).save(plan)
    log = tmp_path / "light.jsonl"
    got = run_ranks(_train, 3, str(log), str(plan), True, timeout_s=400)
    ref = run_ranks(_train, 3, str(tmp_path / "static.jsonl"), str(plan), False, timeout_s=400)
    # Probes change nothing training computes: parameters, optimizer state and losses are
    # bit-identical to the same plan run without them.
    for r in range(3):
        a, b = got[r]["value"], ref[r]["value"]
        assert a["losses"] == b["losses"]
        for key in ("model", "optim"):
            assert set(a[key]) == set(b[key])
            for k in a[key]:
                assert torch.equal(a[key][k], b[key][k]), (r, key, k)
    # The analytic prior prices every layer of so small a model alike (a per-kernel floor):
    # the ranks are light once the first window has measured the layers' clean costs.
    recs = read_log(log)
    light = [(e.step, e["ranks"]) for e in recs.events("light_probes")]
    assert len(light) == 1 and light[0][1] == {"0": 1, "2": 1}, light
    start = light[0][0]
    assert start <= 2 * EVERY, start
    sampled = [s for s in range(start, STEPS) if (s + 1) % EVERY == 0]
    # Ranks 0 and 2 probed a block on every sampled step from then on; rank 1 (four blocks)
    # never did, nor did any rank of the static run.
    assert got[0]["value"]["probed"] == sampled and got[2]["value"]["probed"] == sampled
    assert got[1]["value"]["probed"] == []
    assert all(r["value"]["probed"] == [] for r in ref)
    # Every window the controller read since carried both probes (on every rank alike; the
    # last window, with no step left to move at, is logged but not read).
    windows = got[0]["value"]["windows"]
    assert windows == got[1]["value"]["windows"]
    later = [(p, idle) for step, p, idle in windows if step >= start]
    assert len(later) == len([s for s in sampled if s + 2 < STEPS])
    for probes, idle in later:
        assert idle == () and set(probes) == {0, 2}
        assert all(i == 1 and f > 0 and b > 0 for i, f, b in probes.values())
    logged = [t.probes for t in recs.layer_times if t.step >= start]
    assert len(logged) == len(sampled)
    assert all(sorted(int(p[0]) for p in x) == [0, 2] for x in logged)


# ---- the simulator's blind stages ---------------------------------------------------------


@pytest.mark.slow
def test_simulated_blind_stage_runs_clean_and_its_probe_reads_the_device() -> None:
    from dynpipe.sim import simulator as sim

    workloads = {w.name: w for w in sim.load_workloads()}
    traces = sim.noise_from_logs()
    w = workloads["gpt-bs32"]
    cond = "gemm@1x1"

    def scenario(blind: bool) -> sim.Scenario:
        return sim.Scenario(
            seed=1,
            workload=w.name,
            stages=4,
            microbatches=4,
            steps=60,
            events=(((0, 60, cond),), (), (), ()),
            noise=((0, 0),) * 4,
            pause_fixed_ms=10.0,
            link_bytes_per_ms=20e6,
            blind=blind,
        )

    light = ((0, 1), (1, 5), (5, 9), (9, 14))  # the embedding alone on the slowed rank
    heavy = ((0, 4), (4, 8), (8, 11), (11, 14))
    truth = sim._Truth(scenario(True), w, traces)
    assert truth.blind(0, 1) and not truth.blind(0, 4)
    f, _ = truth.stage_loads(light, 30, (0, 1, 2, 3))
    cf, cb = w.times[sim.CLEAN]
    noise = truth.noise[0, 30]
    assert f[0] == pytest.approx((cf[0] + w.overhead_ms) * noise)
    f_heavy, _ = truth.stage_loads(heavy, 30, (0, 1, 2, 3))
    assert f_heavy[0] > 1.3 * (cf[0:4].sum() + w.overhead_ms) * noise
    # Not blind: the same light stage is slowed.
    seen = sim._Truth(scenario(False), w, traces)
    assert not seen.blind(0, 1)
    assert seen.stage_loads(light, 30, (0, 1, 2, 3))[0][0] > f[0]
    # The light rank's probe (a block) reads its device slowed, through the blind spot.
    win = [(1.0, np.ones(4), np.ones(4))] * 5
    got = sim._window(
        scenario(True),
        w,
        truth,
        light,
        (0, 1, 2, 3),
        win,
        30,
        np.random.default_rng(0),
        light={0: 1},
    )
    i, pf, pb = got.probes[0]
    assert i == 1 and (pf + pb) / (cf[1] + cb[1]) > 1.3


def test_a_rank_that_probes_only_windows_after_it_turned_light_reads_its_probe_uncalibrated():
    """Rank 0 turned light, and its light stage's timers read its device 30x for a window
    before it probed (a first stage's embedding on a slowed device did in the controller
    simulator). That reading is no whole stage's: calibrated to it, the probe never read
    the device clean again. The probe reads against the layer's clean cost instead."""
    est = _estimates()
    step = _clean_windows(est, 4)
    step += 5
    est.update(_win(step, LIGHT, (30.0, 1.0, 1.0)))  # light, not probing yet
    step += 5
    est.update(_win(step, LIGHT, (30.0, 1.0, 1.0), probes={0: 3.0}))
    assert est.slow[0] == pytest.approx(3.0)
    for _ in range(3):  # the interference ends
        step += 5
        est.update(_win(step, LIGHT, (1.0, 1.0, 1.0), probes={0: 1.0}))
    assert est.slow[0] == pytest.approx(1.0)
    fwd, _ = est.costs(LIGHT, (0, 1, 2))
    assert fwd[0, 3] == pytest.approx(1.0)


def test_a_light_ranks_stage_timers_are_no_noise_of_its_device() -> None:
    # Rank 0 light (the embedding alone, read by its probe), its stage timers swinging
    # 0.3-1x on their own: its device's noise is its probe's, and once it holds a stage
    # again its estimate is as certain as its readings there make it.
    est = _estimates()
    step = _clean_windows(est, 4)
    kept = list(est.steps[0])
    for seen in (1.0, 0.3, 1.0, 0.3, 1.0, 0.3):
        step += 5
        est.update(_win(step, LIGHT, (seen, 1.0, 1.0), probes={0: 1.0}))
        assert est.steps[0] == kept
        assert np.all(est.uncertainty()[1:] == 0.0)  # nor, pooled, the other ranks'
    for _ in range(2):
        step += 5
        est.update(_win(step, EVEN, (1.0, 1.0, 1.0)))
    assert est.uncertainty()[0] < 0.05
