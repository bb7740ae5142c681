"""``tv:`` models: torchvision's classifiers cut at block granularity compute what the
torchvision model computes, pipeline bit-identically over 2 gloo ranks, load local weights,
and refuse bad input in one line."""

from __future__ import annotations

import pytest
import torch
from distutil import run_ranks
from test_runtime_equivalence import BATCH, make_batch, optim_config

torchvision = pytest.importorskip("torchvision")

SMALL = {"num_classes": 10, "image_size": 32}  # ViT-B/16 on 32x32: 4 patches + class token
STEPS = 3


def _tv(name: str, seed: int = 4):
    torch.manual_seed(seed)
    extra = {"image_size": 32} if name.startswith("vit") else {}
    return getattr(torchvision.models, name)(weights=None, num_classes=10, **extra)


@pytest.mark.parametrize("name", ["resnet18", "vit_b_16", "convnext_tiny"])
def test_layers_equal_torchvision(name: str) -> None:
    from dynpipe.models import get_model

    model = get_model(f"tv:{name}", seed=4, **SMALL)
    x, _ = model.input_spec.example(2)
    ours = model.build_sequential().eval()
    assert torch.equal(ours(x), _tv(name).eval()(x))


def test_local_weights_and_bad_input(tmp_path) -> None:
    from dynpipe.errors import UserError
    from dynpipe.models import get_model

    ref = _tv("resnet18", seed=9).eval()
    path = tmp_path / "r18.pt"
    torch.save(ref.state_dict(), path)
    model = get_model("tv:resnet18", weights=str(path), **SMALL)
    x, _ = model.input_spec.example(2)
    assert torch.equal(model.build_sequential().eval()(x), ref(x))

    def err(name: str, **kw) -> str:
        with pytest.raises(UserError) as info:
            get_model(name, **kw)
        assert "\n" not in str(info.value)
        return str(info.value)

    assert "resnet18" in err("tv:alexnet") and "vit_b_16" in err("tv:alexnet")
    assert "has shape [10, 512] but the model's is [7, 512]" in err(
        "tv:resnet18", weights=str(path), num_classes=7, image_size=32
    )
    assert "no such file" in err("tv:resnet18", weights=str(tmp_path / "nope.pt"))
    assert "multiple of its patch 16" in err("tv:vit_b_16", image_size=40)


def _train(rank: int, world: int, name: str) -> dict:
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.topology import Topology

    model = get_model(f"tv:{name}", **SMALL)
    eng = PipelineEngine(
        model,
        Plan.even(model, world),
        topo=Topology.from_env(device="cpu"),
        config=EngineConfig(batch_size=BATCH, optim=optim_config("sgd")),
    )
    losses = [eng.step(s, make_batch(model, s)).loss for s in range(STEPS)]
    return {"model": eng.model_state(), "losses": losses}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "vit_b_16"])
def test_two_stages_equal_the_unsplit_model(name: str) -> None:
    from dynpipe.models import get_model
    from dynpipe.runtime.reference import ReferenceTrainer

    torch.set_num_threads(1)
    results = run_ranks(_train, 2, name, timeout_s=600)
    model = get_model(f"tv:{name}", **SMALL)
    ref = ReferenceTrainer(model=model, batch_size=BATCH, microbatches=4, optim=optim_config("sgd"))
    want = [ref.step(s, make_batch(model, s)) for s in range(STEPS)]
    assert results[-1]["value"]["losses"] == want
    got = {**results[0]["value"]["model"], **results[1]["value"]["model"]}
    ref_state = ref.model_state()
    assert set(got) == set(ref_state)
    for k, v in ref_state.items():
        assert torch.equal(got[k], v), k
