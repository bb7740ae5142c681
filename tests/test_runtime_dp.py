"""Data x pipeline parallelism trains exactly what one process does.

Real gloo process groups: 2 replicas of 2 stages (4 ranks) and 2 replicas of 1 stage (2
ranks), every step's batch split between the replicas. Gradients of each stage are summed
across replicas by DDP and divided once by the step's microbatch count.

Two references, both single-process gradient accumulation over the same microbatches:

- ``groups`` (``ReferenceTrainer``): the microbatches' gradients added in the replicas'
  grouping (each replica's share in order, then the replicas' sums). That is the order the
  replicated run adds in (a two-rank all-reduce computes ``a + b``, which is commutative),
  so parameters, optimizer state and losses must match bit for bit.
- plain accumulation in microbatch order: float addition is not associative, so adding the
  same gradients grouped by replica can change the last bits of a sum. Compared within
  ``rtol=1e-5, atol=1e-7`` (float32 epsilon is 1.2e-7: a few SGD steps carry a regrouped
  sum's rounding into a few ulps), and ``atol=1e-5`` under AdamW: AdamW divides each
  gradient by its own running magnitude, so a gradient that is exactly zero in exact
  arithmetic but rounding noise in floats (gpt's attention key bias: softmax ignores a shift
  shared by every key) takes steps of noise/|noise| x lr, whose sign the grouping decides
  (measured: 2e-6 after 4 steps at lr 3e-3).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distutil import run_ranks
from test_runtime_equivalence import optim_config

pytestmark = pytest.mark.slow

BATCH = 16
STEPS = 4
MODELS = {
    "mlp": {"depth": 6, "width": 32},
    "gpt": {"depth": 2, "width": 32, "heads": 2, "seq_len": 8, "vocab": 32},
}


def make_batch(model, step: int, batch: int = BATCH):
    g = torch.Generator().manual_seed(20_000 + step)
    spec = model.input_spec
    if spec.dtype.is_floating_point:
        x = torch.randn(batch, *spec.shape, generator=g)
    else:
        x = torch.randint(0, spec.vocab, (batch, *spec.shape), generator=g)
    y = torch.randint(0, spec.num_classes or spec.vocab, (batch, *spec.target_shape), generator=g)
    return x, y


def _plan(model, pp: int, dp: int, *, schedule: str = "1f1b", sizes=None, **fields):
    from dynpipe.planner import Plan

    sizes = sizes or [1] * (pp - 1) + [len(model) - (pp - 1)]
    plan = Plan.from_bounds(model, sizes, schedule=schedule, microbatches=4)
    return dataclasses.replace(plan, dp=dp, **fields)


def _engine(model, plan, opt: str):
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.mesh import init_mesh
    from dynpipe.runtime.topology import Topology

    topo = Topology.from_env(device="cpu")
    return PipelineEngine(
        model,
        plan,
        topo=topo,
        mesh=init_mesh(topo, dp=plan.dp),
        config=EngineConfig(batch_size=BATCH, optim=optim_config(opt)),
    )


COMBOS = [("mlp", "1f1b", "sgd"), ("mlp", "gpipe", "adamw"), ("gpt", "1f1b", "adamw")]


def _replicated(rank: int, world: int, dp: int) -> dict:
    from dynpipe.models import get_model

    out = {}
    for name, sched, opt in COMBOS:
        model = get_model(name, **MODELS[name])
        eng = _engine(model, _plan(model, world // dp, dp, schedule=sched), opt)
        # The last step times every layer (hooks that change nothing computed); its timed
        # microbatches leave out the last one, whose backward runs the gradient all-reduce.
        res = [
            eng.step(s, make_batch(model, s), sample_layers=s == STEPS - 1) for s in range(STEPS)
        ]
        losses = [r.loss for r in res]
        assert res[-1].timing.layers is not None and eng.microbatches == 4
        assert eng.timer.layers.chunks == {0, 1, 2}, eng.timer.layers.chunks
        out[(name, sched, opt)] = (eng.mesh.replica, eng.model_state(), eng.optim_state(), losses)
    return out


def _reference(name: str, opt: str, groups, *, steps=STEPS, dropped=()):
    """``groups``: None (plain), a tuple for every step, or a function of the step."""
    from dynpipe.models import get_model
    from dynpipe.runtime.reference import ReferenceTrainer

    model = get_model(name, **MODELS[name])
    ref = ReferenceTrainer(model=model, batch_size=BATCH, microbatches=8, optim=optim_config(opt))
    losses = []
    for s in range(steps):
        ref.groups = groups(s) if callable(groups) else groups
        ref.dropped = dropped(s) if callable(dropped) else dropped
        losses.append(ref.step(s, make_batch(model, s)))
    return ref.model_state(), ref.optim_state(), losses


def _by_replica(values: list) -> dict[int, tuple[dict, dict]]:
    """{replica: (model state, optimizer state)} merged over that replica's stages."""
    out: dict[int, tuple[dict, dict]] = {}
    for replica, ms, os_, *_ in values:
        m, o = out.setdefault(replica, ({}, {}))
        assert not set(ms) & set(m), "two stages of one replica hold the same tensor"
        m.update(ms)
        o.update(os_)
    return out


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{what}: {k} differs"


def _assert_close(got: dict, want: dict, what: str, *, atol: float) -> None:
    assert set(got) == set(want), what
    for k, v in want.items():
        if v.is_floating_point():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=atol, msg=f"{what}: {k}")
        else:
            assert torch.equal(got[k], v), f"{what}: {k}"


@pytest.mark.parametrize("world", [4, 2], ids=["dp2xpp2", "dp2xpp1"])
def test_replicated_pipelines_equal_single_process_training(world: int) -> None:
    torch.set_num_threads(1)
    results = run_ranks(_replicated, world, 2)
    for combo in COMBOS:
        name, _, opt = combo
        values = [r["value"][combo] for r in results]
        replicas = _by_replica(values)
        assert sorted(replicas) == [0, 1]
        grouped = _reference(name, opt, (4, 4))
        plain = _reference(name, opt, None)
        for replica, (ms, os_) in replicas.items():
            what = f"{combo} replica {replica}"
            _assert_equal(ms, grouped[0], what)
            _assert_equal(os_, grouped[1], what)
            atol = 1e-5 if opt == "adamw" else 1e-7  # see the module docstring
            _assert_close(ms, plain[0], what, atol=atol)
            _assert_close(os_, plain[1], what, atol=atol)
        for v in values:  # the loss is the global mean, the same on every rank
            assert v[3] == grouped[2], combo
            assert v[3] == pytest.approx(plain[2], rel=1e-6), combo
        fresh = get_model_state(name)
        assert any(not torch.equal(fresh[k], v) for k, v in grouped[0].items()), "no training"


def get_model_state(name: str) -> dict[str, torch.Tensor]:
    from dynpipe.models import get_model

    model = get_model(name, **MODELS[name])
    layers = model.build_range(0, len(model))
    return {f"{ln}.{k}": v for ln, layer in layers.items() for k, v in layer.state_dict().items()}


# Forced changes at step boundaries: (step, sizes of the split or None, shares, dropped).
# The last ones leave replica 1 out (partial reduce) for two steps: the first under a new
# DDP reducer, the second when DDP rebuilds its buckets, which the left-out replica shadows.
FORCED = {
    4: [
        (2, [5, 3], None, ()),
        (3, None, (6, 2), ()),
        (5, [2, 6], (3, 5), ()),
        (6, [4, 4], None, ()),
        (7, None, None, (1,)),
    ],
    2: [(2, None, (6, 2), ()), (4, None, (1, 7), ()), (7, None, (2, 6), (0,))],
}
FORCED_STEPS = 9


def _schedule_of(world: int):
    """Per step: (groups, dropped) in force."""
    groups, dropped, out = (4, 4), (), []
    changes = {s: (sh, dr) for s, _, sh, dr in FORCED[world]}
    for s in range(FORCED_STEPS):
        if s in changes:
            sh, dropped = changes[s]
            groups = sh or (4, 4)
        out.append((groups, dropped))
    return out


def _forced(rank: int, world: int, opt: str) -> dict:
    from dynpipe.models import get_model
    from dynpipe.runtime.migrate import repartition

    model = get_model("mlp", **MODELS["mlp"])
    pp = world // 2
    eng = _engine(model, _plan(model, pp, 2, schedule="gpipe"), opt)
    changes = {s: (sizes, sh, dr) for s, sizes, sh, dr in FORCED[world]}
    moved, losses = [], []
    for s in range(FORCED_STEPS):
        if s in changes:
            sizes, sh, dr = changes[s]
            cur = [b - a for a, b in eng.plan.bounds]
            new = _plan(model, pp, 2, schedule="gpipe", sizes=sizes or cur, shares=sh, dropped=dr)
            stats = repartition(eng, new)
            moved.append([repr(t) for t in stats.transfers])
        losses.append(eng.step(s, make_batch(model, s)).loss)
    return eng.mesh.replica, eng.model_state(), eng.optim_state(), losses, moved


@pytest.mark.parametrize("world", [4, 2], ids=["dp2xpp2", "dp2xpp1"])
def test_forced_repartitions_and_share_shifts_stay_exact(world: int) -> None:
    torch.set_num_threads(1)
    sched = _schedule_of(world)
    for opt in ("sgd", "adamw"):
        values = [r["value"] for r in run_ranks(_forced, world, opt)]
        want = _reference(
            "mlp", opt, lambda s: sched[s][0], steps=FORCED_STEPS, dropped=lambda s: sched[s][1]
        )
        for replica, (ms, os_) in _by_replica(values).items():
            _assert_equal(ms, want[0], f"{opt} replica {replica}")
            _assert_equal(os_, want[1], f"{opt} replica {replica}")
        assert all(v[3] == want[2] for v in values), opt
        if world == 4:
            # Layers moved in both replicas, each between its own ranks.
            moved = values[0][4]
            assert any(moved) and not all(moved), moved


def _partial(rank: int, world: int) -> dict:
    from dynpipe.models import get_model

    model = get_model("mlp", **MODELS["mlp"])
    eng = _engine(model, _plan(model, 2, 2, schedule="1f1b", dropped=(1,)), "sgd")
    assert eng.plan.partial and eng.plan.counted_microbatches == 4
    losses = [eng.step(s, make_batch(model, s)).loss for s in range(STEPS)]
    return eng.mesh.replica, eng.model_state(), eng.optim_state(), losses


def test_partial_reduce_updates_with_the_kept_replicas_share_only() -> None:
    torch.set_num_threads(1)
    values = [r["value"] for r in run_ranks(_partial, 4)]
    kept = _reference("mlp", "sgd", (4, 4), dropped=(1,))
    full = _reference("mlp", "sgd", (4, 4))
    for replica, (ms, os_) in _by_replica(values).items():
        # Both replicas hold the update of replica 0's microbatches alone ...
        _assert_equal(ms, kept[0], f"replica {replica}")
        _assert_equal(os_, kept[1], f"replica {replica}")
        # ... which is not the full batch's: partial reduce changes what training computes.
        assert any(not torch.equal(ms[k], v) for k, v in full[0].items())
    assert all(v[3] == kept[2] for v in values)
