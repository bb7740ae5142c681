"""The training loop with pipeline replicas: a checkpoint of 2 replicas x 2 stages resumes as
1 x 4 and in one process; the adaptation loop carries out batch-share shifts and layer moves
decided on the replicas' windows; both stay exact against single-process training."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distutil import forced_decision, run_ranks

pytestmark = pytest.mark.slow

MODEL = {"depth": 6, "width": 32}
BATCH, MICRO = 16, 4  # 2 replicas x 4 microbatches of 2 samples


def _cfg(tmp: str, **kw):
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.optim import OptimConfig

    base = dict(
        model="mlp",
        model_args=MODEL,
        batch_size=BATCH,
        microbatches=MICRO,
        progress=False,
        telemetry=False,
        log=f"{tmp}/log.jsonl",
        log_every=2,
        optim=OptimConfig(name="adamw", lr=3e-3, clip_grad=0.5, total_steps=6),
    )
    return TrainConfig(**{**base, **kw})


def _train(rank: int, world: int, cfg, policy=None) -> tuple[int, dict, dict, list[float]]:
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    got = {}

    def grab(eng, res) -> None:
        got["engine"] = eng

    out = train(cfg, topo=Topology.from_env(device="cpu"), on_step=grab, policy=policy)
    eng = got["engine"]
    return eng.mesh.replica, eng.model_state(), eng.optim_state(), out["losses"]


def _reference(cfg, groups) -> tuple[dict, dict, list[float]]:
    """Single-process accumulation over the run's 8 microbatches; ``groups(step)``: the
    replicas' grouping at that step (None: one pipeline, plain order)."""
    from dynpipe.runtime.reference import ReferenceTrainer
    from dynpipe.runtime.train import build_model_and_data

    model, data = build_model_and_data(cfg)
    ref = ReferenceTrainer(model=model, batch_size=BATCH, microbatches=8, optim=cfg.optim)
    losses = []
    for s in range(cfg.steps):
        ref.groups = groups(s)
        losses.append(ref.step(s, data.batch(s, BATCH)))
    return ref.model_state(), ref.optim_state(), losses


def _merge(values, replica: int = 0) -> tuple[dict, dict]:
    m, o = {}, {}
    for rep, ms, os_, _ in values:
        if rep == replica:
            m.update(ms)
            o.update(os_)
    return m, o


def _same(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k}"


def test_checkpoint_of_two_replicas_resumes_as_one_pipeline_and_one_process(tmp_path) -> None:
    torch.set_num_threads(1)
    ckpt = str(tmp_path / "ckpt")
    first = _cfg(str(tmp_path / "a"), steps=3, dp=2, save_every=3, save_dir=ckpt)
    run_ranks(_train, 4, first)
    # The same 8 microbatches of 2 samples: one pipeline of 4 stages, then one process.
    wide = _cfg(str(tmp_path / "b"), steps=6, resume=ckpt, microbatches=8, dp=1)
    one = _cfg(str(tmp_path / "c"), steps=6, resume=ckpt, microbatches=8, stages=1)
    want = _reference(wide, lambda s: (4, 4) if s < 3 else None)
    for world, cfg in ((4, wide), (1, one)):
        values = [r["value"] for r in run_ranks(_train, world, cfg)]
        m, o = _merge(values)
        _same(m, want[0], f"resumed on {world}")
        _same(o, want[1], f"resumed on {world}")
        assert values[-1][3] == want[2][3:], world


class _Forced:
    """A policy that moves to given configurations after given windows, and checks the
    windows it is handed carry every replica's measurements."""

    mode_used = "measured"

    def __init__(self, moves: dict[int, tuple]) -> None:
        self.moves = moves
        self.seen: list = []

    def observe(self, window):
        assert window.dp == 2 and len(window.replicas) == 2, window
        assert window.reduce_ms.shape == (len(window.step_ms), 2)
        for sub, n in zip(window.replicas, window.shares, strict=True):
            assert sub.microbatches == n and sub.stage_fwd_ms.shape[1] == 2
            assert (sub.step_ms > 0).all()
        self.seen.append((window.step, window.bounds, window.shares))
        if window.step not in self.moves:
            return None
        bounds, shares = self.moves[window.step]
        return forced_decision(window.step, bounds, shares)

    def applied(self, *, step: int, pause_ms: float, moved_bytes: int) -> None:
        pass

    def describe(self) -> str:
        return "forced"

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass


# After the window ending at step 1: shares 6/2 from step 3 (the policy reads a window while
# the next step runs; the move follows that step); after step 3: layers 5|3, shares 2/6 from 5.
MOVES = {1: (((0, 4), (4, 8)), (6, 2)), 3: (((0, 5), (5, 8)), (2, 6))}


def _adapting(rank: int, world: int, tmp: str) -> tuple:
    from dynpipe.runtime.adapt.config import AdaptConfig

    adapt = AdaptConfig(mode="measured", monitor_every=2)
    cfg = _cfg(tmp, steps=6, dp=2, schedule="gpipe", adapt=adapt)
    policy = _Forced(MOVES)
    return (*_train(rank, world, cfg, policy=policy), policy.seen)


def test_adaptation_loop_shifts_shares_and_moves_layers_of_every_replica(tmp_path) -> None:
    from dynpipe.runtime.records import read_log

    torch.set_num_threads(1)
    values = [r["value"] for r in run_ranks(_adapting, 4, str(tmp_path))]
    shares = {0: (4, 4), 1: (4, 4), 2: (4, 4), 3: (6, 2), 4: (6, 2), 5: (2, 6)}
    cfg = _cfg(str(tmp_path), steps=6)
    want = _reference(dataclasses.replace(cfg, microbatches=8), lambda s: shares[s])
    for replica in (0, 1):
        m, o = _merge([v[:4] for v in values], replica)
        _same(m, want[0], f"replica {replica}")
        _same(o, want[1], f"replica {replica}")
    assert values[0][3] == want[2]
    # Every rank saw the windows under the plans in force (the last one ends the run).
    seen = values[0][4]
    assert [s for s, _, _ in seen] == [1, 3]
    assert seen[1][2] == (6, 2)
    log = read_log(tmp_path / "log.jsonl")
    reshare = log.events("reshare")
    assert [e.step for e in reshare] == [3] and reshare[0]["shares"] == [6, 2]
    assert not reshare[0]["partial"]
    rep = log.events("repartition")
    assert [e.step for e in rep] == [5] and rep[0]["new_plan"]["shares"] == [2, 6]
    steps = log.steps
    assert [s.replicas[1].microbatches for s in steps] == [4, 4, 4, 2, 2, 6]
    assert all(s.replicas[r].stages[1].rank == 2 * r + 1 for s in steps for r in (0, 1))
