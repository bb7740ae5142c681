"""Elastic pipelines: plans over a subset of the ranks keep training exact.

A 4-rank pipeline drops to 3 and then 2 active stages and grows back, by forced live
repartitions; the idle ranks hold nothing, take part in every collective, and the run ends
bit-identical (parameters and optimizer state) to single-process training.
"""

from __future__ import annotations

import pytest
import torch
from distutil import run_ranks
from test_runtime_equivalence import BATCH, make_batch, optim_config

pytestmark = pytest.mark.slow

STEPS = 10
MODEL = {"depth": 6, "width": 32}  # 8 layers


def _elastic_plans(model):
    from dynpipe.planner import Plan

    # step -> plan: 4 stages -> 3 (rank 3 idle) -> 2 (ranks 1 and 3 idle) -> 3 -> 4.
    return {
        2: Plan.from_bounds(model, [3, 3, 2], ranks=[0, 1, 2]),
        4: Plan.from_bounds(model, [5, 3], ranks=[0, 2]),
        6: Plan.from_bounds(model, [2, 3, 3], ranks=[1, 2, 3]),
        8: Plan.even(model, 4),
    }


def _engine_run(rank: int, world: int, opt: str) -> dict:
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.migrate import repartition
    from dynpipe.runtime.topology import Topology

    model = get_model("mlp", **MODEL)
    eng = PipelineEngine(
        model,
        Plan.even(model, world),
        topo=Topology.from_env(device="cpu"),
        config=EngineConfig(batch_size=BATCH, optim=optim_config(opt)),
    )
    plans = _elastic_plans(model)
    idle, losses, probes, evals = [], [], [], []
    for s in range(STEPS):
        if s in plans:
            repartition(eng, plans[s])
        idle.append(eng.idle)
        if s == 5:
            # Held-out batches through two stages while ranks 1 and 3 hold nothing.
            evals.append(eng.evaluate([make_batch(model, 100 + i) for i in range(2)]))
        res = eng.step(s, make_batch(model, s), sample_layers=True)
        losses.append(res.loss)
        if eng.idle:
            probes.append(res.timing.layers is not None and res.timing.layers.fwd_ms[0] > 0)
    return {
        "model": eng.model_state(),
        "optim": eng.optim_state(),
        "idle": idle,
        "losses": losses,
        "probes": probes,
        "eval": evals[0].to_dict(),
    }


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_drop_to_three_then_two_stages_and_back_is_bit_identical(opt: str) -> None:
    from dynpipe.models import get_model
    from dynpipe.runtime.reference import ReferenceTrainer

    torch.set_num_threads(1)
    results = run_ranks(_engine_run, 4, opt)
    ref = ReferenceTrainer(
        model=get_model("mlp", **MODEL), batch_size=BATCH, microbatches=4, optim=optim_config(opt)
    )
    want_losses = []
    for s in range(STEPS):
        if s == 5:
            want_eval = ref.evaluate([make_batch(ref.model, 100 + i) for i in range(2)])
        want_losses.append(ref.step(s, make_batch(ref.model, s)))
    for r in results:  # every rank, idle or not, returns the same evaluation
        got_eval = r["value"]["eval"]
        assert (got_eval["loss"], got_eval["accuracy"]) == (want_eval.loss, want_eval.accuracy)
    model, optim = {}, {}
    for r in results:
        model.update(r["value"]["model"])
        optim.update(r["value"]["optim"])
    want_m, want_o = ref.model_state(), ref.optim_state()
    assert set(model) == set(want_m) and set(optim) == set(want_o)
    for k in want_m:
        assert torch.equal(model[k], want_m[k]), k
    for k in want_o:
        assert torch.equal(optim[k], want_o[k]), k
    # Which ranks were idle when: rank 3 from step 2, rank 1 at steps 4-5, rank 0 at 6-7.
    idle = [r["value"]["idle"] for r in results]
    assert [s for s in range(STEPS) if idle[3][s]] == [2, 3, 4, 5]
    assert [s for s in range(STEPS) if idle[1][s]] == [4, 5]
    assert [s for s in range(STEPS) if idle[0][s]] == [6, 7]
    assert not any(idle[2])
    # Every rank reports the same global loss, idle or not; idle ranks probed their device.
    for r in results:
        assert r["value"]["losses"] == results[2]["value"]["losses"]
        assert r["value"]["probes"] == [True] * len(r["value"]["probes"])
    got = results[2]["value"]["losses"]
    assert [float(x) for x in want_losses] == pytest.approx(got, rel=0, abs=1e-6)


# ---- the controller's choice of stage count (pure logic, no process group) ------------------

N_LAYERS, MB = 12, 4


def _cost_base():
    import numpy as np

    from dynpipe.planner.costs import CostModel

    f = np.ones(N_LAYERS)
    return CostModel(
        model="toy",
        layer_names=tuple(f"l{i}" for i in range(N_LAYERS)),
        fwd_ms=f,
        bwd_ms=2 * f,
        param_bytes=np.full(N_LAYERS, 1e5),
        out_bytes=np.full(N_LAYERS, 1e3),
        act_bytes=np.full(N_LAYERS, 1e3),
        opt_mult=np.full(N_LAYERS, 2.0),
        buffer_bytes=np.zeros(N_LAYERS),
        bandwidth=np.zeros(0),
        latency_ms=np.zeros(0),
        microbatch_size=8,
        meta={"link_bandwidth": 1e12, "link_latency_ms": 0.0},
    )


def _win(step: int, wide, slow, *, probe: float | None = None, k: int = 5, over=None):
    """A window of the plan ``wide`` (one range per rank, empty: idle) where rank ``r``
    runs every layer ``slow[r]`` x its clean 1 ms forward (2 ms backward) and its stage
    spends ``over[r]`` ms a microbatch's forward outside its layers (0 if None); an idle
    rank's probe of layer 0 reads ``probe`` x clean."""
    import numpy as np

    from dynpipe.runtime.adapt.window import Window

    active = [r for r, (a, b) in enumerate(wide) if b > a]
    bounds = tuple(wide[r] for r in active)
    lf = np.concatenate(
        [np.full(b - a, 1.0 * slow[r]) for r, (a, b) in zip(active, bounds, strict=True)]
    )
    sf = np.array([lf[a:b].sum() for a, b in bounds])
    of = np.array([0.0 if over is None else float(over[r]) for r in active])
    true = [3 * s + o for s, o in zip(sf, of, strict=True)]
    step_ms = MB * max(true) + sum(true)
    idle = tuple(r for r in range(len(wide)) if r not in active)
    return Window(
        step=step,
        bounds=bounds,
        ranks=tuple(active),
        microbatches=MB,
        schedule="1f1b",
        step_ms=np.full(k, float(step_ms)),
        stage_fwd_ms=np.tile((sf + of) * MB, (k, 1)),
        stage_bwd_ms=np.tile(2 * sf * MB, (k, 1)),
        layer_fwd_ms=lf,
        layer_bwd_ms=2 * lf,
        sampled_fwd_ms=sf + of,
        sampled_bwd_ms=2 * sf,
        idle=idle,
        probes={r: (0, 1.0 * probe, 2.0 * probe) for r in idle} if probe else None,
    )


def _elastic_controller(elastic: bool = True):
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.adapt.policy import Controller

    cfg = AdaptConfig(mode="measured", settle_windows=0, elastic=elastic)
    return Controller(base=_cost_base(), config=cfg, num_ranks=3)


def _drop_then_probe_clean(ctl, *, over=None, fixed=None):
    """Drive ``ctl`` on the even 3-stage plan: clean, then rank 2 ten times slower (its
    stage ``over`` ms a microbatch outside its layers) until it moves; the plan it moved to
    while rank 2's probe reads 10x (it must stay), then clean until it moves again.
    ``fixed`` (a controller without ``--elastic``) reads the same windows up to the first
    move. Returns the step, the first move, ``fixed``'s decision then and the last
    decision."""
    even = ((0, 4), (4, 8), (8, 12))
    step, d, kept = 0, None, None
    for slow in [(1, 1, 1)] * 3 + [(1, 1, 10)] * 3:
        step += 5
        w = _win(step, even, slow, over=None if slow[2] == 1 else over)
        d = ctl.observe(w)
        kept = fixed.observe(w) if fixed is not None else None
        if d.repartition:
            break
    first = d
    assert first.repartition and first.bounds[2][0] == first.bounds[2][1], first
    ctl.applied(step=step + 1, pause_ms=1.0, moved_bytes=1)
    # Idle, its probe still reads 10x: it stays out.
    for _ in range(3):
        step += 5
        d = ctl.observe(_win(step, first.bounds, (1, 1, 10), probe=10.0))
        assert not d.repartition, d
    for _ in range(3):
        step += 5
        d = ctl.observe(_win(step, first.bounds, (1, 1, 1), probe=1.0))
        if d.repartition:
            break
    return step, first, kept, d


def test_controller_drops_a_slow_device_and_takes_it_back_when_it_recovers() -> None:
    _, dropped, kept, d = _drop_then_probe_clean(
        _elastic_controller(), fixed=_elastic_controller(elastic=False)
    )
    # Without --elastic the controller re-splits over the same three devices; with it, the
    # device ten times slower is left idle (two stages are faster than any three-stage split).
    assert "on 2 of 3 devices" in dropped.reason, dropped
    assert sum(b - a for a, b in dropped.bounds) == N_LAYERS
    assert kept.bounds is None or all(b > a for a, b in kept.bounds)
    # The probe reads clean: three stages again, rank 2 holding layers.
    assert d.repartition and all(b > a for a, b in d.bounds), d
    assert "on 3 of 3 devices" in d.reason


def test_a_dropped_device_is_priced_at_its_clean_overhead_once_its_probe_reads_clean() -> None:
    # The slowed stage also stalled between its layers (time-sliced with another process):
    # 12 ms a microbatch outside its layers. Once idle, that overhead was measured under what
    # emptied the device; when the probe reads it clean, a stage moved back costs the clean
    # overhead (none), not the stalled one, and the device is taken back.
    ctl = _elastic_controller()
    step, _, _, d = _drop_then_probe_clean(ctl, over=(0, 0, 12))
    assert d.repartition and all(b > a for a, b in d.bounds), d
    ctl.applied(step=step + 1, pause_ms=1.0, moved_bytes=1)
    # Back on three stages at the clean speed, it stays: the windows this plan ran under
    # the interferer are of other conditions (the probe's reading of the device changed).
    back = d.bounds
    for _ in range(4):
        step += 5
        d = ctl.observe(_win(step, back, (1, 1, 1)))
        assert not d.repartition, d


def _probe_ticks(rank: int, world: int) -> dict:
    import itertools

    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.topology import Topology

    model = get_model("mlp", **MODEL)
    eng = PipelineEngine(
        model,
        Plan.from_bounds(model, [len(model)], ranks=[0]),
        topo=Topology.from_env(device="cpu"),
        config=EngineConfig(batch_size=BATCH, optim=optim_config("sgd")),
    )
    # A clock that ticks once per mark: each mark's reading is its place in the sequence,
    # so a layer's time is the number of marks between its two, whatever the machine's load.
    eng.timer.layers._device_mark = itertools.count().__next__
    out = []
    for s in range(3):
        res = eng.step(s, make_batch(model, s), sample_layers=True)
        if eng.idle:
            out.append((res.timing.layers.fwd_ms[0], res.timing.layers.bwd_ms[0]))
    return {"idle": eng.idle, "probes": out}


def test_an_idle_ranks_probe_times_each_microbatch_by_its_own_marks() -> None:
    # The idle rank times three microbatches of its probe layer. Each microbatch's backward
    # runs from its own begin mark to its own input's gradient, two marks on (its output's
    # gradient is marked between them); its forward, one mark. (On one
    # shared input every earlier microbatch's hook fired again in each later backward, and
    # the median read a backward as itself plus two whole microbatches: 5.3 ms for a gpt
    # block's 2.2 on an H100.)
    results = run_ranks(_probe_ticks, 2)
    assert all(r["ok"] for r in results), results
    idle = results[1]["value"]
    assert idle["idle"] and len(idle["probes"]) == 3, idle
    assert all(p == (1e3, 2e3) for p in idle["probes"]), idle["probes"]


def test_plan_wide_bounds_round_trip_and_elastic_validation() -> None:
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.planner.plan import PlanError

    model = get_model("mlp", **MODEL)
    plan = Plan.from_bounds(model, [5, 3], ranks=[0, 2])
    wide = plan.wide_bounds(4)
    assert wide == ((0, 5), (5, 5), (5, 8), (8, 8)) and plan.idle_ranks(4) == [1, 3]
    assert Plan.from_wide_bounds(model, wide).stages == plan.stages
    plan.validate(model, 4, elastic=True)
    with pytest.raises(PlanError, match="2 stages but the world has 4"):
        plan.validate(model, 4)  # a launch still needs one stage per rank
    with pytest.raises(PlanError, match="increasing ranks"):
        Plan.from_bounds(model, [5, 3], ranks=[2, 0]).validate(model, 4, elastic=True)


# ---- the training loop: forced stage counts through an injected policy ----------------------

TRAIN_STEPS, EVERY = 45, 5
# Window ending at step -> the plan from two steps later on (the policy reads a window while
# the next step runs; the move follows that step), one range per rank (empty: idle).
FORCED = {
    9: ((0, 3), (3, 6), (6, 8), (8, 8)),  # 3 stages, rank 3 idle
    19: ((0, 5), (5, 5), (5, 8), (8, 8)),  # 2 stages, ranks 1 and 3 idle
    29: ((0, 0), (0, 2), (2, 5), (5, 8)),  # 3 stages, rank 0 idle
    39: ((0, 2), (2, 4), (4, 6), (6, 8)),  # 4 stages again
}


class _Forced:
    """The real controller decides every window (it sees the idle ranks and their probes);
    at the windows of ``FORCED`` its decision is replaced by that plan, and elsewhere it is
    not acted on, so the sequence of stage counts is the test's."""

    def __init__(self, inner) -> None:
        self.inner, self.mode_used = inner, inner.mode_used

    def observe(self, window):
        import dataclasses

        d = self.inner.observe(window)
        if d is None:
            return None
        self.inner.pending = None
        if window.step in FORCED:
            return dataclasses.replace(
                d, repartition=True, bounds=FORCED[window.step], reason="forced"
            )
        return dataclasses.replace(d, repartition=False, bounds=None)

    def applied(self, **kw) -> None:
        self.inner.applied(**kw)

    def describe(self) -> str:
        return "forced stage counts"

    def state(self) -> dict:
        return self.inner.state()

    def load_state(self, state: dict) -> None:
        self.inner.load_state(state)


def _train(rank: int, world: int, log: str, forced: bool) -> dict:
    from dynpipe.models import get_model
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.adapt.make import make_policy
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.optim import OptimConfig
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    adapt = AdaptConfig(mode="measured" if forced else "static", monitor_every=EVERY)
    cfg = TrainConfig(
        model="mlp",
        model_args=MODEL,
        steps=TRAIN_STEPS,
        batch_size=16,
        microbatches=4,
        progress=False,
        log=log,
        telemetry=False,
        optim=OptimConfig(name="adamw", lr=1e-3, clip_grad=1.0),
        adapt=adapt,
    )
    policy = None
    if forced:
        inner = make_policy(adapt, model=get_model("mlp", **MODEL), microbatch_size=4, num_ranks=4)
        policy = _Forced(inner)
    idle: list[int] = []
    final: dict = {}

    def on_step(engine, res) -> None:
        if engine.idle:
            idle.append(res.step)
        if res.step == TRAIN_STEPS - 1:
            final.update(model=engine.model_state(), optim=engine.optim_state())

    out = train(cfg, topo=Topology.from_env(device="cpu"), policy=policy, on_step=on_step)
    return {"idle": idle, "losses": out["losses"], **final}


def test_training_drops_to_three_then_two_stages_and_grows_back_like_a_static_run(
    tmp_path,
) -> None:
    from dynpipe.runtime.records import read_log

    log = tmp_path / "elastic.jsonl"
    forced = run_ranks(_train, 4, str(log), True, timeout_s=400)
    static = run_ranks(_train, 4, str(tmp_path / "static.jsonl"), False, timeout_s=400)

    def merged(results, key):
        out = {}
        for r in results:
            out.update(r["value"][key])
        return out

    for key in ("model", "optim"):
        got, want = merged(forced, key), merged(static, key)
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), (key, k)
    assert forced[0]["value"]["losses"] == static[0]["value"]["losses"]
    idle = [r["value"]["idle"] for r in forced]
    assert idle[3] == list(range(11, 31))
    assert idle[1] == list(range(21, 31))
    assert idle[0] == list(range(31, 41))
    assert idle[2] == []
    recs = read_log(log)
    counts = [(e.step, e["stages"], e["idle"]) for e in recs.events("stage_count")]
    assert counts == [(11, 3, [3]), (21, 2, [1, 3]), (31, 3, [0]), (41, 4, [])], counts
    reps = recs.events("repartition")
    assert [e.step for e in reps] == [11, 21, 31, 41]
    # The idle ranks' probes reached the controller: it priced the idle devices.
    decisions = [e for e in recs.events("decision") if 11 <= e.step < 41]
    assert decisions and all(len(e["slowdown"]) == 4 for e in decisions)


# ---- release / reclaim on request -------------------------------------------------------------

RELEASE_AT, RECLAIM_AT, REQ_STEPS = 12, 26, 40


def _released_run(rank: int, world: int, log: str) -> dict:
    from dynpipe.cli import main
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    cfg = TrainConfig(
        model="mlp",
        model_args=MODEL,
        steps=REQ_STEPS,
        batch_size=16,
        microbatches=4,
        progress=False,
        log=log,
        telemetry=False,
        adapt=AdaptConfig(mode="measured", monitor_every=EVERY),
    )
    run_dir = str(__import__("pathlib").Path(log).parent)
    idle: list[int] = []
    steps: list[int] = []
    probed: list[int] = []

    def on_step(engine, res) -> None:
        steps.append(res.step)
        if engine.idle:
            idle.append(res.step)
        if engine.idle and res.timing.layers is not None:
            probed.append(res.step)
        # An operator's commands, issued while step ``res.step`` is under way on the others.
        if rank == 0 and res.step == RELEASE_AT:
            assert main(["release", "--rank", "2", run_dir]) == 0
        if rank == 0 and res.step == RECLAIM_AT:
            assert main(["reclaim", "--rank", "2", run_dir]) == 0

    train(cfg, topo=Topology.from_env(device="cpu"), on_step=on_step)
    return {"idle": idle, "steps": steps, "probed": probed}


def test_release_empties_the_rank_within_the_bound_and_reclaim_gives_it_back(tmp_path) -> None:
    from dynpipe.runtime.records import read_log

    log = tmp_path / "run" / "log.jsonl"
    res = run_ranks(_released_run, 4, str(log), timeout_s=400)
    for r in res:
        assert r["value"]["steps"] == list(range(REQ_STEPS)), "the job never stopped"
    idle = res[2]["value"]["idle"]
    # The bound: a request made during step s leaves the rank empty from step
    # s + monitor_every at the latest (the next monitor point, then one migration).
    assert idle and idle[0] <= RELEASE_AT + EVERY, idle
    assert idle == list(range(idle[0], idle[-1] + 1)), "idle without a break until reclaimed"
    assert RECLAIM_AT <= idle[-1] < RECLAIM_AT + EVERY, idle
    # A rank handed back to its owner computes nothing on its device, not even a probe.
    assert res[2]["value"]["probed"] == [], res[2]["value"]["probed"]
    recs = read_log(log)
    rel = recs.events("release")
    assert [(e["ranks"], e["reclaimed"]) for e in rel] == [([2], []), ([], [2])], rel
    assert rel[0].step == idle[0] and rel[1].step == idle[-1] + 1
    assert all(e["waited_s"] is not None and e["waited_s"] >= 0 for e in rel), rel
    # While released, no plan gave rank 2 a layer.
    for e in recs.events("repartition"):
        if rel[0].step <= e.step < rel[1].step:
            assert all(st["rank"] != 2 for st in e["new_plan"]["stages"]), e
    assert (tmp_path / "run" / "elastic.json").read_text().strip() == '{"released": []}'


def test_elastic_and_freeze_refuse_replicas_in_one_line() -> None:
    from dynpipe.errors import UserError
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.config import TrainConfig

    with pytest.raises(UserError, match="--dp 2 replicas are not supported"):
        TrainConfig(dp=2, adapt=AdaptConfig(mode="measured", elastic=True))
    with pytest.raises(UserError, match="--dp 2 replicas are not supported"):
        TrainConfig(dp=2, freeze=True)
    with pytest.raises(UserError, match="--freeze-alpha in"):
        TrainConfig(freeze=True, freeze_alpha=0.0)
    with pytest.raises(UserError, match="not a multiple of the monitoring window"):
        TrainConfig(freeze=True, freeze_every=12, adapt=AdaptConfig(mode="measured"))


def test_release_cli_checks_the_rank_and_never_releases_every_rank(tmp_path) -> None:
    from dynpipe.cli import main
    from dynpipe.runtime.requests import read_released

    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").write_text('{"kind": "header", "world_size": 2}\n')
    assert main(["release", "--rank", "5", str(run)]) == 2
    assert main(["release", "--rank", "1", str(run)]) == 0
    assert read_released(run) == {1}
    assert main(["release", "--rank", "0", str(run)]) == 2  # would leave none
    assert main(["reclaim", "--rank", "1", str(run / "log.jsonl")]) == 0
    assert read_released(run) == set()
    assert main(["release", "--rank", "0", str(tmp_path / "nowhere")]) == 2


# ---- --freeze ----------------------------------------------------------------------------------


def test_freeze_rule_freezes_a_converged_prefix_only() -> None:
    import numpy as np

    from dynpipe.runtime.freeze import (
        FreezeHistory,
        FreezeRule,
        frozen_prefix,
        keep_prefix_on_first,
    )

    # The rule itself on synthetic windows: tests/test_freeze_rule.py. Here, the prefix walk.
    rule = FreezeRule(every=5, threshold=0.05, alpha=0.5, patience=1)
    flat = np.ones(8)
    h = FreezeHistory()
    h.add(loss=2.0, norms=flat, rule=rule)
    assert frozen_prefix(h, frozen=0, rule=rule) == 0  # nothing to compare yet
    h.add(loss=1.0, norms=np.array([1.01, 0.99, 1.2, 1.0, 1.0, 1.0, 1.0, 1.0]), rule=rule)
    assert frozen_prefix(h, frozen=0, rule=rule) == 0  # the loss just fell at its fastest
    h.add(loss=1.0, norms=np.array([1.01, 0.99, 1.2, 1.0, 1.0, 1.0, 1.0, 1.0]), rule=rule)
    h.add(loss=1.0, norms=np.array([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]), rule=rule)
    # Layers 0 and 1 stayed within 5%; layer 2 did not, so 3.. stay too (prefix only).
    assert frozen_prefix(h, frozen=0, rule=rule) == 2
    h.add(loss=1.0, norms=flat, rule=rule)
    # At most alpha of the training layers per check, and the last layer always trains.
    assert frozen_prefix(h, frozen=0, rule=rule) == 4
    assert frozen_prefix(h, frozen=6, rule=rule) == 7
    assert frozen_prefix(h, frozen=7, rule=rule) == 7
    # The first active rank keeps the prefix and one layer that trains; a rank left with
    # nothing goes idle.
    wide = ((0, 4), (4, 8))
    assert keep_prefix_on_first(wide, frozen=4) == ((0, 5), (5, 8))
    assert keep_prefix_on_first(wide, frozen=7) == ((0, 8), (8, 8))
    assert keep_prefix_on_first(((0, 0), (0, 3), (3, 8)), frozen=4) == ((0, 0), (0, 5), (5, 8))


FREEZE_STEPS = 30
# (first step frozen, layers frozen): what the rule gives with every layer "converged"
# (threshold 1e9), a check every 5 steps, alpha 0.5, 8 layers on 2 ranks split 4|4.
FREEZES = [(10, 4), (15, 6), (20, 7)]


def _freeze_run(rank: int, world: int, log: str) -> dict:
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.optim import OptimConfig
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    cfg = TrainConfig(
        model="mlp",
        model_args=MODEL,
        steps=FREEZE_STEPS,
        batch_size=16,
        microbatches=4,
        progress=False,
        log=log,
        log_every=5,
        telemetry=False,
        optim=OptimConfig(name="adamw", lr=1e-3, clip_grad=1.0),
        freeze=True,
        freeze_every=5,
        freeze_threshold=1e9,
        freeze_alpha=0.5,
        freeze_patience=1,
    )
    seen: list = []
    final: dict = {}

    def on_step(engine, res) -> None:
        lt = res.timing.layers
        if lt is not None and not engine.idle and engine.stage_index == 0:
            seen.append((res.step, engine.frozen, list(lt.bwd_ms)))
        for name, p in engine.named_params.items():
            frozen = engine._index[name.split(".", 1)[0]] < engine.frozen
            assert frozen == (not p.requires_grad), name
            assert (p.grad is None) == frozen or engine.idle, (res.step, name)
        if res.step == FREEZE_STEPS - 1:
            final.update(model=engine.model_state(), optim=engine.optim_state())

    out = train(cfg, topo=Topology.from_env(device="cpu"), on_step=on_step)
    return {"seen": seen, "losses": out["losses"], **final}


def test_freeze_skips_backward_and_equals_a_reference_frozen_at_the_same_steps(tmp_path) -> None:
    from dynpipe.data import get_data
    from dynpipe.models import get_model
    from dynpipe.runtime.optim import OptimConfig
    from dynpipe.runtime.records import read_log
    from dynpipe.runtime.reference import ReferenceTrainer

    log = tmp_path / "freeze.jsonl"
    res = run_ranks(_freeze_run, 2, str(log), timeout_s=400)
    recs = read_log(log)
    got = [(e.step, e["frozen"]) for e in recs.events("freeze")]
    assert got == FREEZES, got
    assert recs.events("freeze_rule")[0]["changes_training"] is True
    # The last freeze left rank 1 nothing: one stage from step 20.
    assert recs.events("freeze")[-1]["idle"] == [1]
    # Per-layer timings: a frozen layer's backward takes no time (no gradient reached it),
    # the first layer that trains has one.
    timed = [(s, k, b) for s, k, b in res[0]["value"]["seen"] if k > 0]
    assert timed, res[0]["value"]["seen"]
    for s, k, bwd in timed:
        assert all(x == 0.0 for x in bwd[:k]), (s, k, bwd)
        assert bwd[k] > 0, (s, k, bwd)

    model = get_model("mlp", **MODEL)
    data = get_data("synthetic", model=model, seed=0)
    ref = ReferenceTrainer(
        model=get_model("mlp", **{**MODEL, "seed": 0}),
        batch_size=16,
        microbatches=4,
        optim=OptimConfig(name="adamw", lr=1e-3, clip_grad=1.0, total_steps=FREEZE_STEPS),
    )
    at = dict(FREEZES)
    losses = []
    for s in range(FREEZE_STEPS):
        if s in at:
            ref.freeze(at[s])
        losses.append(ref.step(s, data.batch(s, 16)))
    state, optim = {}, {}
    for r in res:
        state.update(r["value"].get("model", {}))
        optim.update(r["value"].get("optim", {}))
    want_m, want_o = ref.model_state(), ref.optim_state()
    assert set(state) == set(want_m) and set(optim) == set(want_o)
    for k in want_m:
        assert torch.equal(state[k], want_m[k]), k
    for k in want_o:
        assert torch.equal(optim[k], want_o[k]), k
    assert res[0]["value"]["losses"] == losses


# ---- checkpoints under an elastic plan ----------------------------------------------------------

CKPT_STEPS = 30


class _DropRank1:
    """Forces the plan 5|3 on ranks 0 and 2 (ranks 1 and 3 idle) at the window ending at step
    9; the controller is not acted on otherwise."""

    def __init__(self, inner) -> None:
        self.inner, self.mode_used = inner, inner.mode_used

    def observe(self, window):
        import dataclasses

        d = self.inner.observe(window)
        if d is None:
            return None
        self.inner.pending = None
        if window.step == 9:
            bounds = ((0, 5), (5, 5), (5, 8), (8, 8))
            return dataclasses.replace(d, repartition=True, bounds=bounds, reason="forced")
        return dataclasses.replace(d, repartition=False, bounds=None)

    def applied(self, **kw) -> None:
        self.inner.applied(**kw)

    def describe(self) -> str:
        return "forced 2 of 4 stages"

    def state(self) -> dict:
        return self.inner.state()

    def load_state(self, state: dict) -> None:
        self.inner.load_state(state)


def _ckpt_run(rank: int, world: int, root: str, steps: int, forced: bool) -> dict:
    from dynpipe.models import get_model
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.adapt.make import make_policy
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.optim import OptimConfig
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    adapt = AdaptConfig(mode="measured" if forced else "static", monitor_every=EVERY)
    cfg = TrainConfig(
        model="mlp",
        model_args=MODEL,
        steps=steps,
        batch_size=16,
        microbatches=4,
        progress=False,
        log=f"{root}/log.jsonl",
        telemetry=False,
        optim=OptimConfig(name="adamw", lr=1e-3, clip_grad=1.0),
        adapt=adapt,
        save_dir=f"{root}/ckpt",
        save_every=15,
        resume="auto",
    )
    policy = None
    if forced:
        inner = make_policy(adapt, model=get_model("mlp", **MODEL), microbatch_size=4, num_ranks=4)
        policy = _DropRank1(inner)
    final: dict = {}

    def on_step(engine, res) -> None:
        if res.step == steps - 1:
            final.update(model=engine.model_state(), optim=engine.optim_state())

    out = train(cfg, topo=Topology.from_env(device="cpu"), policy=policy, on_step=on_step)
    return {"start": out["start"], "ranks": out["plan"].ranks, **final}


def test_a_checkpoint_of_an_elastic_plan_resumes_under_it_bit_identically(tmp_path) -> None:
    root = str(tmp_path / "elastic")
    first = run_ranks(_ckpt_run, 4, root, 15, True, timeout_s=400)
    assert first[0]["value"]["ranks"] == [0, 2]
    # Relaunched with more steps: it resumes at step 15 under the plan that was running.
    again = run_ranks(_ckpt_run, 4, root, CKPT_STEPS, True, timeout_s=400)
    assert [r["value"]["start"] for r in again] == [15] * 4
    assert again[0]["value"]["ranks"] == [0, 2]
    static = run_ranks(_ckpt_run, 4, str(tmp_path / "static"), CKPT_STEPS, False, timeout_s=400)
    for key in ("model", "optim"):
        got, want = {}, {}
        for r in again:
            got.update(r["value"][key])
        for r in static:
            want.update(r["value"][key])
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), (key, k)


# ---- launching with idle ranks --------------------------------------------------------------

LAUNCH_STEPS = 20


def _idle_launch_run(rank: int, world: int, plan_path: str, log: str, elastic: bool) -> dict:
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.optim import OptimConfig
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    # min_gain 0.99: the controller measures and probes but never moves, so the run holds
    # the launch plan and its result is the static run's.
    adapt = AdaptConfig(
        mode="measured" if elastic else "static",
        monitor_every=EVERY,
        elastic=elastic,
        min_gain=0.99,
    )
    cfg = TrainConfig(
        model="mlp",
        model_args=MODEL,
        plan=plan_path,
        steps=LAUNCH_STEPS,
        batch_size=16,
        microbatches=4,
        progress=False,
        log=log,
        telemetry=False,
        optim=OptimConfig(name="adamw", lr=1e-3, clip_grad=1.0),
        adapt=adapt,
    )
    idle, probed, final = [], [], {}

    def on_step(engine, res) -> None:
        if engine.idle:
            idle.append(res.step)
            if res.timing.layers is not None:
                probed.append(res.step)
        if res.step == LAUNCH_STEPS - 1:
            final.update(model=engine.model_state(), optim=engine.optim_state())

    out = train(cfg, topo=Topology.from_env(device="cpu"), on_step=on_step)
    return {"idle": idle, "probed": probed, "losses": out["losses"], **final}


def test_an_elastic_launch_may_leave_ranks_idle_and_trains_like_the_plan_alone(tmp_path) -> None:
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.records import read_log

    model = get_model("mlp", **MODEL)
    plan_path = tmp_path / "plan.json"
    Plan.from_bounds(model, [3, 5], microbatches=4).save(plan_path)
    log = tmp_path / "idle.jsonl"
    launched = run_ranks(_idle_launch_run, 3, str(plan_path), str(log), True, timeout_s=400)
    alone = run_ranks(
        _idle_launch_run, 2, str(plan_path), str(tmp_path / "alone.jsonl"), False, timeout_s=400
    )
    # Rank 2 holds nothing from the first step to the last, and times its device for the
    # controller on the sampled steps.
    assert launched[2]["value"]["idle"] == list(range(LAUNCH_STEPS))
    assert launched[2]["value"]["probed"], "the idle rank never probed its device"
    assert launched[0]["value"]["idle"] == [] and launched[1]["value"]["idle"] == []
    decisions = list(read_log(log).events("decision"))
    assert decisions and all(len(e["slowdown"]) == 3 for e in decisions)
    # Every window's decision records what deciding cost, moves or not.
    assert all(e["decide_ms"] >= 0 for e in decisions)
    for key in ("model", "optim"):
        got, want = {}, {}
        for r in launched[:2]:
            got.update(r["value"][key])
        for r in alone:
            want.update(r["value"][key])
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), (key, k)
    assert launched[0]["value"]["losses"] == alone[0]["value"]["losses"]


def test_a_plan_with_fewer_stages_than_ranks_needs_elastic() -> None:
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.planner.plan import PlanError

    model = get_model("mlp", **MODEL)
    plan = Plan.from_bounds(model, [3, 5], microbatches=4)
    with pytest.raises(PlanError, match="train with --elastic to leave the other ranks idle"):
        plan.validate(model, 3)
    assert plan.validate(model, 3, elastic=True) is plan
