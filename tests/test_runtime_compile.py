"""``--compile``: layers compiled one by one train exactly as eager ones, across a repartition.

The CPU tests compile with the ``aot_eager`` backend: it traces each layer's forward and
backward into graphs and runs them with the eager kernels, so every number matches eager
bit for bit and the test can ask for equality. (``inductor`` generates its own kernels,
whose fused reductions round differently; it is what a GPU run uses.)
"""

from __future__ import annotations

import pytest
import torch
from distutil import run_ranks
from test_runtime_equivalence import BATCH, make_batch, optim_config

STEPS = 6
MODEL = {"depth": 3, "width": 32, "heads": 2, "seq_len": 8, "vocab": 64}  # 5 layers


def _compiled_run(rank: int, world: int) -> dict:
    from torch._dynamo.utils import counters

    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.compiled import is_compiled
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.migrate import repartition
    from dynpipe.runtime.topology import Topology

    model = get_model("gpt", **MODEL)
    n = len(model)
    eng = PipelineEngine(
        model,
        Plan.from_bounds(model, [1, n - 1]),
        topo=Topology.from_env(device="cpu"),
        config=EngineConfig(batch_size=BATCH, optim=optim_config("adamw"), compile="aot_eager"),
    )
    # The first stage holds the embedding alone, then receives blocks (a kind it has not
    # run: its warm-up compiles them), then the last stage receives blocks back.
    moves = {2: Plan.from_bounds(model, [n - 1, 1]), 4: Plan.from_bounds(model, [2, n - 2])}
    losses, pauses, layers = [], [], None
    graphs = []
    for s in range(STEPS):
        if s in moves:
            stats = repartition(eng, moves[s])
            pauses.append(stats.parts_ms())
        graphs.append(counters["stats"]["unique_graphs"])
        res = eng.step(s, make_batch(model, s), sample_layers=s == STEPS - 1)
        losses.append(res.loss)
        if res.timing.layers is not None:
            layers = (res.timing.layers.fwd_ms, res.timing.layers.bwd_ms)
    return {
        "model": eng.model_state(),
        "optim": eng.optim_state(),
        "losses": losses,
        "pauses": pauses,
        "compiled": [is_compiled(m) for m in eng.module.layers.values()],
        "held": list(eng.module.layers),
        "layers": layers,
        "graphs": [*graphs, counters["stats"]["unique_graphs"]],
    }


@pytest.mark.slow
def test_compiled_pipeline_matches_eager_reference_across_repartitions() -> None:
    from dynpipe.models import get_model
    from dynpipe.runtime.reference import ReferenceTrainer

    torch.set_num_threads(1)
    results = [r["value"] for r in run_ranks(_compiled_run, 2, timeout_s=240)]
    model = get_model("gpt", **MODEL)
    ref = ReferenceTrainer(
        model=model, batch_size=BATCH, microbatches=4, optim=optim_config("adamw")
    )
    want_losses = [ref.step(s, make_batch(model, s)) for s in range(STEPS)]
    assert results[-1]["losses"] == want_losses
    got_m, got_o = {}, {}
    for r in results:
        got_m.update(r["model"])
        got_o.update(r["optim"])
        # Layers received in a move are compiled too, and keep their names.
        assert r["held"] and all(r["compiled"]), r
        # The warm-up compiled what each rebuilt stage runs: its steps compile nothing,
        # and neither does a step whose layers are timed (hooks on boundary tensors).
        g = r["graphs"]
        assert g[2] == g[3] and g[4] == g[5] == g[6], g
        # Both moves were timed with their compile warm-up as a part of the pause.
        assert len(r["pauses"]) == 2 and all(p["compile_ms"] > 0 for p in r["pauses"])
        fwd, bwd = r["layers"]
        assert len(fwd) == len(r["held"]) and all(t >= 0 for t in fwd + bwd)
    want_m, want_o = ref.model_state(), ref.optim_state()
    assert not any("_orig_mod" in k for k in got_m)
    assert set(got_m) == set(want_m) and set(got_o) == set(want_o)
    for k, v in want_m.items():
        assert torch.equal(got_m[k], v), k
    for k, v in want_o.items():
        assert torch.equal(got_o[k], v), k


def test_layers_compile_in_place_and_share_code() -> None:
    from torch._dynamo.utils import counters

    from dynpipe.models import get_model
    from dynpipe.runtime.compiled import compile_layers, is_compiled

    torch.set_num_threads(1)
    # Sixteen layers of thirteen shapes: more than dynamo's default eight entries per code
    # object, which would leave the last layers eager.
    model = get_model("vgg16", width_mult=0.0625, fc_width=32)
    x, y = model.input_spec.example(2, device="cpu")
    torch._dynamo.reset()
    counters.clear()
    layers = model.build_range(0, len(model), device="cpu")
    eager = model.build_range(0, len(model), device="cpu")
    keys = list(layers.state_dict())
    compile_layers(layers.values(), backend="aot_eager", model_layers=len(model))
    assert all(is_compiled(m) for m in layers.values()) and list(layers.state_dict()) == keys

    def run(mods) -> tuple[torch.Tensor, list[torch.Tensor]]:
        h = x
        for m in mods.values():
            h = m(h)
        loss = model.loss_fn(h, y)
        loss.backward()
        return loss, [p.grad for p in mods.parameters()]

    loss, grads = run(layers)
    want, want_grads = run(eager)
    assert torch.equal(loss, want) and all(map(torch.equal, grads, want_grads))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= len({tuple(p.shape for p in m.parameters()) for m in layers.values()})
    # A rebuilt copy (a migrated layer) reuses the compiled code: nothing new compiles.
    again = model.build_range(0, len(model), device="cpu")
    compile_layers(again.values(), backend="aot_eager", model_layers=len(model))
    run(again)
    assert counters["stats"]["unique_graphs"] == graphs


def test_bad_compile_settings_are_one_line(monkeypatch) -> None:
    from dynpipe.errors import UserError
    from dynpipe.runtime.compiled import check_backend

    with pytest.raises(UserError, match="unknown --compile-backend 'nope'") as exc:
        check_backend("nope")
    assert "\n" not in str(exc.value)
    monkeypatch.delattr(torch, "compile")
    with pytest.raises(UserError, match=r"--compile needs torch\.compile") as exc:
        check_backend("inductor")
    assert "\n" not in str(exc.value)


def test_optimizer_is_foreach_off_cuda_and_state_moves_between_kinds() -> None:
    from dynpipe.runtime.optim import OptimConfig, build_optimizer, export_state, import_state

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    named = dict(net.named_parameters())
    opt = build_optimizer(list(named.values()), OptimConfig(name="adamw"))
    assert opt.param_groups[0]["foreach"] and not opt.param_groups[0].get("fused")
    net(torch.randn(5, 4)).sum().backward()
    opt.step()
    state = export_state(opt, named)
    # Into a fused optimizer (CPU has fused AdamW too): ``step`` follows its kind.
    fused = torch.optim.AdamW(list(named.values()), fused=True)
    import_state(fused, named, state)
    assert export_state(fused, named).keys() == state.keys()
    for k, v in export_state(fused, named).items():
        assert torch.equal(v, state[k]), k
