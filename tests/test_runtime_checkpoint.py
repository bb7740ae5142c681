"""A checkpoint written under one plan resumes under another plan, or in one process, and
training continues bit-identically to an uninterrupted run."""

from __future__ import annotations

import pytest
import torch
from distutil import run_ranks
from test_runtime_equivalence import BATCH, make_batch, optim_config

pytestmark = pytest.mark.slow

MODEL = ("mlp", {"depth": 6, "width": 32})
SAVE_AT, END = 3, 6


def _engine(world: int, opt: str):
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.topology import Topology

    model = get_model(MODEL[0], **MODEL[1])
    plan = Plan.even(model, world, schedule="1f1b", microbatches=4)
    return PipelineEngine(
        model,
        plan,
        topo=Topology.from_env(device="cpu"),
        config=EngineConfig(batch_size=BATCH, optim=optim_config(opt)),
    )


def _write(rank: int, world: int, ckpt: str, opt: str) -> dict:
    from dynpipe.runtime.checkpointer import save_checkpoint

    eng = _engine(world, opt)
    for s in range(SAVE_AT):
        eng.step(s, make_batch(eng.model, s))
    save_checkpoint(
        ckpt,
        model_state=eng.model_state(),
        optim_state=eng.optim_state(),
        meta={"step": SAVE_AT, "plan": eng.plan.to_dict()},
        rank=rank,
    )
    for s in range(SAVE_AT, END):
        eng.step(s, make_batch(eng.model, s))
    return {"model": eng.model_state(), "optim": eng.optim_state()}


def _resume(rank: int, world: int, ckpt: str, opt: str) -> dict:
    from dynpipe.runtime.checkpoint import load_checkpoint
    from dynpipe.runtime.optim import import_state

    eng = _engine(world, opt)
    state, meta = load_checkpoint(
        ckpt, model_state=eng.model_state(), held_params=set(eng.named_params), rank=rank
    )
    import_state(eng.optimizer, eng.named_params, state)
    for s in range(meta["step"], END):
        eng.step(s, make_batch(eng.model, s))
    return {"model": eng.model_state(), "optim": eng.optim_state()}


def _merge(results: list[dict]) -> tuple[dict, dict]:
    model, optim = {}, {}
    for r in results:
        model.update(r["value"]["model"])
        optim.update(r["value"]["optim"])
    return model, optim


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), f"{what}: different keys"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_checkpoint_moves_between_plans_and_into_one_process(tmp_path, opt: str) -> None:
    from dynpipe.models import get_model
    from dynpipe.runtime.checkpoint import load_checkpoint
    from dynpipe.runtime.reference import ReferenceTrainer

    ckpt = str(tmp_path / "ckpt")
    full_model, full_optim = _merge(run_ranks(_write, 2, ckpt, opt))
    four_model, four_optim = _merge(run_ranks(_resume, 4, ckpt, opt))
    _assert_same(full_model, four_model, "2-stage -> 4-stage params")
    _assert_same(full_optim, four_optim, "2-stage -> 4-stage optimizer state")

    torch.set_num_threads(1)
    ref = ReferenceTrainer(
        model=get_model(MODEL[0], **MODEL[1]),
        batch_size=BATCH,
        microbatches=4,
        optim=optim_config(opt),
    )
    state, meta = load_checkpoint(
        ckpt, model_state=ref.model_state(), held_params=set(ref.named_params)
    )
    ref.load(ref.model_state(), state)
    for s in range(meta["step"], END):
        ref.step(s, make_batch(ref.model, s))
    _assert_same(full_model, ref.model_state(), "2-stage -> one process params")
    _assert_same(full_optim, ref.optim_state(), "2-stage -> one process optimizer state")
