"""Every rank's policy sees the same window and so keeps the same state.

The move a run makes is one rank's decision, broadcast; that is only the safety net. The
rule is that every rank's policy reads the same numbers (the gathered window, the agreed
pause of each move), so every rank decides the same and any rank's decision is the job's.
These runs record, on every rank, a digest of each window's every field, the policy's
decision and a digest of its state, and require them identical on all ranks at every
window: a plain two-stage pipeline (with a forced move that leaves the rank that writes the
log idle, and one back), and a 2 x 2 replicated run that reshapes to 4 x 1 and back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import numpy as np
import pytest
import torch
from distutil import forced_decision, run_ranks

from dynpipe.runtime.adapt.config import AdaptConfig
from dynpipe.runtime.adapt.window import Window

pytestmark = pytest.mark.slow

MODEL = {"depth": 6, "width": 32}  # 8 layers
EVERY = 2


def _h(value: Any) -> str:
    """A short digest of a window field or a policy state (arrays bit for bit)."""
    h = hashlib.sha256()

    def add(v: Any) -> None:
        if isinstance(v, np.ndarray):
            h.update(str(v.shape).encode())
            h.update(np.ascontiguousarray(v, dtype=np.float64).tobytes())
        elif isinstance(v, Window):
            for f in dataclasses.fields(v):
                h.update(f.name.encode())
                add(getattr(v, f.name))
        elif isinstance(v, dict):
            for k in sorted(v, key=repr):
                h.update(repr(k).encode())
                add(v[k])
        elif isinstance(v, list | tuple):
            h.update(b"[")
            for x in v:
                add(x)
            h.update(b"]")
        else:
            h.update(repr(v).encode())

    add(value)
    return h.hexdigest()[:12]


def _fields(w: Window) -> dict[str, str]:
    return {f.name: _h(getattr(w, f.name)) for f in dataclasses.fields(w)}


def _state(state: dict) -> str:
    return _h(json.loads(json.dumps(state, default=lambda o: np.asarray(o).tolist())))


class _Recorder:
    """The configured policy, recording what it saw and made of each window; at the given
    windows (by their last step) it forces a move: ``{step: (bounds, shares)}``."""

    def __init__(self, inner, moves: dict, ranks: int) -> None:
        self.inner, self.moves, self.ranks = inner, moves, ranks
        self.mode_used = inner.mode_used
        self.seen: list[dict[str, Any]] = []

    def observe(self, window: Window):
        d = self.inner.observe(window)
        self.seen.append(
            {
                "step": window.step,
                "fields": _fields(window),
                "decision": None
                if d is None
                else (d.repartition, d.reason, d.bounds, d.shares, tuple(d.dropped or ())),
                "state": _state(self.inner.state()),
            }
        )
        if window.step in self.moves:
            bounds, shares = self.moves[window.step]
            return forced_decision(window.step, bounds, shares, ranks=self.ranks)
        return d

    def applied(self, *, step: int, pause_ms: float, moved_bytes: int) -> None:
        self.seen.append({"applied": step, "pause_ms": pause_ms, "bytes": moved_bytes})
        self.inner.applied(step=step, pause_ms=pause_ms, moved_bytes=moved_bytes)

    def describe(self) -> str:
        return self.inner.describe()

    def state(self) -> dict:
        return self.inner.state()

    def load_state(self, state: dict) -> None:
        self.inner.load_state(state)


def _recorded(rank: int, world: int, cfg, moves: dict) -> dict:
    from dynpipe.runtime.adapt.make import make_policy
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import build_model_and_data, train

    torch.set_num_threads(1)
    model, _ = build_model_and_data(cfg)
    dp = cfg.dp or 1
    inner = make_policy(
        cfg.adapt,
        model=model,
        microbatch_size=cfg.batch_size // (cfg.microbatches * dp),
        num_ranks=world // dp,
        dp=dp,
    )
    policy = _Recorder(inner, moves, ranks=world)
    out = train(cfg, topo=Topology.from_env(device="cpu"), policy=policy)
    return {"seen": policy.seen, "log": out["log"]}


def _cfg(tmp, steps: int, **kw):
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.optim import OptimConfig

    base = dict(
        model="mlp",
        model_args=MODEL,
        steps=steps,
        batch_size=16,
        microbatches=4,
        schedule="gpipe",
        progress=False,
        telemetry=True,  # per-rank device readings: gathered, so every rank sees them all
        log=str(tmp / "log.jsonl"),
        optim=OptimConfig(name="adamw", lr=3e-3),
        adapt=AdaptConfig(mode="measured", monitor_every=EVERY, settle_windows=0),
    )
    return TrainConfig(**{**base, **kw})


def _assert_same_on_every_rank(res: list[dict]) -> list[dict]:
    """Every rank's record equals rank 0's; the failure lists every difference."""
    seen = [r["value"]["seen"] for r in res]
    first, wrong = seen[0], []
    for rank, other in enumerate(seen[1:], start=1):
        assert len(other) == len(first), (rank, len(other), len(first))
        for a, b in zip(first, other, strict=True):
            if "fields" not in a:
                if a != b:
                    wrong.append(f"rank {rank} learned {b}, rank 0 {a}")
                continue
            at = f"rank {rank}, window after step {a['step']}:"
            differ = sorted(k for k in a["fields"] if a["fields"][k] != b["fields"][k])
            if differ:
                wrong.append(f"{at} window fields {differ}")
            if a["decision"] != b["decision"]:
                wrong.append(f"{at} decided {b['decision']}, rank 0 {a['decision']}")
            if a["state"] != b["state"]:
                wrong.append(f"{at} policy state")
    assert not wrong, "\n".join(wrong)
    return first


def test_one_pipeline_every_rank_sees_the_same_windows(tmp_path) -> None:
    from dynpipe.runtime.records import read_log

    # After the window ending at step 5, rank 1 (the last stage, which writes the log) goes
    # idle; after step 11, it takes its layers back.
    moves = {5: (((0, 8), (8, 8)), None), 11: (((0, 4), (4, 8)), None)}
    cfg = _cfg(tmp_path, 18)
    res = run_ranks(_recorded, 2, cfg, moves, timeout_s=180)
    first = _assert_same_on_every_rank(res)
    windows = [s for s in first if "fields" in s]
    assert len(windows) >= 7, len(windows)
    assert sum("applied" in s for s in first) >= 2
    log = read_log(cfg.log)
    # The forced moves were made: rank 1 idle from step 7 and holding layers again by step
    # 13 (the policy may have moves of its own besides: on a loaded machine it once gave
    # rank 1 its layers back at step 9, which left the forced move at 13 nothing to do).
    assert 7 in {e.step for e in log.events("repartition")}
    counts = [(e.step, e["idle"]) for e in log.events("stage_count")]
    assert (7, [1]) in counts, counts
    assert any(idle == [] and 7 < step <= 13 for step, idle in counts), counts
    # Without --elastic the policy never leaves a rank idle itself: the forced 1-stage plan,
    # measured faster here (an mlp on CPU), is not one its plan memory goes back to.
    assert [step for step, idle in counts if idle] == [7], counts


def test_replicas_every_rank_sees_the_same_windows_across_a_reshape(tmp_path) -> None:
    from dynpipe.runtime.records import read_log

    # After step 3: DP only (4 x 1) from step 5; after step 7: back to 2 x 2 (3|5, shares
    # 5/3) from step 9.
    moves = {3: (((0, 8),), (2, 2, 2, 2)), 7: (((0, 3), (3, 8)), (5, 3))}
    adapt = AdaptConfig(mode="measured", monitor_every=EVERY, settle_windows=0, reshape=True)
    cfg = _cfg(tmp_path, 14, dp=2, adapt=adapt)
    res = run_ranks(_recorded, 4, cfg, moves, timeout_s=240)
    first = _assert_same_on_every_rank(res)
    assert sum("fields" in s for s in first) >= 5
    shapes = [(e.step, e["new_shape"]) for e in read_log(cfg.log).events("reshape")]
    # The forced reshapes were made: DP only from step 5, 2 x 2 again by step 9 (the policy
    # may reshape on its own besides: in one fresh-clone CI run it went back to 2 x 2 at
    # step 7, which left the forced move at 9 a repartition within that shape, and to DP
    # only again at 11).
    assert (5, [4, 1]) in shapes, shapes
    assert any(shape == [2, 2] and 5 < step <= 9 for step, shape in shapes), shapes
