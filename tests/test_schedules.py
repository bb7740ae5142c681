"""torch's multi-stage schedules drive dynpipe's stages, bit-identical to one process.

Real gloo process groups run interleaved 1F1B, interleaved zero bubble, ZBV and DualPipeV
over virtual stages (two per rank), with a forced repartition in the middle of the run
that moves layers between the chunks of one rank and between ranks; parameters and
optimizer state must equal single-process training with gradient accumulation bit for bit.
"""

from __future__ import annotations

import statistics

import pytest
import torch
from distutil import run_ranks
from test_runtime_equivalence import BATCH, make_batch, optim_config

pytestmark = pytest.mark.slow

STEPS = 4
MODEL = {"depth": 6, "width": 32}  # 8 layers
MICROBATCHES = 4


def _run(rank: int, world: int, schedule: str, moves: bool) -> dict:
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.migrate import repartition
    from dynpipe.runtime.topology import Topology

    model = get_model("mlp", **MODEL)
    kw = {"schedule": schedule, "microbatches": MICROBATCHES, "chunks": 2}
    plan = Plan.even(model, world, **kw)
    eng = PipelineEngine(
        model,
        plan,
        topo=Topology.from_env(device="cpu"),
        config=EngineConfig(batch_size=BATCH, optim=optim_config("adamw")),
    )
    n = len(model)
    # Uneven: the first virtual stages keep one layer each, the rest pile up on the last.
    # Layers move between ranks, and one (layer 3 under the looped placement) stays on its
    # rank but moves from its first virtual stage to its second.
    moved = Plan.from_bounds(model, [1] * (2 * world - 1) + [n - 2 * world + 1], **kw)
    losses, timings, transfers = [], [], []
    for s in range(STEPS):
        if moves and s == 2:
            transfers = [repr(t) for t in repartition(eng, moved).transfers]
        r = eng.step(s, make_batch(model, s), sample_layers=s == 1)
        losses.append(r.loss)
        timings.append(r.timing)
    # Forward-only evaluation through the same multi-stage schedule, after the repartition.
    held_out = [make_batch(model, 100 + i) for i in range(2)]
    ev = eng.evaluate(held_out)
    return {
        "eval": (ev.loss, ev.batches),
        "model": eng.model_state(),
        "optim": eng.optim_state(),
        "losses": losses,
        "timing": timings[1],
        "moved": transfers,
        "layers": list(eng.module.layers),
    }


def _reference():
    from dynpipe.models import get_model
    from dynpipe.runtime.reference import ReferenceTrainer

    ref = ReferenceTrainer(
        model=get_model("mlp", **MODEL),
        batch_size=BATCH,
        microbatches=MICROBATCHES,
        optim=optim_config("adamw"),
    )
    losses = [ref.step(s, make_batch(ref.model, s)) for s in range(STEPS)]
    ev = ref.evaluate([make_batch(ref.model, 100 + i) for i in range(2)])
    return ref.model_state(), ref.optim_state(), losses, (ev.loss, ev.batches)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb", "zbv", "dualpipev"])
def test_multi_stage_schedule_is_bit_identical(schedule: str) -> None:
    torch.set_num_threads(1)
    world = 2
    results = [r["value"] for r in run_ranks(_run, world, schedule, True)]
    want_m, want_o, want_losses, want_eval = _reference()
    model, optim = {}, {}
    for r in results:
        assert not set(r["model"]) & set(model), "two ranks hold the same tensor"
        model.update(r["model"])
        optim.update(r["optim"])
    assert set(model) == set(want_m) and set(optim) == set(want_o)
    for k, v in want_m.items():
        assert torch.equal(model[k], v), f"{schedule}: parameter {k} differs"
    for k, v in want_o.items():
        assert torch.equal(optim[k], v), f"{schedule}: optimizer state {k} differs"
    # The loss is the last stage's: rank 1 under looped placement, rank 0 under V.
    last = 0 if schedule in ("zbv", "dualpipev") else world - 1
    assert results[last]["losses"] == want_losses
    assert all(r["eval"] == want_eval for r in results), [r["eval"] for r in results]
    # The repartition moved layers between ranks, and each rank holds two virtual stages.
    assert results[0]["moved"]
    for r in results:
        t = r["timing"]
        # Every microbatch of each of the two virtual stages ran a forward and a backward.
        assert len(t.fwd_ms) == len(t.bwd_ms) == 2 * MICROBATCHES
        if schedule != "interleaved-1f1b":
            # Zero bubble: a separate weight-gradient part for the microbatches whose input
            # and weight parts torch did not merge into one backward, counted in the
            # backward it belongs to.
            assert 1 <= len(t.bwd_w_ms) <= 2 * MICROBATCHES
            assert sum(t.bwd_ms) >= sum(t.bwd_w_ms)
        # Per-layer timings cover every layer the rank held when sampled (4 of 8).
        assert t.layers is not None and len(t.layers.fwd_ms) == len(t.layers.bwd_ms) == 4
        assert all(x >= 0 for x in t.layers.bwd_ms)


SAMPLED = 5  # sampled steps per rank in the timing test


def _split_timing(rank: int, world: int, schedule: str) -> dict:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.optim import OptimConfig
    from dynpipe.runtime.topology import Topology

    # Each layer sleeps 5 ms in its forward, 5 in its input gradient, 5 in its weight one.
    model = get_model("sleepy:sleepy", depth=8, fwd_ms=5.0, bwd_i_ms=5.0, bwd_w_ms=5.0)
    plan = Plan.even(model, world, schedule=schedule, microbatches=4, chunks=2)
    eng = PipelineEngine(
        model,
        plan,
        topo=Topology.from_env(device="cpu"),
        config=EngineConfig(batch_size=BATCH, optim=OptimConfig(name="sgd", lr=0.01)),
    )
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(BATCH, 16, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
    eng.step(0, batch)
    # Several sampled steps, each layer's median: one sleep overslept on a loaded machine
    # must not decide the ratio.
    steps = [eng.step(1 + k, batch, sample_layers=True).timing for k in range(SAMPLED)]
    # The head does not sleep; the first layer's input needs no gradient (its backward is
    # its weight part alone).
    sleeping = [i for i in plan.layers_of_rank(rank) if 0 < i < len(model) - 1]
    held = plan.layers_of_rank(rank)
    at = [held.index(i) for i in sleeping]
    return {
        "fwd": [statistics.median(t.layers.fwd_ms[j] for t in steps) for j in at],
        "bwd": [statistics.median(t.layers.bwd_ms[j] for t in steps) for j in at],
        "stage_fwd": statistics.median(sum(t.fwd_ms) for t in steps),
        "stage_bwd": statistics.median(sum(t.bwd_ms) for t in steps),
    }


@pytest.mark.timing
@pytest.mark.parametrize("schedule", ["zb", "zbv"])
def test_zero_bubble_backward_times_both_parts(schedule: str) -> None:
    """A layer's backward is its input- and its weight-gradient part: twice its forward
    here (timing only the input part would read one forward)."""
    torch.set_num_threads(1)
    for r in run_ranks(_split_timing, 2, schedule):
        got = r["value"]
        for f, b in zip(got["fwd"], got["bwd"], strict=True):
            assert 1.5 < b / f < 2.7, got
        # Stage totals: every backward (input + weight) against every forward (the first
        # layer's and the head's lower it a little).
        assert 1.4 < got["stage_bwd"] / got["stage_fwd"] < 2.7, got
