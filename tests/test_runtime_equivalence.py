"""Pipelined training equals single-process training with gradient accumulation, bit for bit.

Real gloo process groups (2 and 4 ranks) run every combination of schedule (GPipe, 1F1B),
optimizer (SGD with momentum, AdamW, both with global-norm clipping) and model (mlp, a small
gpt); parameters and optimizer state are compared exactly with ``ReferenceTrainer``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from distutil import run_ranks

pytestmark = pytest.mark.slow

STEPS = 4
BATCH = 8
MODELS = {
    "mlp": {"depth": 6, "width": 32},
    "gpt": {"depth": 2, "width": 32, "heads": 2, "seq_len": 8, "vocab": 32},
}
COMBOS = list(itertools.product(MODELS, ("gpipe", "1f1b"), ("sgd", "adamw")))


def make_batch(model, step: int):
    x, y = None, None
    g = torch.Generator().manual_seed(10_000 + step)
    spec = model.input_spec
    if spec.dtype.is_floating_point:
        x = torch.randn(BATCH, *spec.shape, generator=g)
    else:
        x = torch.randint(0, spec.vocab, (BATCH, *spec.shape), generator=g)
    high = spec.num_classes or spec.vocab
    y = torch.randint(0, high, (BATCH, *spec.target_shape), generator=g)
    return x, y


def optim_config(name: str):
    from dynpipe.runtime.optim import OptimConfig

    return OptimConfig(
        name=name,
        lr=0.02 if name == "sgd" else 3e-3,
        clip_grad=0.5,
        warmup_steps=2,
        schedule="cosine",
        total_steps=STEPS,
        weight_decay=0.01,
    )


def _pipelined(rank: int, world: int) -> dict:
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.topology import Topology

    topo = Topology.from_env(device="cpu")
    out = {}
    for name, sched, opt in COMBOS:
        model = get_model(name, **MODELS[name])
        # Uneven stages on purpose: the split must not matter.
        sizes = [1] * (world - 1) + [len(model) - (world - 1)]
        plan = Plan.from_bounds(model, sizes, schedule=sched, microbatches=4)
        eng = PipelineEngine(
            model, plan, topo=topo, config=EngineConfig(batch_size=BATCH, optim=optim_config(opt))
        )
        losses = [eng.step(s, make_batch(model, s)).loss for s in range(STEPS)]
        out[(name, sched, opt)] = (eng.model_state(), eng.optim_state(), losses)
    return out


def _reference(name: str, opt: str):
    from dynpipe.models import get_model
    from dynpipe.runtime.reference import ReferenceTrainer

    model = get_model(name, **MODELS[name])
    ref = ReferenceTrainer(model=model, batch_size=BATCH, microbatches=4, optim=optim_config(opt))
    losses = [ref.step(s, make_batch(model, s)) for s in range(STEPS)]
    return ref.model_state(), ref.optim_state(), losses


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_is_bit_identical_to_single_process(world: int) -> None:
    torch.set_num_threads(1)
    results = run_ranks(_pipelined, world)
    refs = {(n, o): _reference(n, o) for n, _, o in COMBOS}
    for combo in COMBOS:
        name, _, opt = combo
        ref_model, ref_optim, ref_losses = refs[(name, opt)]
        model_state, optim_state = {}, {}
        for res in results:
            ms, os_, losses = res["value"][combo]
            assert not set(ms) & set(model_state), f"{combo}: two ranks hold the same tensor"
            model_state.update(ms)
            optim_state.update(os_)
        assert losses == ref_losses, f"{combo}: losses differ"
        assert set(model_state) == set(ref_model), combo
        assert set(optim_state) == set(ref_optim), combo
        for k, v in ref_model.items():
            assert torch.equal(model_state[k], v), f"{combo}: parameter {k} differs"
        for k, v in ref_optim.items():
            assert torch.equal(optim_state[k], v), f"{combo}: optimizer state {k} differs"
        # The test is only meaningful if training moved the weights.
        fresh = get_fresh(name)
        assert any(not torch.equal(fresh[k], v) for k, v in ref_model.items())


def get_fresh(name: str) -> dict[str, torch.Tensor]:
    from dynpipe.models import get_model

    model = get_model(name, **MODELS[name])
    layers = model.build_range(0, len(model))
    return {f"{ln}.{k}": v for ln, layer in layers.items() for k, v in layer.state_dict().items()}
