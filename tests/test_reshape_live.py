"""``--reshape``: a replicated run changes its data x pipeline shape live, by the policy.

Pure logic first: the replica policy on synthetic windows of a 4-rank job finds 4 x 1 (DP
only) best on clean devices and leaves it for a shape that shields a slowed device, and
comes back when it recovers. Then real gloo processes: a policy injected into the training
loop moves 2 x 2 -> 4 x 1 -> 2 x 2 between steps, and the run trains what one process does
(bit for bit up to the reshape and across it; within float tolerance once four replicas
add their gradients, see ``TOL``); a checkpoint taken after the reshape resumes in the new
shape.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from distutil import (
    assert_same_tensors,
    forced_decision,
    merged_state,
    replica_window,
    run_ranks,
    stopped_after,
)

from dynpipe.models import get_model
from dynpipe.planner.costs import CostModel
from dynpipe.runtime.adapt.config import AdaptConfig
from dynpipe.runtime.adapt.policy import Decision
from dynpipe.runtime.adapt.replicas import ReplicaConfig, ReplicaPolicy, shape_options
from dynpipe.runtime.adapt.window import Window

# ---- the policy on synthetic windows ----------------------------------------------------

_M = get_model("mlp", depth=10, width=64)
_L = len(_M)
_B = CostModel.from_model(_M, microbatch_size=4, num_devices=1)
# Milliseconds-sized layer costs (the analytic model's are microseconds for this mlp).
CF, CB = _B.fwd_ms[0] * 1e3, _B.bwd_ms[0] * 1e3
BASE = dataclasses.replace(_B, fwd_ms=CF[None], bwd_ms=CB[None])


def _window(step: int, cfg: ReplicaConfig, slow, *, k: int = 5, extra: float = 1.0) -> Window:
    """``distutil.replica_window`` for this file's layers; ``extra``: the job's step beyond
    its slowest replica's (what no per-layer model sees)."""
    return replica_window(step, cfg, slow, CF, CB, k=k, extra=extra)


def _drive(
    slowdowns,
    *,
    start: ReplicaConfig,
    windows: int,
    reshape: bool = True,
    base: CostModel = BASE,
    extra=lambda c: 1.0,
):
    """The policy over ``windows`` windows of a 4-rank job; ``slowdowns(w)``: per global
    rank; ``extra(cfg)``: the unmodelled part of a configuration's step. Returns the
    configuration held in each window, the windows that moved, and the policy."""
    policy = ReplicaPolicy(
        base=base,
        config=AdaptConfig(mode="measured", settle_windows=0, horizon_steps=50, reshape=reshape),
        num_stages=start.shape[1],
        dp=start.shape[0],
    )
    cfg, held, moves = start, [], []
    for w in range(windows):
        held.append(cfg)
        d = policy.observe(_window(w * 5 + 4, cfg, slowdowns(w), extra=extra(cfg)))
        if d is not None and d.repartition:
            moves.append((w, d))
            cfg = ReplicaConfig(bounds=d.bounds, shares=d.shares, dropped=d.dropped)
            policy.applied(step=w * 5 + 5, pause_ms=1.0, moved_bytes=d.moved_bytes)
    return held, moves, policy


def _shielded(c: ReplicaConfig, *, replica: int) -> bool:
    """The slowed device (stage 1 of ``replica``) does less than an even share: its
    replica takes fewer microbatches, or its stage holds fewer layers."""
    a, b = c.bounds[1]
    return c.shares[replica] == min(c.shares) < max(c.shares) or b - a < _L // 2


TWO_BY_TWO = ReplicaConfig(bounds=((0, _L // 2), (_L // 2, _L)), shares=(4, 4))
DP_ONLY = ReplicaConfig(bounds=((0, _L),), shares=(2, 2, 2, 2))


def test_shapes_split_the_steps_microbatches_one_pipeline_included() -> None:
    assert shape_options(4, total=8, schedule="gpipe", num_layers=12) == [(1, 4), (2, 2), (4, 1)]
    # 6 microbatches do not split over 4 replicas; 1F1B needs pp per replica.
    assert shape_options(4, total=6, schedule="gpipe", num_layers=12) == [(1, 4), (2, 2)]
    assert shape_options(8, total=8, schedule="1f1b", num_layers=12) == [
        (1, 8),
        (2, 4),
        (4, 2),
        (8, 1),
    ]
    assert shape_options(8, total=4, schedule="gpipe", num_layers=12) == [(1, 8), (2, 4), (4, 2)]
    # One layer: one stage, so DP only.
    assert shape_options(4, total=4, schedule="1f1b", num_layers=1) == [(4, 1)]


def test_clean_devices_make_dp_only_best_and_a_slowed_one_another_shape() -> None:
    onset, end = 6, 14

    def slow(w: int) -> list[float]:
        return [1.0, 1.0, 1.0, 5.0 if onset <= w < end else 1.0]

    held, moves, policy = _drive(slow, start=TWO_BY_TWO, windows=22)
    shapes = [c.shape for c in held]
    # Clean: 2 x 2 pays a pipeline bubble that DP only does not (no fill and drain).
    first = next(w for w, c in enumerate(held) if c.shape == (4, 1))
    assert first <= 3, [(w, d.reason) for w, d in moves]
    assert moves[0][1].reason.startswith("reshape 2 x 2 -> 4 x 1"), moves[0][1].reason
    assert moves[0][1].moved_bytes > 0 and moves[0][1].pause_ms > 1.0  # the copies' wire
    assert set(shapes[first:onset]) == {(4, 1)}
    # Rank 3 at 5x: DP only waits for its replica's microbatch (5 units) whatever the shares;
    # 2 x 2 puts it in one stage of one replica (replica 1), which does less work.
    during = held[onset + 1 : end + 1]
    assert all(c.shape == (2, 2) for c in during), [(w, d.reason) for w, d in moves]
    assert all(_shielded(c, replica=1) for c in during), during
    # Recovered: back to DP only.
    assert held[-1].shape == (4, 1) and held[-1].shares == (2, 2, 2, 2)
    assert policy.dp == 4 and policy.num_stages == 1
    # Every move changed the shape or the shares, never to a configuration that fails
    # the rule: at most the three reshapes and a reshare or two.
    assert len(moves) <= 6, [(w, d.reason) for w, d in moves]


def test_without_reshape_the_policy_keeps_its_shape() -> None:
    held, moves, _ = _drive(lambda w: [1.0] * 4, start=TWO_BY_TWO, windows=8, reshape=False)
    assert {c.shape for c in held} == {(2, 2)} and not moves


def test_a_slow_device_in_dp_only_moves_to_a_shape_that_shields_it() -> None:
    held, moves, _ = _drive(lambda w: [1.0, 5.0, 1.0, 1.0], start=DP_ONLY, windows=8)
    assert held[-1].shape == (2, 2), [(w, d.reason) for w, d in moves]
    # Rank 1 is stage 1 of replica 0 in 2 x 2.
    assert _shielded(held[-1], replica=0), held[-1]


def test_a_reshape_that_does_not_pay_back_its_copies_is_not_taken() -> None:
    # Links of 1 MB/s: the copies of half the model to each rank take longer than the
    # horizon's gain.
    slow_link = dataclasses.replace(BASE, meta={**BASE.meta, "link_bandwidth": 1e6})
    held, moves, policy = _drive(lambda w: [1.0] * 4, start=TWO_BY_TWO, windows=6, base=slow_link)
    assert {c.shape for c in held} == {(2, 2)} and not moves
    assert policy.memory.entries  # it did judge the windows


def test_a_shape_measured_slower_than_predicted_is_left_and_not_tried_again() -> None:
    # DP only steps 40% slower than any per-layer model says (say, a slow all-reduce):
    # the model moves there once, the measurement brings the run back and keeps it there.
    held, moves, _ = _drive(
        lambda w: [1.0] * 4,
        start=TWO_BY_TWO,
        windows=16,
        extra=lambda c: 1.4 if c.shape == (4, 1) else 1.0,
    )
    shapes = [c.shape for c in held]
    assert shapes.count((4, 1)) <= 2 and shapes[-6:] == [(2, 2)] * 6, shapes
    assert len(moves) == 2, [(w, d.reason) for w, d in moves]
    assert "measured" in moves[1][1].reason, moves[1][1].reason


def test_policy_state_after_a_reshape_round_trips() -> None:
    _, _, policy = _drive(lambda w: [1.0] * 4, start=TWO_BY_TWO, windows=6)
    assert (policy.dp, policy.num_stages) == (4, 1)
    again = ReplicaPolicy(
        base=BASE, config=policy.config, num_stages=policy.num_stages, dp=policy.dp
    )
    again.load_state(policy.state())
    assert again.state() == policy.state()
    # A state saved before a reshape (the restart baseline's checkpoint) loads into the
    # new shape's policy and is carried over, measurements included.
    other = ReplicaPolicy(base=BASE, config=policy.config, num_stages=2, dp=2)
    other.load_state(policy.state())
    assert (other.dp, other.num_stages, len(other.est)) == (2, 2, 2)
    assert len(other.memory.entries) == len(policy.memory.entries)
    assert {c.shape for c, _, _ in other.memory.entries} == {(2, 2), (4, 1)}
    np.testing.assert_array_equal(other.est[1].clean_f, policy.est[0].clean_f)
    wrong = ReplicaPolicy(base=BASE, config=policy.config, num_stages=3, dp=2)
    with pytest.raises(ValueError, match="4 x 1 ranks"):
        wrong.load_state(policy.state())


# ---- live, on gloo processes ------------------------------------------------------------

MODEL = {"depth": 6, "width": 32}  # 8 layers
BATCH = 16  # 8 microbatches of 2 samples in every shape: 2 x 4, then 4 x 2
EVERY = 2


def _cfg(tmp: str, steps: int, **kw):
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.optim import OptimConfig

    base = dict(
        model="mlp",
        model_args=MODEL,
        steps=steps,
        batch_size=BATCH,
        dp=2,
        microbatches=4,
        schedule="gpipe",
        progress=False,
        telemetry=False,
        log=f"{tmp}/log.jsonl",
        optim=OptimConfig(name="adamw", lr=3e-3, clip_grad=0.5, total_steps=8),
        adapt=AdaptConfig(mode="measured", monitor_every=EVERY, reshape=True),
    )
    return TrainConfig(**{**base, **kw})


class _Forced:
    """Moves at given windows (by their last step): ``{step: (bounds, shares)}``. It reads
    every replica's window, one pipeline's included, as the replica policy does."""

    mode_used = "measured"
    per_replica = True

    def __init__(self, moves: dict, engine: dict) -> None:
        self.moves, self.engine = moves, engine
        self.seen: list[tuple[int, int, int, tuple[int, ...]]] = []
        self.pauses: list[float] = []
        self.after: list[tuple[dict, dict]] = []  # each move's state, before the next step

    def observe(self, window: Window) -> Decision | None:
        assert window.replicas is not None and len(window.replicas) == window.dp
        self.seen.append((window.step, window.dp, window.num_stages, tuple(window.shares)))
        if window.step not in self.moves:
            return None
        bounds, shares = self.moves[window.step]
        return forced_decision(window.step, bounds, shares)

    def applied(self, *, step: int, pause_ms: float, moved_bytes: int) -> None:
        self.pauses.append(pause_ms)
        eng = self.engine["engine"]
        copy = lambda d: {k: v.clone() for k, v in d.items()}  # noqa: E731 (live tensors)
        self.after.append((copy(eng.model_state()), copy(eng.optim_state())))

    def describe(self) -> str:
        return "forced"

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass


# The policy reads a window while the next step runs; its move follows that step: after
# the window ending at step 1, DP only from step 3; after step 3, 2 x 2 (3|5, shares 5/3)
# from step 5.
MOVES = {1: (((0, 8),), (2, 2, 2, 2)), 3: (((0, 3), (3, 8)), (5, 3))}
GROUPS = {0: (4, 4), 1: (4, 4), 2: (4, 4), 3: (2, 2, 2, 2), 4: (2, 2, 2, 2), 5: (5, 3), 6: (5, 3)}


def _live(rank: int, world: int, cfg, moves: dict) -> dict:
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    shapes: list[tuple[int, int, int]] = []
    final: dict = {}
    held: dict = {}

    def on_step(engine, res) -> None:
        held["engine"] = engine
        shapes.append((res.step, engine.mesh.dp, engine.mesh.pp))
        final.update(
            model=engine.model_state(), optim=engine.optim_state(), replica=engine.mesh.replica
        )

    policy = _Forced(moves, held)
    out = train(cfg, topo=Topology.from_env(device="cpu"), on_step=on_step, policy=policy)
    return {
        "shapes": shapes,
        "losses": out["losses"],
        "start": out["start"],
        "seen": policy.seen,
        "pauses": policy.pauses,
        "after": policy.after,
        **final,
    }


def _reference(cfg, groups: dict[int, tuple[int, ...] | None], *, steps: int | None = None):
    """Single-process accumulation over the run's 8 microbatches: in the replicas' grouping
    of each step (each replica's share, then the replicas' sums), or in microbatch order
    (None: one pipeline's)."""
    from dynpipe.runtime.reference import ReferenceTrainer
    from dynpipe.runtime.train import build_model_and_data

    model, data = build_model_and_data(cfg)
    ref = ReferenceTrainer(model=model, batch_size=BATCH, microbatches=8, optim=cfg.optim)
    losses = []
    for s in range(cfg.steps if steps is None else steps):
        ref.groups = groups[s]
        losses.append(ref.step(s, data.batch(s, BATCH)))
    return ref.model_state(), ref.optim_state(), losses


# Four replicas: gloo's all-reduce over 4 ranks adds the replicas' sums in an order of its
# own, which differs between parts of one tensor (measured: no single grouping of the four
# matches every element), so from the first DP-only step the run is compared within float
# tolerance - AdamW's, as in tests/test_runtime_dp.py: a gradient that is rounding noise
# takes full-size steps whose sign the order decides. Everything else is bit for bit: the
# 2 x 2 steps before the reshape, the state every rank holds right after it, and the
# replicas against one another.
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _close(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for k, v in want.items():
        if v.is_floating_point():
            torch.testing.assert_close(got[k], v, **TOL, msg=f"{what}: {k}")
        else:
            assert torch.equal(got[k], v), f"{what}: {k}"


@pytest.mark.slow
def test_live_reshape_two_by_two_to_dp_only_and_back_trains_what_one_process_does(tmp_path) -> None:
    from dynpipe.planner import Plan
    from dynpipe.runtime.autodp import held_ranges
    from dynpipe.runtime.records import read_log

    torch.set_num_threads(1)
    cfg = _cfg(str(tmp_path), 7)
    res = run_ranks(_live, 4, cfg, MOVES, timeout_s=120)
    log = read_log(cfg.log)
    reshapes = log.events("reshape")
    assert [(e.step, e["old_shape"], e["new_shape"]) for e in reshapes] == [
        (3, [2, 2], [4, 1]),
        (5, [4, 1], [2, 2]),
    ], reshapes
    # DP only holds every layer on every rank: going back to 2 x 2 copies nothing.
    assert reshapes[0]["bytes"] > 0 and reshapes[1]["bytes"] == 0
    for e in reshapes:
        assert e["reason"] == "forced" and e["pause_ms"] > 0
        # Each rank got exactly the layers it lacked, from a rank that held them.
        old, new = (Plan.from_dict(e[k]) for k in ("old_plan", "new_plan"))
        before, after = held_ranges(old, world_size=4), held_ranges(new, world_size=4)
        lacked = {(g, i) for g, (a, b) in enumerate(after) for i in range(a, b)}
        lacked -= {(g, i) for g, (a, b) in enumerate(before) for i in range(a, b)}
        copied = set()
        for c in e["copies"]:  # "name#layer:rSRC->rDST nB"
            layer, rest = c.split("#")[1].split(":r")
            src, dst = (int(x) for x in rest.split()[0].split("->r"))
            assert before[src][0] <= int(layer) < before[src][1], c
            copied.add((dst, int(layer)))
        assert copied == lacked
    assert reshapes[1]["new_plan"]["shares"] == [5, 3]
    # The job's time between the step before each reshape and its first step holds the
    # whole pause (every rank's gap covers its own part); the other steps' gaps do not.
    gaps = {s.step: s.between_ms for s in log.steps}
    assert gaps[0] == 0 and all(g is not None and g >= 0 for g in gaps.values()), gaps
    for e in reshapes:
        assert gaps[e.step] >= e["pause_ms"], (gaps, e.step, e["pause_ms"])
    # The first reshape's first step opens a window: its event carries the same gap.
    firsts = {e.step: e["between_ms"] for e in log.events("first_step")}
    assert firsts == {3: gaps[3]}, firsts
    assert [e["shares"] for e in log.events("decision")] == [[2, 2, 2, 2], [5, 3]]
    # Step records follow the shape: 4 replicas of one stage at steps 3-4.
    assert [len(s.replicas) for s in log.steps] == [2, 2, 2, 4, 4, 2, 2]
    for got in res:
        v = got["value"]
        assert [(s, d, p) for s, d, p in v["shapes"]] == [
            (s, *((4, 1) if s in (3, 4) else (2, 2))) for s in range(7)
        ]
        # The policy saw each window in the shape it ran, and learned each pause.
        assert v["seen"] == [(1, 2, 2, (4, 4)), (3, 4, 1, (2, 2, 2, 2))]
        assert len(v["pauses"]) == 2 and all(p > 0 for p in v["pauses"])
    # The reshape to DP only copied every layer's parameters and optimizer state exactly:
    # right after it every rank holds the whole model as one process has it after 3 steps.
    at_m, at_o, at_l = _reference(cfg, GROUPS, steps=3)
    for got in res:
        m, o = got["value"]["after"][0]
        assert_same_tensors(m, at_m, "parameters after the reshape to 4 x 1")
        assert_same_tensors(o, at_o, "optimizer state after the reshape to 4 x 1")
        assert got["value"]["losses"][:3] == at_l
    want_m, want_o, want_l = _reference(cfg, GROUPS)
    m0, o0 = merged_state(res, 0)
    m1, o1 = merged_state(res, 1)
    assert_same_tensors(m1, m0, "the replicas' parameters")  # replicas never drift apart
    assert_same_tensors(o1, o0, "the replicas' optimizer state")
    _close(m0, want_m, "parameters")
    _close(o0, want_o, "optimizer state")
    for got in res:
        torch.testing.assert_close(got["value"]["losses"], want_l, **TOL)


@pytest.mark.slow
def test_a_checkpoint_after_a_live_reshape_resumes_in_the_new_shape(tmp_path) -> None:
    torch.set_num_threads(1)
    kw = {"save_every": 4, "save_dir": str(tmp_path / "ckpt"), "resume": "auto"}
    # Stopped after step 4 (its checkpoint is of step 4, in 4 x 1 since step 3).
    run_ranks(_live, 4, _cfg(str(tmp_path), 5, **kw), {1: MOVES[1]}, timeout_s=120)
    stopped_after(kw["save_dir"], 5)
    again = _cfg(str(tmp_path), 7, **kw)
    res = run_ranks(_live, 4, again, {}, timeout_s=120)
    for got in res:
        v = got["value"]
        assert v["start"] == 4
        assert {(d, p) for _, d, p in v["shapes"]} == {(4, 1)}
    groups = {s: (4, 4) if s < 3 else (2, 2, 2, 2) for s in range(7)}
    want_m, want_o, want_l = _reference(again, groups)
    first_m, first_o = merged_state(res, 0)
    for replica in range(4):
        m, o = merged_state(res, replica)
        assert_same_tensors(m, first_m, f"parameters of replica {replica}")
        assert_same_tensors(o, first_o, f"optimizer state of replica {replica}")
    _close(first_m, want_m, "parameters")  # four replicas: TOL says why
    _close(first_o, want_o, "optimizer state")
    for got in res:
        torch.testing.assert_close(got["value"]["losses"], want_l[4:], **TOL)


# ---- bad input: one line, before any worker starts ------------------------------------

_MLP = ["--model-arg", "depth=4", "--model-arg", "width=16"]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (
            ["--nproc", "4", "--adapt", "measured", "--reshape", "--elastic"],
            ["one pipeline of 4 stages with --elastic", "drop --reshape"],
        ),
        (
            [
                "--nproc",
                "4",
                "--schedule",
                "gpipe",
                "--microbatches",
                "3",
                "--batch-size",
                "12",
                "--adapt",
                "measured",
                "--reshape",
            ],
            ["as 1 x 4: no other shape splits the step's 3 microbatches", "1 x microbatches"],
        ),
        (
            ["--nproc", "4", "--dp", "2", "--adapt", "static", "--reshape"],
            ["2 x 2 with --adapt static", "drop --reshape"],
        ),
    ],
)
def test_bad_reshape_input_is_one_line(capsys, args: list[str], needles: list[str]) -> None:
    from dynpipe.cli import main

    rc = main(["train", *_MLP, *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, lines
    for n in needles:
        assert n in lines[0], lines[0]
