"""Evaluation through the pipeline equals evaluation of the unsplit model, bit for bit on CPU,
before and after a live repartition; it puts layers in eval mode (BatchNorm statistics, no
dropout) and back, and leaves training exactly as it would have been without it."""

from __future__ import annotations

import math

import pytest
import torch
from distutil import run_ranks
from torch import nn

pytestmark = pytest.mark.slow

BATCH = 8
EVAL_BATCHES = 3
MODELS = {
    # name: (zoo config, schedule, has dropout / batch norm)
    "mlp": ({"depth": 4, "width": 32, "in_features": 12, "num_classes": 5}, "1f1b"),
    "gpt": ({"depth": 2, "width": 32, "heads": 2, "seq_len": 8, "vocab": 32}, "gpipe"),
    "bnmlp": ({}, "1f1b"),
}


def bnmlp(*, seed: int = 0):
    """Linear layers with BatchNorm and dropout: layers whose eval mode changes the output."""
    from dynpipe.models.base import InputSpec, LayeredModel, LayerSpec

    def block(fan_in: int, fan_out: int):
        return lambda: nn.Sequential(
            nn.Linear(fan_in, fan_out), nn.BatchNorm1d(fan_out), nn.GELU(), nn.Dropout(0.3)
        )

    layers = [LayerSpec("inp", "linear", block(12, 32))]
    layers += [LayerSpec(f"fc{i}", "linear", block(32, 32)) for i in range(3)]
    layers.append(LayerSpec("head", "linear", lambda: nn.Linear(32, 5)))
    return LayeredModel(
        name="bnmlp",
        layers=tuple(layers),
        loss_fn=nn.functional.cross_entropy,
        input_spec=InputSpec(shape=(12,), num_classes=5),
        seed=seed,
    )


def _model(name: str):
    from dynpipe.models import get_model

    return bnmlp() if name == "bnmlp" else get_model(name, **MODELS[name][0])


def _optim():
    from dynpipe.runtime.optim import OptimConfig

    return OptimConfig(name="adamw", lr=3e-3, clip_grad=0.5)


def _eval_batches(model, *, first: bool, last: bool):
    from dynpipe.data import get_data

    data = get_data("synthetic", model=model, split="test", seed=1)
    return [data.batch(b, BATCH) if first or last else None for b in range(EVAL_BATCHES)]


def _train_batch(model, step: int):
    from dynpipe.data import get_data

    return get_data("synthetic", model=model, seed=1).batch(step, BATCH)


def _pipelined(rank: int, world: int) -> dict:
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.migrate import repartition
    from dynpipe.runtime.topology import Topology

    out = {}
    for name, (_, schedule) in MODELS.items():
        model = _model(name)
        n = len(model)
        eng = PipelineEngine(
            model,
            Plan.from_bounds(model, [1, n - 1], schedule=schedule, microbatches=4),
            topo=Topology.from_env(device="cpu"),
            config=EngineConfig(batch_size=BATCH, optim=_optim()),
        )

        def evaluate(eng=eng, model=model):
            return eng.evaluate(_eval_batches(model, first=eng.is_first, last=eng.is_last))

        for s in range(2):
            eng.step(s, _train_batch(model, s))
        before = evaluate()
        again = evaluate()
        state_before = {k: v.clone() for k, v in eng.model_state().items()}
        stats = repartition(eng, Plan.from_bounds(model, [n - 1, 1], schedule=schedule))
        moved = evaluate()
        for s in range(2, 4):
            eng.step(s, _train_batch(model, s))
        after = evaluate()
        out[name] = {
            "results": [r.to_dict() for r in (before, again, moved, after)],
            "state_before": state_before,
            "state_after": eng.model_state(),
            "training_modes": all(m.training for m in eng.module.modules()),
            "moved_layers": len(stats.transfers),
        }
    return out


def _reference_eval(name: str, state: dict):
    from dynpipe.runtime.reference import ReferenceTrainer

    model = _model(name)
    ref = ReferenceTrainer(model=model, batch_size=BATCH, microbatches=4, optim=_optim())
    ref.load(state, {})
    return ref.evaluate(_eval_batches(model, first=True, last=True)).to_dict()


def _same(a: dict, b: dict) -> bool:
    keys = set(a) - {"eval_ms"}
    return {k: a[k] for k in keys} == {k: b[k] for k in keys}


def test_pipeline_eval_is_bit_identical_to_the_unsplit_model_across_a_repartition() -> None:
    from dynpipe.runtime.reference import ReferenceTrainer

    torch.set_num_threads(1)
    results = run_ranks(_pipelined, 2)
    for name in MODELS:
        per_rank = [r["value"][name] for r in results]
        # Every rank reports the numbers the last stage computed.
        for k in range(4):
            assert _same(per_rank[0]["results"][k], per_rank[1]["results"][k]), name
        before, again, moved, after = per_rank[1]["results"]
        assert per_rank[1]["moved_layers"] > 0
        # Eval mode: no dropout, running BatchNorm statistics, so a second pass is identical;
        # and the same weights under another split evaluate identically.
        assert _same(before, again) and _same(before, moved), name
        assert not _same(before, after), f"{name}: training between evaluations changed nothing"
        for res, key in ((before, "state_before"), (after, "state_after")):
            state = {**per_rank[0][key], **per_rank[1][key]}
            assert _same(res, _reference_eval(name, state)), name
        assert all(r[name]["training_modes"] for r in (p["value"] for p in results)), name
        assert before["batches"] == EVAL_BATCHES and before["samples"] == EVAL_BATCHES * BATCH
        if name == "gpt":
            assert before["targets"] == EVAL_BATCHES * BATCH * 8  # per token
            assert before["perplexity"] == pytest.approx(math.exp(before["loss"]))
        else:
            assert before["targets"] == before["samples"] and before["perplexity"] is None
        assert 0.0 <= before["accuracy"] <= 1.0
    # Models without dropout train bit-identically to the reference, evaluations and the
    # repartition notwithstanding: evaluation consumes no random numbers and touches no state.
    for name in ("mlp", "gpt"):
        model = _model(name)
        ref = ReferenceTrainer(model=model, batch_size=BATCH, microbatches=4, optim=_optim())
        for s in range(4):
            ref.step(s, _train_batch(model, s))
        got = {
            **results[0]["value"][name]["state_after"],
            **results[1]["value"][name]["state_after"],
        }
        want = ref.model_state()
        assert set(got) == set(want)
        assert all(torch.equal(got[k], want[k]) for k in want), name


def _wrong_batch_size(rank: int, world: int) -> dict:
    from dynpipe.errors import UserError
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.topology import Topology

    model = _model("mlp")
    eng = PipelineEngine(
        model,
        Plan.even(model, 1),
        topo=Topology.from_env(device="cpu"),
        config=EngineConfig(batch_size=BATCH, optim=_optim()),
    )
    x, y = _train_batch(model, 0)
    try:
        eng.evaluate([(x[:4], y[:4])])
    except UserError as exc:
        return {"error": str(exc), "modes": all(m.training for m in eng.module.modules())}
    return {"error": None}


def test_eval_batches_must_have_the_training_batch_size() -> None:
    (res,) = run_ranks(_wrong_batch_size, 1)
    msg = res["value"]["error"]
    assert msg and "has 4 samples but the pipeline runs batches of 8" in msg
    assert res["value"]["modes"]  # layers are back in training mode after a failed pass


def _train_with_eval(rank: int, world: int, log: str) -> list[dict]:
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.optim import OptimConfig
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    cfg = TrainConfig(
        model="mlp",
        model_args={"depth": 2, "width": 32},
        data="digits",
        steps=12,
        batch_size=16,
        microbatches=2,
        optim=OptimConfig(name="adamw", lr=3e-3),
        progress=False,
        log=log,
        eval_every=5,
    )
    train(cfg, topo=Topology.from_env(device="cpu"))
    return []


def test_training_logs_eval_records_every_k_steps_and_at_the_end(tmp_path) -> None:
    from dynpipe.runtime.records import read_dicts as read_log

    log = tmp_path / "log.jsonl"
    run_ranks(_train_with_eval, 2, str(log))
    recs = read_log(log)
    evals = [r for r in recs if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [5, 10, 12]
    for r in evals:
        # digits: 359 held-out images, 22 whole batches of 16 (the default reads them once).
        assert r["split"] == "test" and r["batches"] == 22 and r["samples"] == 22 * 16
        assert r["targets"] == r["samples"] and r["perplexity"] is None
        assert 0.0 <= r["accuracy"] <= 1.0 and math.isfinite(r["loss"]) and r["eval_ms"] > 0
    assert evals[-1]["loss"] < evals[0]["loss"]
    # An evaluation after the last step comes before the run's end event.
    kinds = [r.get("event", r["type"]) for r in recs]
    assert kinds.index("end") > max(i for i, k in enumerate(kinds) if k == "eval")


def test_eval_options_are_validated() -> None:
    from dynpipe.errors import UserError
    from dynpipe.runtime.config import TrainConfig

    with pytest.raises(UserError, match="--eval-every must be >= 0"):
        TrainConfig(eval_every=-1)
    with pytest.raises(UserError, match="--eval-batches >= 1, got 5 and 0"):
        TrainConfig(eval_every=5, eval_batches=0)
