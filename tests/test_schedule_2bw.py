"""--schedule 2bw (PipeDream-2BW's double-buffered weights) equals its single-process rule.

The reference below is one unsplit model trained with the delayed update written out: two
copies of the weights, every microbatch of step t computed on the older copy W(t-1), the
step's accumulated gradients applied by the optimizer to the newer copy W(t). Real gloo
pipelines (2 and 3 ranks) must equal it bit for bit: losses, both weight versions and the
optimizer state, also across a forced repartition mid-run and a checkpoint save + resume
under another split. Bad combinations are refused before any process group exists.
"""

from __future__ import annotations

import pytest
import torch
from distutil import run_ranks
from test_runtime_equivalence import BATCH, make_batch, optim_config

STEPS = 5
MODEL = {"depth": 6, "width": 32}  # 8 layers
MICROBATCHES = 4
NEWEST = "2bw_newest"


class DelayedReference:
    """Single-process 2BW: ``ReferenceTrainer``'s gradients (same microbatches, division,
    clipping and optimizer), computed on the stashed copy, applied to the newest."""

    def __init__(self, opt: str) -> None:
        from dynpipe.models import get_model
        from dynpipe.runtime.reference import ReferenceTrainer

        self.ref = ReferenceTrainer(
            model=get_model("mlp", **MODEL),
            batch_size=BATCH,
            microbatches=MICROBATCHES,
            optim=optim_config(opt),
        )
        params = self.ref.named_params
        # W(-1) = W(0): the first step computes on the initial weights.
        self.newest = {n: p.detach().clone() for n, p in params.items()}
        update = self.ref.optimizer.step

        def delayed_update() -> None:
            # The parameters hold W(t-1) and its gradients; step on W(t), keep W(t) as the
            # next step's stash.
            with torch.no_grad():
                stash = {n: self.newest[n].clone() for n in params}
                for n, p in params.items():
                    p.copy_(self.newest[n])
            update()
            with torch.no_grad():
                for n, p in params.items():
                    self.newest[n] = p.detach().clone()
                    p.copy_(stash[n])

        self.ref.optimizer.step = delayed_update

    def step(self, s: int) -> float:
        return self.ref.step(s, make_batch(self.ref.model, s))

    def state(self) -> tuple[dict, dict]:
        optim = dict(self.ref.optim_state())
        optim.update({f"{n}/{NEWEST}": t for n, t in self.newest.items()})
        return self.ref.model_state(), optim


def _engine(world: int, opt: str, sizes: list[int] | None = None):
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.topology import Topology

    model = get_model("mlp", **MODEL)
    kw = {"schedule": "2bw", "microbatches": MICROBATCHES}
    plan = Plan.from_bounds(model, sizes, **kw) if sizes else Plan.even(model, world, **kw)
    return PipelineEngine(
        model,
        plan,
        topo=Topology.from_env(device="cpu"),
        config=EngineConfig(batch_size=BATCH, optim=optim_config(opt)),
    )


def _run(rank: int, world: int, opt: str, move_at: int | None) -> dict:
    from dynpipe.planner import Plan
    from dynpipe.runtime.migrate import repartition

    eng = _engine(world, opt)
    n = len(eng.model)
    moved = Plan.from_bounds(
        eng.model, [1] * (world - 1) + [n - world + 1], schedule="2bw", microbatches=MICROBATCHES
    )
    losses, transfers = [], []
    for s in range(STEPS):
        if s == move_at:
            transfers = [repr(t) for t in repartition(eng, moved).transfers]
        losses.append(eng.step(s, make_batch(eng.model, s)).loss)
    ev = eng.evaluate([make_batch(eng.model, 100)])
    return {
        "model": eng.model_state(),
        "optim": eng.optim_state(),
        "losses": losses,
        "moved": transfers,
        "last": eng.is_last,
        "eval": ev.loss,
    }


def _merged(results: list[dict]) -> tuple[dict, dict]:
    model, optim = {}, {}
    for r in results:
        assert not set(r["model"]) & set(model), "two ranks hold the same tensor"
        model.update(r["model"])
        optim.update(r["optim"])
    return model, optim


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), f"{what}: keys differ {sorted(set(got) ^ set(want))[:4]}"
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{what}: {k} differs"


def _reference(opt: str, steps: int = STEPS) -> tuple[DelayedReference, list[float]]:
    ref = DelayedReference(opt)
    return ref, [ref.step(s) for s in range(steps)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "opt", "move_at"), [(2, "adamw", None), (3, "sgd", None), (2, "adamw", 2)]
)
def test_2bw_equals_the_delayed_update_rule(world: int, opt: str, move_at: int | None) -> None:
    torch.set_num_threads(1)
    results = [r["value"] for r in run_ranks(_run, world, opt, move_at)]
    ref, want_losses = _reference(opt)
    model, optim = _merged(results)
    want_m, want_o = ref.state()
    _assert_same(model, want_m, "stashed weights")
    _assert_same(optim, want_o, "optimizer state and newest weights")
    last = next(r for r in results if r["last"])
    assert last["losses"] == want_losses
    # Evaluation sees the newest version (the model as trained), on every rank.
    with torch.no_grad():
        for name, p in ref.ref.named_params.items():
            p.copy_(ref.newest[name])
    want_eval = ref.ref.evaluate([make_batch(ref.ref.model, 100)]).loss
    assert all(r["eval"] == want_eval for r in results)
    if move_at is not None:
        assert results[0]["moved"], "the forced repartition moved no layer"
    # The rule changes training: the synchronous update gives other weights.
    from dynpipe.runtime.reference import ReferenceTrainer

    sync = ReferenceTrainer(
        model=ref.ref.model, batch_size=BATCH, microbatches=MICROBATCHES, optim=optim_config(opt)
    )
    for s in range(STEPS):
        sync.step(s, make_batch(sync.model, s))
    assert any(not torch.equal(sync.model_state()[k], v) for k, v in want_m.items())


SAVE_AT = 3


def _write(rank: int, world: int, ckpt: str) -> dict:
    from dynpipe.runtime.checkpointer import save_checkpoint

    eng = _engine(world, "adamw")
    for s in range(SAVE_AT):
        eng.step(s, make_batch(eng.model, s))
    save_checkpoint(
        ckpt,
        model_state=eng.model_state(),
        optim_state=eng.optim_state(),
        meta={"step": SAVE_AT, "plan": eng.plan.to_dict()},
        rank=rank,
    )
    return {}


def _resume(rank: int, world: int, ckpt: str) -> dict:
    from dynpipe.runtime.checkpoint import load_checkpoint

    # Another split than the one that saved: both versions load by layer name.
    eng = _engine(world, "adamw", sizes=[2, 6])
    state, meta = load_checkpoint(
        ckpt, model_state=eng.model_state(), held_params=set(eng.named_params), rank=rank
    )
    assert any(k.endswith("/" + NEWEST) for k in state)
    eng.load_optim_state(state)
    losses = [eng.step(s, make_batch(eng.model, s)).loss for s in range(meta["step"], STEPS)]
    return {"model": eng.model_state(), "optim": eng.optim_state(), "losses": losses,
            "last": eng.is_last}  # fmt: skip


@pytest.mark.slow
def test_2bw_checkpoint_resumes_both_versions_exactly(tmp_path) -> None:
    torch.set_num_threads(1)
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_write, 2, ckpt)
    results = [r["value"] for r in run_ranks(_resume, 2, ckpt)]
    ref, want_losses = _reference("adamw")
    model, optim = _merged(results)
    want_m, want_o = ref.state()
    _assert_same(model, want_m, "stashed weights after resume")
    _assert_same(optim, want_o, "optimizer state and newest weights after resume")
    last = next(r for r in results if r["last"])
    assert last["losses"] == want_losses[SAVE_AT:]


def test_weight_versions_swap_without_copying_the_stash() -> None:
    """One step of ``WeightVersions`` on a parameter: the update lands on the newest, the
    parameter holds the old newest after it; state round-trips through its keys."""
    from dynpipe.runtime.twobw import WeightVersions, split_newest

    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    v = WeightVersions({"a.w": p}, {"a.w": torch.tensor([5.0, 6.0])})

    def minus_one() -> None:
        with torch.no_grad():
            p.sub_(1.0)

    v.update(minus_one)
    assert p.tolist() == [5.0, 6.0] and v.newest["a.w"].tolist() == [4.0, 5.0]
    with v.newest_in():
        assert p.tolist() == [4.0, 5.0]
    assert p.tolist() == [5.0, 6.0]
    optim, newest = split_newest({"a.w/exp_avg": torch.zeros(2), **v.state()})
    assert list(optim) == ["a.w/exp_avg"] and newest["a.w"].tolist() == [4.0, 5.0]
    with pytest.raises(KeyError, match="does not hold"):
        WeightVersions({"a.w": p}, {"b.w": torch.zeros(2)})
