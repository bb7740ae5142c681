"""``--reshape`` to and from one pipeline over every rank (``1 x N``).

For the replica policy one pipeline is a run of one replica: one replica's estimates, its
step the pipeline's alone (no all-reduce tail); batch shares do not move there, layers do.
Pure logic first: on synthetic windows of a 4-rank job where one device slows enough that
only a pipeline can give it little work, the policy moves DP only to ``1 x 4`` with that
device's stage small, and back to DP only when it recovers. Then real gloo processes: an
injected policy moves 2 x 2 -> 1 x 4 -> (a layer move) -> 2 x 2 between steps, bit for bit
what one process does with the same grouping; and a run launched as one pipeline with
``--reshape`` goes to DP only and back.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distutil import (
    assert_same_tensors,
    merged_state,
    replica_window,
    run_ranks,
    stopped_after,
)
from test_reshape_live import TOL, _cfg, _Forced, _live, _reference

from dynpipe.models import get_model
from dynpipe.planner.costs import CostModel
from dynpipe.runtime.adapt.config import AdaptConfig
from dynpipe.runtime.adapt.replicas import ReplicaConfig, ReplicaPolicy
from dynpipe.runtime.adapt.window import Window

# ---- the policy on synthetic windows ----------------------------------------------------

# 24 layers of equal cost: fine enough that a pipeline can give a slowed device one layer.
_M = get_model("mlp", depth=22, width=64)
_L = len(_M)
_B = CostModel.from_model(_M, microbatch_size=4, num_devices=1)
CF, CB = _B.fwd_ms[0] * 1e3, _B.bwd_ms[0] * 1e3  # milliseconds-sized, as on a device
BASE = dataclasses.replace(_B, fwd_ms=CF[None], bwd_ms=CB[None])


def _window(step: int, cfg: ReplicaConfig, slow, *, k: int = 5) -> Window:
    """``distutil.replica_window`` for this file's 24 layers: one replica's window for one
    pipeline, as the training loop hands the replica policy."""
    return replica_window(step, cfg, slow, CF, CB, k=k)


def _drive(slowdowns, *, start: ReplicaConfig, windows: int):
    """The policy over ``windows`` windows of a 4-rank job; ``slowdowns(w)``: per global
    rank. Returns the configuration held in each window, the moves and the policy."""
    policy = ReplicaPolicy(
        base=BASE,
        config=AdaptConfig(mode="measured", settle_windows=0, horizon_steps=50, reshape=True),
        num_stages=start.shape[1],
        dp=start.shape[0],
    )
    cfg, held, moves = start, [], []
    for w in range(windows):
        held.append(cfg)
        d = policy.observe(_window(w * 5 + 4, cfg, slowdowns(w)))
        if d is not None and d.repartition:
            moves.append((w, d))
            cfg = ReplicaConfig(bounds=d.bounds, shares=d.shares, dropped=d.dropped)
            policy.applied(step=w * 5 + 5, pause_ms=1.0, moved_bytes=d.moved_bytes)
    return held, moves, policy


DP_ONLY = ReplicaConfig(bounds=((0, _L),), shares=(2, 2, 2, 2))
ONE_PIPE = ReplicaConfig(
    bounds=tuple((i * _L // 4, (i + 1) * _L // 4) for i in range(4)), shares=(8,)
)


def test_a_device_slowed_past_what_replicas_can_shield_moves_the_run_to_one_pipeline() -> None:
    """Rank 3 at 5x: DP only waits for its replica's one microbatch (5 units of a
    microbatch's work); 2 x 2 makes it a stage of one replica whose split every replica
    shares (a small stage there leaves the other replica unbalanced): about 4 units; one
    pipeline gives it one layer of 24 and the rest to three devices: about 3.4."""
    onset, end = 4, 12

    def slow(w: int) -> list[float]:
        return [1.0, 1.0, 1.0, 5.0 if onset <= w < end else 1.0]

    held, moves, policy = _drive(slow, start=DP_ONLY, windows=20)
    why = [(w, d.reason) for w, d in moves]
    assert set(c.shape for c in held[:onset]) == {(4, 1)}, why
    # The onset's window sees it; the next window runs the move.
    to_pipe = next(d for w, d in moves if w >= onset)
    assert to_pipe.reason.startswith("reshape 4 x 1 -> 1 x 4"), why
    assert to_pipe.shares == (8,) and len(to_pipe.bounds) == 4
    assert to_pipe.proposed_ms < to_pipe.current_ms
    during = held[onset + 2 : end + 1]
    assert during and all(c.shape == (1, 4) for c in during), why
    # The slowed device (stage 3) holds the fewest layers; the pipeline is a run of one
    # replica: its shares are the step's microbatches.
    for c in during:
        sizes = [b - a for a, b in c.bounds]
        assert sizes[3] == min(sizes) < _L // 4 and c.shares == (8,), c
    # Recovered: back to DP only, the policy in its shape.
    assert held[-1] == DP_ONLY, why
    assert (policy.dp, policy.num_stages) == (4, 1)
    assert len(moves) <= 6, why


def test_one_pipeline_on_clean_devices_moves_to_dp_only() -> None:
    held, moves, policy = _drive(lambda w: [1.0] * 4, start=ONE_PIPE, windows=6)
    assert moves and moves[0][1].reason.startswith("reshape 1 x 4 -> 4 x 1"), moves
    assert held[-1].shape == (4, 1) and (policy.dp, policy.num_stages) == (4, 1)


def test_one_pipeline_with_a_slow_device_moves_its_layers() -> None:
    """Started as one pipeline with rank 1 at 5x: the policy of one replica keeps the
    pipeline (no shape beats it, see above) and moves layers off the slowed stage."""
    held, moves, _ = _drive(lambda w: [1.0, 5.0, 1.0, 1.0], start=ONE_PIPE, windows=6)
    assert moves, "no move"
    why = [(w, d.reason) for w, d in moves]
    assert all(d.shares == (8,) and len(d.bounds) == 4 for _, d in moves), why
    assert all(c.shape == (1, 4) for c in held), why
    sizes = [b - a for a, b in held[-1].bounds]
    assert sizes[1] == min(sizes) < _L // 4, why


# ---- live, on gloo processes ------------------------------------------------------------

# The live runs share tests/test_reshape_live.py's model, configuration, forced policy,
# worker and single-process reference.
PIPE = ((0, 2), (2, 4), (4, 6), (6, 8))


# After the window ending at step 1: one pipeline from step 3; after step 3, a layer move
# within it from step 5; after step 5, 2 x 2 (3|5, shares 5/3) from step 7.
MOVES = {
    1: (PIPE, (8,)),
    3: (((0, 1), (1, 4), (4, 6), (6, 8)), (8,)),
    5: (((0, 3), (3, 8)), (5, 3)),
}
GROUPS = {s: (4, 4) if s < 3 else None if s < 7 else (5, 3) for s in range(10)}


@pytest.mark.slow
def test_two_by_two_to_one_pipeline_and_back_trains_what_one_process_does(tmp_path) -> None:
    from dynpipe.runtime.records import read_log

    torch.set_num_threads(1)
    cfg = _cfg(str(tmp_path), 10)
    res = run_ranks(_live, 4, cfg, MOVES, timeout_s=150)
    log = read_log(cfg.log)
    assert [(e.step, e["old_shape"], e["new_shape"]) for e in log.events("reshape")] == [
        (3, [2, 2], [1, 4]),
        (7, [1, 4], [2, 2]),
    ]
    # The layer move inside one pipeline is an ordinary repartition.
    moved = log.events("repartition")
    assert [e.step for e in moved] == [5] and moved[0]["new_plan"].get("dp", 1) == 1
    # One pipeline's step records carry its one replica (what the replica policy reads).
    assert [len(s.replicas) for s in log.steps] == [2, 2, 2, 1, 1, 1, 1, 2, 2, 2]
    want_shapes = [(s, *((1, 4) if 3 <= s < 7 else (2, 2))) for s in range(10)]
    for got in res:
        v = got["value"]
        assert v["shapes"] == want_shapes
        assert v["seen"] == [
            (1, 2, 2, (4, 4)),
            (3, 1, 4, (8,)),
            (5, 1, 4, (8,)),
            (7, 2, 2, (5, 3)),
        ]
    want_m, want_o, want_l = _reference(cfg, GROUPS)
    m0, o0 = merged_state(res, 0)
    m1, o1 = merged_state(res, 1)
    assert_same_tensors(m0, want_m, "parameters")
    assert_same_tensors(o0, want_o, "optimizer state")
    assert_same_tensors(m1, m0, "the replicas' parameters")
    assert_same_tensors(o1, o0, "the replicas' optimizer state")
    for got in res:
        assert got["value"]["losses"] == want_l


def test_a_checkpoint_taken_as_one_pipeline_resumes_as_one_pipeline(tmp_path) -> None:
    """A run that reshaped 2 x 2 -> 1 x 4 and stopped resumes from its checkpoint in 1 x 4,
    under the replica policy (its windows carry their one replica), and trains on as one
    process does: bit for bit, one pipeline adding its microbatches in order."""
    torch.set_num_threads(1)
    kw = {"save_every": 4, "save_dir": str(tmp_path / "ckpt"), "resume": "auto"}
    # Stopped after step 4: its checkpoint is of step 4, in 1 x 4 since step 3.
    run_ranks(_live, 4, _cfg(str(tmp_path), 5, **kw), {1: MOVES[1]}, timeout_s=120)
    stopped_after(kw["save_dir"], 5)
    again = _cfg(str(tmp_path), 10, **kw)
    res = run_ranks(_live, 4, again, {}, timeout_s=120)
    for got in res:
        v = got["value"]
        assert v["start"] == 4
        assert {(d, p) for _, d, p in v["shapes"]} == {(1, 4)}
        # The policy reads the resumed run's windows (after the one that settles).
        assert v["seen"] and all(dp == 1 and pp == 4 for _, dp, pp, _ in v["seen"]), v["seen"]
    groups = {s: (4, 4) if s < 3 else None for s in range(10)}
    want_m, want_o, want_l = _reference(again, groups)
    m, o = merged_state(res, 0)
    assert_same_tensors(m, want_m, "parameters")
    assert_same_tensors(o, want_o, "optimizer state")
    for got in res:
        assert got["value"]["losses"] == want_l[4:]


# Launched as one pipeline with --reshape: DP only from step 3, one pipeline again from 5.
MOVES_FROM_PIPE = {1: (((0, 8),), (2, 2, 2, 2)), 3: (PIPE, (8,))}


@pytest.mark.slow
def test_a_run_launched_as_one_pipeline_reshapes_to_dp_only_and_back(tmp_path) -> None:
    from dynpipe.runtime.records import read_log

    torch.set_num_threads(1)
    cfg = _cfg(str(tmp_path), 7, dp=1, microbatches=8)
    res = run_ranks(_live, 4, cfg, MOVES_FROM_PIPE, timeout_s=150)
    log = read_log(cfg.log)
    assert [(e.step, e["old_shape"], e["new_shape"]) for e in log.events("reshape")] == [
        (3, [1, 4], [4, 1]),
        (5, [4, 1], [1, 4]),
    ]
    assert [len(s.replicas) for s in log.steps] == [1, 1, 1, 4, 4, 1, 1]
    for got in res:
        assert got["value"]["seen"] == [(1, 1, 4, (8,)), (3, 4, 1, (2, 2, 2, 2))]
    groups = {s: (2, 2, 2, 2) if 3 <= s < 5 else None for s in range(7)}
    # Bit for bit up to the reshape to DP only.
    for got in res:
        assert got["value"]["losses"][:3] == _reference(cfg, groups, steps=3)[2]
    want_m, want_o, want_l = _reference(cfg, groups)
    m, o = merged_state(res, 0)
    assert set(m) == set(want_m) and set(o) == set(want_o)
    for k, v in want_m.items():
        torch.testing.assert_close(m[k], v, **TOL, msg=f"parameters: {k}")
    for k, v in want_o.items():
        if v.is_floating_point():
            torch.testing.assert_close(o[k], v, **TOL, msg=f"optimizer state: {k}")
        else:
            assert torch.equal(o[k], v), k
    for got in res:
        torch.testing.assert_close(got["value"]["losses"], want_l, **TOL)


def _release(rank: int, world: int, cfg) -> dict:
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

    policy = _Forced({}, {})  # the replica policy's seam: reads every replica, never moves
    out = train(cfg, topo=Topology.from_env(device="cpu"), on_step=on_step, policy=policy)
    return {"idle": idle, "steps": len(out["losses"])}


def test_a_release_while_one_pipeline_under_reshape_is_refused_in_one_line(tmp_path) -> None:
    """The replica policy's shapes use every rank: a release request is refused (once, in
    one line), as for ``--dp R``, though the run is one pipeline now, and it trains on."""
    from dynpipe.runtime.records import read_log

    torch.set_num_threads(1)
    cfg = _cfg(str(tmp_path), 9, dp=1, microbatches=8, log=str(tmp_path / "run" / "log.jsonl"))
    res = run_ranks(_release, 4, cfg, timeout_s=120)
    assert all(r["value"] == {"idle": [], "steps": 9} for r in res), res
    rel = read_log(cfg.log).events("release")
    assert len(rel) == 1 and rel[0]["ranks"] == [3], rel
    assert "launch with --autodp" in rel[0]["refused"]
