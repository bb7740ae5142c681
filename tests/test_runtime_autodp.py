"""``--freeze --autodp``: the GPUs freezing frees host more pipeline replicas, live.

A 4-rank run of one 4-stage pipeline freezes its leading layers; the AutoDP check then finds
2 replicas x 2 stages faster and reshapes, copying every layer (and the training layers'
optimizer state) a new replica lacks from the ranks that hold it. The run ends bit-identical
to single-process training that freezes the same layers at the same steps and, from the
reshape on, adds each replica's microbatches first (what the replicas' all-reduce computes).
Checkpoints taken after the reshape resume in the new shape; bad input fails in one line.
"""

from __future__ import annotations

import pytest
from distutil import assert_same_tensors, merged_state, run_ranks, stopped_after

MODEL = {"depth": 6, "width": 32}  # 8 layers
# 6 microbatches of 4 samples: 1 x 4 (1F1B needs >= 4 per replica) and 2 x 2 (3 each) run
# them, 4 x 1 cannot split them, so 2 x 2 is the only shape to grow to.
BATCH, MICRO, EVERY = 24, 6, 5
STEPS = 25


def _cfg(tmp: str, steps: int, **kw):
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.optim import OptimConfig

    base = dict(
        model="mlp",
        model_args=MODEL,
        steps=steps,
        batch_size=BATCH,
        microbatches=MICRO,
        progress=False,
        telemetry=False,
        log=f"{tmp}/log.jsonl",
        log_every=EVERY,
        optim=OptimConfig(name="adamw", lr=1e-3, clip_grad=1.0, total_steps=STEPS),
        # Every layer "converged" (threshold 1e9, trends over the last two windows): the
        # rule freezes as fast as alpha allows from the second check on.
        freeze=True,
        freeze_every=EVERY,
        freeze_threshold=1e9,
        freeze_alpha=0.5,
        freeze_patience=1,
        autodp=True,
        # The rule with no threshold on the gain and a horizon no loaded machine's pause can
        # fail: the frozen prefix's missing backward and the shorter pipeline's smaller
        # bubble make 2 x 2 predicted faster whatever the timers read, so the reshape does
        # not depend on this machine's load (the rule's thresholds are tested apart, below).
        adapt=AdaptConfig(mode="static", min_gain=0.0, horizon_steps=100_000),
    )
    return TrainConfig(**{**base, **kw})


def _run(rank: int, world: int, cfg) -> dict:
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    shapes: list[tuple[int, int, int]] = []
    final: dict = {}

    def on_step(engine, res) -> None:
        shapes.append((res.step, engine.mesh.dp, engine.mesh.pp))
        for name, p in engine.named_params.items():
            frozen = engine._index[name.split(".", 1)[0]] < engine.frozen
            assert frozen == (not p.requires_grad), name
        if res.step == cfg.steps - 1:
            final.update(
                model=engine.model_state(), optim=engine.optim_state(), replica=engine.mesh.replica
            )

    out = train(cfg, topo=Topology.from_env(device="cpu"), on_step=on_step)
    return {"shapes": shapes, "losses": out["losses"], "start": out["start"], **final}


def _reference(
    cfg, *, freezes: dict[int, int], reshaped_at: int, steps: int, until: int | None = None
):
    """Single-process accumulation over the run's 6 microbatches, frozen as the run froze,
    grouped 3 + 3 (each replica's sum, then the two added) from the reshape on (until step
    ``until``, if the run left its replicas then)."""
    from dynpipe.runtime.reference import ReferenceTrainer
    from dynpipe.runtime.train import build_model_and_data

    model, data = build_model_and_data(cfg)
    ref = ReferenceTrainer(model=model, batch_size=BATCH, microbatches=MICRO, optim=cfg.optim)
    losses = []
    for s in range(steps):
        if s in freezes:
            ref.freeze(freezes[s])
        replicated = s >= reshaped_at and (until is None or s < until)
        ref.groups = (3, 3) if replicated else None
        losses.append(ref.step(s, data.batch(s, BATCH)))
    return ref.model_state(), ref.optim_state(), losses


@pytest.mark.slow
def test_freeze_then_reshape_one_by_four_to_two_by_two_is_bit_identical(tmp_path) -> None:
    from dynpipe.planner import Plan
    from dynpipe.runtime.autodp import held_ranges
    from dynpipe.runtime.records import read_log

    cfg = _cfg(str(tmp_path / "run"), STEPS)
    res = run_ranks(_run, 4, cfg, timeout_s=500)
    recs = read_log(cfg.log)
    freezes = [(e.step, e["frozen"]) for e in recs.events("freeze")]
    # 4 layers at step 10 (alpha 0.5 of 8), then 6 (2 x 2 by then); 7 would leave the
    # second stage no layer, and no shape of fewer stages splits 6 microbatches: capped.
    assert freezes == [(10, 4), (15, 6)], freezes
    capped = recs.events("freeze_capped")
    assert [(e.step, e["wanted"], e["frozen"]) for e in capped] == [(20, 7, 6)], capped
    reshapes = recs.events("reshape")
    assert len(reshapes) == 1, reshapes
    r = reshapes[0]
    # Decided at the check that froze 4 layers, in the same pause.
    assert r.step == 10 and r["old_shape"] == [1, 4] and r["new_shape"] == [2, 2], r
    assert r["frozen"] == 4 and r["bytes"] > 0 and r["pause_ms"] > 0
    assert r["new_plan"]["dp"] == 2 and r["new_plan"]["microbatches"] == 3
    assert r["new_plan"]["stages"][0]["stop"] >= 5  # the frozen prefix and a training layer
    # Every layer a rank lacked in the new shape was copied to it from a rank holding it,
    # and nothing else.
    old, new = (Plan.from_dict(r[k]) for k in ("old_plan", "new_plan"))
    before, after = held_ranges(old, world_size=4), held_ranges(new, world_size=4)
    lacked = {(g, i) for g, (a, b) in enumerate(after) for i in range(a, b)}
    lacked -= {(g, i) for g, (a, b) in enumerate(before) for i in range(a, b)}
    copied = set()
    for c in r["copies"]:  # "name#layer:rSRC->rDST nB"
        layer, rest = c.split("#")[1].split(":r")
        src, dst = (int(x) for x in rest.split()[0].split("->r"))
        assert before[src][0] <= int(layer) < before[src][1], c
        copied.add((dst, int(layer)))
    assert copied == lacked and {2, 3} & {g for g, _ in copied}, r["copies"]
    verdicts = recs.events("autodp")
    assert verdicts[0]["take"] is True and verdicts[0]["proposed"] == [2, 2]
    assert all(not v["take"] for v in verdicts[1:]), verdicts
    # Every rank ran every step, in 1 x 4 up to step 9 and in 2 x 2 from step 10.
    for got in res:
        shapes = got["value"]["shapes"]
        assert [s for s, *_ in shapes] == list(range(STEPS))
        assert {(d, p) for s, d, p in shapes if s < 10} == {(1, 4)}
        assert {(d, p) for s, d, p in shapes if s >= 10} == {(2, 2)}
    want_m, want_o, want_l = _reference(cfg, freezes=dict(freezes), reshaped_at=r.step, steps=STEPS)
    for replica in (0, 1):  # both replicas hold the same, and it is the reference's
        m, o = merged_state(res, replica)
        assert_same_tensors(m, want_m, f"parameters of replica {replica}")
        assert_same_tensors(o, want_o, f"optimizer state of replica {replica}")
    for got in res:
        assert got["value"]["losses"] == want_l


@pytest.mark.slow
def test_a_checkpoint_after_the_reshape_resumes_in_the_new_shape(tmp_path) -> None:
    from dynpipe.runtime.records import read_log

    kw = {"save_every": 15, "save_dir": str(tmp_path / "ckpt"), "resume": "auto"}
    # Stopped after step 16; its newest checkpoint is of step 15: 2 x 2, 6 layers frozen.
    run_ranks(_run, 4, _cfg(str(tmp_path / "a"), 17, **kw), timeout_s=500)
    stopped_after(kw["save_dir"], 17)
    again = _cfg(str(tmp_path / "a"), STEPS, **kw)
    res = run_ranks(_run, 4, again, timeout_s=500)
    stopped_after(kw["save_dir"], STEPS)  # the one-pipeline run below resumes step 15 too
    for got in res:
        assert got["value"]["start"] == 15
        assert {(d, p) for _, d, p in got["value"]["shapes"]} == {(2, 2)}
    recs = read_log(again.log)
    assert [(e.step, e["frozen"]) for e in recs.events("freeze")] == [(10, 4), (15, 6)]
    assert [e.step for e in recs.events("reshape")] == [10]
    # The resumed run continues as the run that never stopped: the reference, bit for bit
    # (the freeze rule's last norms came back too: the check at step 19 still caps at 6).
    assert [e.step for e in recs.events("freeze_capped")] == [20]
    want_m, want_o, want_l = _reference(again, freezes={10: 4, 15: 6}, reshaped_at=10, steps=STEPS)
    for replica in (0, 1):
        m, o = merged_state(res, replica)
        assert_same_tensors(m, want_m, f"parameters of replica {replica}")
        assert_same_tensors(o, want_o, f"optimizer state of replica {replica}")
    for got in res:
        assert got["value"]["losses"] == want_l[15:]
    # Without --autodp, as one pipeline of 4 stages: the checkpoint's layers are keyed by
    # name, the frozen prefix is restored on the first stage (the ranks it empties idle),
    # and training goes on as single-process accumulation (no grouping).
    one = _cfg(str(tmp_path / "one"), STEPS, **{**kw, "autodp": False})
    pipe = run_ranks(_run, 4, one, timeout_s=300)
    assert [r["value"]["start"] for r in pipe] == [15] * 4
    frozen = {10: 4, 15: 6, **{e.step: e["frozen"] for e in read_log(one.log).events("freeze")}}
    assert frozen == {10: 4, 15: 6, 20: 7}, frozen  # one pipeline: nothing caps the rule
    want_m, want_o, want_l = _reference(one, freezes=frozen, reshaped_at=10, steps=STEPS, until=15)
    m, o = merged_state(pipe, 0)
    assert_same_tensors(m, want_m, "parameters as one pipeline")
    assert_same_tensors(o, want_o, "optimizer state as one pipeline")
    alone = pipe[0]["value"]
    assert alone["losses"] == want_l[15:]


# ---- a release request while replicated: back to one pipeline without the rank -------------

RELEASE_AT = 12  # during this step (2 x 2 since step 10) rank 0 asks for rank 3


class _Still:
    """A policy that never moves layers: the run's moves are the freezes, the reshape and
    the release, so its result is known exactly."""

    mode_used = "measured"

    def observe(self, window):
        return None

    def applied(self, **kw) -> None:
        pass

    def describe(self) -> str:
        return "still"

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass


def _released(rank: int, world: int, cfg) -> dict:
    from pathlib import Path

    from dynpipe.cli import main
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    idle: list[int] = []
    final: dict = {}

    def on_step(engine, res) -> None:
        if engine.idle:
            idle.append(res.step)
        if rank == 0 and res.step == RELEASE_AT:
            assert main(["release", "--rank", "3", str(Path(cfg.log).parent)]) == 0
        if res.step == cfg.steps - 1:
            final.update(model=engine.model_state(), optim=engine.optim_state(), replica=0)

    out = train(cfg, topo=Topology.from_env(device="cpu"), on_step=on_step, policy=_Still())
    return {"idle": idle, "losses": out["losses"], **final}


@pytest.mark.slow
def test_a_release_while_replicated_goes_back_to_one_pipeline_without_the_rank(tmp_path) -> None:
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.records import read_log

    adapt = AdaptConfig(mode="measured", monitor_every=EVERY, min_gain=0.0, horizon_steps=100_000)
    cfg = _cfg(str(tmp_path / "run"), STEPS, adapt=adapt)
    res = run_ranks(_released, 4, cfg, timeout_s=500)
    recs = read_log(cfg.log)
    assert [(e.step, e["new_shape"]) for e in recs.events("reshape")] == [
        (10, [2, 2]),
        (15, [1, 4]),
    ]
    back = recs.events("reshape")[1]
    assert back["idle"] == [3] and "release" in back["reason"]
    rel = recs.events("release")
    assert [(e.step, e["ranks"], e.get("refused")) for e in rel] == [(15, [3], None)], rel
    # Within the bound: the request made during step 12 left rank 3 empty from step 15 on,
    # and no check gave it layers again while it stayed released.
    assert res[3]["value"]["idle"] == list(range(15, STEPS))
    assert "handed back" in recs.events("autodp")[-1]["reason"]
    freezes = dict((e.step, e["frozen"]) for e in recs.events("freeze"))
    model, optim = {}, {}
    for r in res:
        model.update(r["value"].get("model", {}))
        optim.update(r["value"].get("optim", {}))
    from dynpipe.runtime.reference import ReferenceTrainer
    from dynpipe.runtime.train import build_model_and_data

    m, data = build_model_and_data(cfg)
    ref = ReferenceTrainer(model=m, batch_size=BATCH, microbatches=MICRO, optim=cfg.optim)
    losses = []
    for s in range(STEPS):
        if s in freezes:
            ref.freeze(freezes[s])
        ref.groups = (3, 3) if 10 <= s < 15 else None
        losses.append(ref.step(s, data.batch(s, BATCH)))
    assert_same_tensors(model, ref.model_state(), "parameters")
    assert_same_tensors(optim, ref.optim_state(), "optimizer state")
    assert res[0]["value"]["losses"] == losses


def _replicated_release(rank: int, world: int, cfg) -> dict:
    from pathlib import Path

    from dynpipe.cli import main
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    idle: list[int] = []

    def on_step(engine, res) -> None:
        if engine.idle:
            idle.append(res.step)
        if rank == 0 and res.step == 2:
            assert main(["release", "--rank", "3", str(Path(cfg.log).parent)]) == 0

    out = train(cfg, topo=Topology.from_env(device="cpu"), on_step=on_step, policy=_Still())
    return {"idle": idle, "steps": len(out["losses"])}


@pytest.mark.slow
def test_without_autodp_a_release_while_replicated_is_refused_in_one_line(tmp_path) -> None:
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.records import read_log

    cfg = TrainConfig(
        model="mlp",
        model_args=MODEL,
        steps=15,
        batch_size=16,
        microbatches=2,
        dp=2,
        progress=False,
        telemetry=False,
        log=str(tmp_path / "run" / "log.jsonl"),
        adapt=AdaptConfig(mode="measured", monitor_every=EVERY),
    )
    res = run_ranks(_replicated_release, 4, cfg, timeout_s=300)
    assert all(r["value"] == {"idle": [], "steps": 15} for r in res), res  # it trains on
    rel = read_log(cfg.log).events("release")
    # Refused once (the request stays pending, not re-reported every window).
    assert [(e.step, e["ranks"]) for e in rel] == [(5, [3])], rel
    assert "launch with --autodp" in rel[0]["refused"]


# ---- the decision and the copies (pure logic, no process group) -----------------------------

N = 12


def _toy(*, bandwidth: float = 1e12, param: float = 1e5):
    import numpy as np

    from dynpipe.planner.costs import CostModel

    f = np.ones(N)
    return CostModel(
        model="toy",
        layer_names=tuple(f"l{i}" for i in range(N)),
        fwd_ms=f,
        bwd_ms=2 * f,
        param_bytes=np.full(N, param),
        out_bytes=np.full(N, 1e3),
        act_bytes=np.full(N, 1e3),
        opt_mult=np.full(N, 2.0),
        buffer_bytes=np.zeros(N),
        bandwidth=np.zeros(0),
        latency_ms=np.zeros(0),
        microbatch_size=4,
        meta={"link_bandwidth": bandwidth, "link_latency_ms": 0.0},
    )


def _plan(bounds, ranks, *, dp: int = 1, microbatches: int = 8):
    from dynpipe.planner.plan import Plan, StagePlan

    stages = tuple(StagePlan(a, b, r) for (a, b), r in zip(bounds, ranks, strict=True))
    return Plan(model="toy", num_layers=N, stages=stages, microbatches=microbatches, dp=dp)


# 6 of 12 layers frozen; the freeze kept them on rank 0 and left rank 1 idle.
FROZEN = 6
AFTER_FREEZE = _plan([(0, 7), (7, 9), (9, 12)], [0, 2, 3])


def _decide(costs, plan=AFTER_FREEZE, **kw):
    import numpy as np

    from dynpipe.runtime.autodp import decide_shape

    bwd = costs.bwd_ms.copy()
    bwd[:, :FROZEN] = 0.0  # what measured_costs makes of frozen layers
    args = dict(
        plan=plan,
        world_size=4,
        frozen=FROZEN,
        step=10,
        min_gain=0.05,
        horizon_steps=100,
        rebuild_ms=1.0,
    )
    import dataclasses

    return decide_shape(dataclasses.replace(costs, bwd_ms=np.asarray(bwd)), **{**args, **kw})


def test_candidate_shapes_keep_the_microbatches_and_the_schedule_runnable() -> None:
    from dynpipe.runtime.autodp import candidate_shapes

    kw = {"schedule": "1f1b", "units": 8}
    assert candidate_shapes(4, dp=1, total_microbatches=8, **kw) == [(2, 2), (4, 1)]
    assert candidate_shapes(4, dp=1, total_microbatches=6, **kw) == [(2, 2)]  # 6 % 4
    assert candidate_shapes(4, dp=2, total_microbatches=8, **kw) == [(4, 1)]  # more only
    assert candidate_shapes(4, dp=1, total_microbatches=2, **kw) == []  # 1F1B: 1 < 2 stages
    gpipe = {"schedule": "gpipe", "units": 8}
    assert candidate_shapes(4, dp=1, total_microbatches=2, **gpipe) == [(2, 2)]
    # Stages can never outnumber what is left after the frozen prefix.
    assert candidate_shapes(8, dp=1, total_microbatches=8, schedule="gpipe", units=2) == [
        (4, 2),
        (8, 1),
    ]


def test_frozen_work_makes_more_replicas_pay_by_the_controllers_rule() -> None:
    v = _decide(_toy())
    assert v.take and v.proposed[0] > 1 and v.current == (1, 3), v
    # The best candidate is the one proposed; the first stage keeps the frozen prefix.
    best = min(s["step_ms"] for s in v.shapes)
    assert v.proposed_ms == pytest.approx(best, abs=1e-3) and v.proposed_ms < v.current_ms
    assert v.bounds[0][0] == 0 and v.bounds[0][1] >= FROZEN + 1
    assert v.copy_bytes > 0 and v.pause_ms > 1.0
    # The same rule as other moves: a gain below min_gain, or a pause it would not pay back
    # within the horizon, is not taken.
    assert "below" in _decide(_toy(), min_gain=0.9).reason
    slow = _decide(_toy(), rebuild_ms=1e9)
    assert not slow.take and "does not pay" in slow.reason
    assert "memory" in _decide(_toy(), memory_bytes=1.0).reason


def test_a_slow_link_prices_the_gradient_all_reduce() -> None:
    # 100 MB of gradients over 1 MB/s: every replicated shape waits on its all-reduce.
    v = _decide(_toy(bandwidth=1e6, param=1e8))
    assert not v.take and v.proposed_ms > v.current_ms, v
    assert all(s["reduce_ms"] > 0 for s in v.shapes)


def test_no_candidate_shape_is_reported_not_guessed() -> None:
    plan = _plan([(0, 7), (7, 9), (9, 12)], [0, 2, 3], microbatches=3)
    v = _decide(_toy(), plan=plan)
    assert not v.take and "no shape" in v.reason and v.shapes == ()


def test_copies_give_each_rank_what_it_lacks_from_balanced_holders() -> None:
    from dynpipe.runtime.autodp import copy_plan, held_ranges

    names = [f"l{i}" for i in range(N)]
    two = _plan([(0, 7), (7, 12)], [0, 1], dp=2, microbatches=4)
    assert held_ranges(two, world_size=4) == ((0, 7), (7, 12), (0, 7), (7, 12))
    one = held_ranges(AFTER_FREEZE, world_size=4)
    assert one == ((0, 7), (7, 7), (7, 9), (9, 12))
    # 2 x 2 -> 4 x 1: each rank lacks the other stage's layers, held by both replicas.
    new = [(0, N)] * 4
    copies = copy_plan(held_ranges(two, world_size=4), new, names=names, sizes=[10.0] * N)
    lacked = {(g, i) for g in range(4) for i in range(N)}
    lacked -= {
        (g, i) for g, (a, b) in enumerate(held_ranges(two, world_size=4)) for i in range(a, b)
    }
    assert {(t.dst, t.layer) for t in copies} == lacked and len(copies) == len(lacked)
    sent: dict[int, float] = {}
    for t in copies:
        a, b = held_ranges(two, world_size=4)[t.src]
        assert a <= t.layer < b  # from a rank that holds it
        sent[t.src] = sent.get(t.src, 0.0) + t.nbytes
    # Both copies of each stage send: the load is shared between the replicas.
    assert set(sent) == {0, 1, 2, 3} and max(sent.values()) - min(sent.values()) <= 10 * N


def test_collapsed_costs_keep_the_prefix_and_the_training_layer_together() -> None:
    import numpy as np

    from dynpipe.runtime.autodp import collapse_frozen, copy_sizes

    c = _toy()
    u = collapse_frozen(c, frozen=3)
    assert u.num_layers == N - 3
    assert u.fwd_ms[0, 0] == 4.0 and u.bwd_ms[0, 0] == 8.0  # 4 forwards; bwd as given
    assert u.param_bytes[0] == 1e5 and u.buffer_bytes[0] == 3e5  # frozen: no gradient
    assert np.array_equal(u.fwd_ms[0, 1:], c.fwd_ms[0, 4:])
    sizes = copy_sizes(c, frozen=3)
    assert sizes[:3] == [1e5] * 3 and sizes[3] == 3e5  # no optimizer state when frozen


def test_measured_costs_fill_what_was_not_timed_and_zero_frozen_backwards() -> None:
    import numpy as np

    from dynpipe.runtime.autodp import measured_costs

    plan = _plan([(0, 6), (6, 12)], [0, 1])
    layers = {
        "fwd_ms": [2.0] * 6 + [None] * 6,
        "bwd_ms": [0.0] * 3 + [4.0] * 3 + [None] * 6,
        "stage_fwd_ms": [12.5, None],
        "stage_bwd_ms": [12.5, None],
    }
    c = measured_costs(_toy(), layers=layers, plan=plan, frozen=3)
    # Untimed layers: the prior scaled as the timed ones measured (2x); frozen: no backward.
    assert np.allclose(c.fwd_ms[0], 2.0) and np.allclose(c.bwd_ms[0, 3:], 4.0)
    assert np.all(c.bwd_ms[0, :3] == 0.0)
    assert c.stage_fwd_ms[0] == pytest.approx(0.5) and c.stage_bwd_ms[0] == pytest.approx(0.5)


# ---- bad input: one line, before any worker starts --------------------------------------------

MLP = ["--model-arg", "depth=4", "--model-arg", "width=16"]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--nproc", "2", "--autodp"], ["--autodp", "needs --freeze"]),
        (["--nproc", "1", "--freeze", "--autodp"], ["a run of 1 rank", "--nproc 2"]),
        (
            ["--nproc", "3", "--freeze", "--autodp", "--microbatches", "4"],
            ["3 x 1", "4 microbatches", "--microbatches 3"],
        ),
        (["--nproc", "4", "--dp", "4", "--freeze", "--autodp"], ["replica already"]),
        (["--nproc", "4", "--dp", "2", "--freeze"], ["--dp 2 replicas", "add --autodp"]),
    ],
)
def test_bad_autodp_input_is_one_line(capsys, args: list[str], needles: list[str]) -> None:
    from dynpipe.cli import main

    rc = main(["train", *MLP, *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, lines
    for n in needles:
        assert n in lines[0], lines[0]


def test_autodp_config_needs_freeze_and_allows_a_replicated_start() -> None:
    from dynpipe.errors import UserError
    from dynpipe.runtime.config import TrainConfig

    with pytest.raises(UserError, match="needs --freeze"):
        TrainConfig(autodp=True)
    with pytest.raises(UserError, match="--dp 2 replicas are not supported"):
        TrainConfig(dp=2, freeze=True)
    assert TrainConfig(dp=2, freeze=True, autodp=True).autodp
