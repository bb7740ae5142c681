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
    idle, losses, probes = [], [], []
    for s in range(STEPS):
        if s in plans:
            repartition(eng, plans[s])
        idle.append(eng.idle)
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
    want_losses = [ref.step(s, make_batch(ref.model, s)) for s in range(STEPS)]
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
