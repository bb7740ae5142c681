"""--schedule 2bw (PipeDream-2BW's double-buffered weights) equals its single-process rule.

The reference below is one unsplit model trained with the delayed update written out: two
copies of the weights, every microbatch of step t computed on the older copy W(t-1), the
step's accumulated gradients applied by the optimizer to the newer copy W(t). Real gloo
pipelines (2 and 3 ranks) must equal it bit for bit: losses, both weight versions and the
optimizer state, also across a forced repartition mid-run and a checkpoint save + resume
under another split. Bad combinations are refused before any process group exists.
"""

from __future__ import annotations

import json

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

    def __init__(self, opt: str, *, batch=make_batch, size=BATCH, **grouping) -> None:
        from dynpipe.models import get_model
        from dynpipe.runtime.reference import ReferenceTrainer

        self.batch = batch
        self.ref = ReferenceTrainer(
            model=get_model("mlp", **MODEL),
            batch_size=size,
            microbatches=grouping.pop("microbatches", MICROBATCHES),
            optim=optim_config(opt),
            **grouping,
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
        return self.ref.step(s, self.batch(self.ref.model, s))

    def state(self) -> tuple[dict, dict]:
        optim = dict(self.ref.optim_state())
        optim.update({f"{n}/{NEWEST}": t for n, t in self.newest.items()})
        return self.ref.model_state(), optim


def _engine(
    world: int,
    opt: str,
    sizes: list[int] | None = None,
    schedule: str = "2bw",
    **extra,
):
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.topology import Topology

    model = get_model("mlp", **MODEL)
    kw = {"schedule": schedule, "microbatches": MICROBATCHES}
    plan = Plan.from_bounds(model, sizes, **kw) if sizes else Plan.even(model, world, **kw)
    return PipelineEngine(
        model,
        plan,
        topo=Topology.from_env(device="cpu"),
        config=EngineConfig(batch_size=BATCH, optim=optim_config(opt), **extra),
    )


def _run(rank: int, world: int, opt: str, move_at: int | None, extra: dict) -> dict:
    from dynpipe.planner import Plan
    from dynpipe.runtime.migrate import repartition

    eng = _engine(world, opt, **extra)
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
    ("world", "opt", "move_at", "extra"),
    [
        (2, "adamw", None, {}),
        (3, "sgd", None, {}),
        (2, "adamw", 2, {}),
        # Compiled and recomputed layers read the swapped weight storage as eager ones do.
        (2, "adamw", None, {"compile": "aot_eager"}),
        (2, "sgd", 2, {"recompute": "all"}),
    ],
)
def test_2bw_equals_the_delayed_update_rule(
    world: int, opt: str, move_at: int | None, extra: dict
) -> None:
    torch.set_num_threads(1)
    results = [r["value"] for r in run_ranks(_run, world, opt, move_at, extra)]
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
    from dynpipe.errors import UserError
    from dynpipe.runtime.checkpoint import load_checkpoint

    # Another split than the one that saved: both versions load by layer name.
    eng = _engine(world, "adamw", sizes=[2, 6])
    state, meta = load_checkpoint(
        ckpt, model_state=eng.model_state(), held_params=set(eng.named_params), rank=rank
    )
    assert any(k.endswith("/" + NEWEST) for k in state)
    eng.load_optim_state(state)
    losses = [eng.step(s, make_batch(eng.model, s)).loss for s in range(meta["step"], STEPS)]
    # The synchronous schedule refuses the second version rather than dropping it.
    other = _engine(world, "adamw", schedule="1f1b")
    try:
        other.load_optim_state(state)
        refused = ""
    except UserError as exc:
        refused = str(exc)
    return {"model": eng.model_state(), "optim": eng.optim_state(), "losses": losses,
            "last": eng.is_last, "refused": refused}  # fmt: skip


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
    assert all("resume it with --schedule 2bw" in r["refused"] for r in results)


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


TRAIN = ["train", "--nproc", "2", "--model-arg", "depth=4", "--model-arg", "width=16"]
TRAIN += ["--schedule", "2bw", "--no-progress", "--batch-size", "8"]


def _losses(log) -> dict[int, float]:
    from dynpipe.runtime.records import read_log

    return {r.step: r.loss for r in read_log(str(log)).steps}


@pytest.mark.slow
def test_2bw_run_is_labelled_and_resumes_through_the_command_line(tmp_path) -> None:
    """The run log says the run changes training; a run resumed from its step-2 checkpoint
    logs the uninterrupted run's losses (step 3 runs on the newest version saved)."""
    from dynpipe.cli import main
    from dynpipe.runtime.records import read_log

    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    ck = tmp_path / "ck"
    assert main([*TRAIN, "--steps", "5", "--log", str(whole)]) == 0
    log = read_log(str(whole))
    assert log.headers[0].config["schedule"] == "2bw"
    (ev,) = log.events("weight_versions")
    assert ev.fields["changes_training"] is True and ev.fields["flush"] is True
    argv = [*TRAIN, "--steps", "2", "--save-every", "2", "--save-dir", str(ck)]
    assert main([*argv, "--log", str(tmp_path / "first.jsonl")]) == 0
    (saved,) = sorted(ck.glob("ckpt-00000002-*"))
    assert main([*TRAIN, "--steps", "5", "--resume", str(saved), "--log", str(part)]) == 0
    want, got = _losses(whole), _losses(part)
    assert sorted(got) == [2, 3, 4]
    assert all(got[s] == want[s] for s in got), (got, want)
    # The same checkpoint under the synchronous schedule is refused in one line.
    sync = [a if a != "2bw" else "1f1b" for a in TRAIN]
    rc = main([*sync, "--steps", "5", "--resume", str(saved), "--log", str(tmp_path / "x.log")])
    # (The message comes from the workers: test_2bw_checkpoint_resumes_both_versions_exactly
    # reads it.)
    assert rc == 2


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--fp16"], "does not run with --fp16"),
        (["--chunks", "2"], "runs one stage per rank"),
        (["--freeze"], "does not run with --freeze"),
        (["--adapt", "adaptive", "--reshape"], "drop --reshape"),
        (["--microbatches", "1"], "2BW needs at least as many microbatches as stages"),
    ],
)
def test_2bw_refuses_what_it_cannot_combine_with(capsys, args: list[str], needle: str) -> None:
    from dynpipe.cli import main

    rc = main([*TRAIN, "--steps", "1", *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "Traceback" not in "\n".join(lines)
    assert needle in lines[-1] and lines[-1].count("\n") == 0, lines


def test_simulator_prices_2bw_as_run_and_without_the_flush() -> None:
    """2bw runs 1F1B's flushed order (same simulated step); the no-flush steady state is
    the slowest stage's forwards and backwards plus its update, never above the flushed
    step, and a slow link bounds it instead."""
    from dynpipe.planner.costs import CostModel
    from dynpipe.planner.multisim import schedule_step_ms, steady_2bw_ms
    from dynpipe.planner.simulate import simulate

    fwd, bwd, m = [1.0, 2.0, 1.5], [2.0, 4.0, 3.0], 6
    flushed = simulate(fwd, bwd, schedule="2bw", microbatches=m).step_ms
    assert flushed == simulate(fwd, bwd, schedule="1f1b", microbatches=m).step_ms
    steady = steady_2bw_ms(fwd, bwd, microbatches=m)
    assert steady == max(m * (f + b) for f, b in zip(fwd, bwd, strict=True)) < flushed
    upd = [0.0, 0.5, 0.0]
    assert steady_2bw_ms(fwd, bwd, microbatches=m, update_ms=upd) == steady + 0.5
    slow_link = 2 * steady / m
    assert steady_2bw_ms(fwd, bwd, microbatches=m, comm_ms=[0.0, slow_link]) == m * slow_link
    from dynpipe.models import get_model

    model = get_model("mlp", **MODEL)
    costs = CostModel.from_model(model, microbatch_size=BATCH // MICROBATCHES).for_devices(2)
    bounds = [(0, 4), (4, len(model))]
    kw = {"microbatches": MICROBATCHES}
    assert schedule_step_ms(costs, bounds, schedule="2bw", **kw) == schedule_step_ms(
        costs, bounds, schedule="1f1b", **kw
    )


def test_plan_prints_2bw_beside_the_other_schedules(capsys) -> None:
    from dynpipe.cli import main

    assert main(["plan", "--model", "mlp", "--stages", "2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if line.startswith("2bw ")]
    assert "changes training" in row and "no-flush steady state" in row
    assert main(["plan", "--model", "mlp", "--stages", "2", "--schedule", "2bw", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["schedule"] == "2bw"
    (meta,) = [r for r in plan["meta"]["schedules"] if r["schedule"] == "2bw"]
    assert 0 < meta["no_flush_ms"] <= meta["step_ms"]


@pytest.mark.slow
def test_2bw_export_takes_the_newest_version(tmp_path) -> None:
    """``dynpipe export``'s trained state of a 2bw checkpoint is its newest version, not
    the stash the checkpoint's parameters hold."""
    pytest.importorskip("transformers")
    from hfutil import SEQ, save_tiny

    from dynpipe.cli import main
    from dynpipe.models.export import trained_model
    from dynpipe.runtime.checkpoint import find_checkpoint, load_checkpoint

    folder = save_tiny("gpt2", tmp_path)
    ck = tmp_path / "ck"
    argv = ["train", "--nproc", "2", "--model", f"hf:{folder}", "--model-arg", f"seq_len={SEQ}",
            "--data", "synthetic", "--schedule", "2bw", "--batch-size", "8", "--steps", "2",
            "--save-every", "2", "--save-dir", str(ck), "--no-progress",
            "--log", str(tmp_path / "log.jsonl")]  # fmt: skip
    assert main(argv) == 0
    _, state, _ = trained_model(ck)
    path = find_checkpoint(ck)
    stash = {k: torch.empty_like(v) for k, v in state.items()}
    optim, _ = load_checkpoint(path, model_state=stash, held_params=set(stash), rank=0)
    newest = {k.rpartition("/")[0]: v for k, v in optim.items() if k.endswith("/" + NEWEST)}
    assert newest and all(torch.equal(state[k], v) for k, v in newest.items())
    assert any(not torch.equal(stash[k], v) for k, v in newest.items())


def _replicated(rank: int, world: int) -> dict:
    import dataclasses

    from test_runtime_dp import BATCH as DP_BATCH
    from test_runtime_dp import make_batch as dp_batch

    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.mesh import init_mesh
    from dynpipe.runtime.topology import Topology

    model = get_model("mlp", **MODEL)
    plan = Plan.from_bounds(model, [2, len(model) - 2], schedule="2bw", microbatches=4)
    plan = dataclasses.replace(plan, dp=2)
    topo = Topology.from_env(device="cpu")
    eng = PipelineEngine(
        model,
        plan,
        topo=topo,
        mesh=init_mesh(topo, dp=2),
        config=EngineConfig(batch_size=DP_BATCH, optim=optim_config("adamw")),
    )
    losses = [eng.step(s, dp_batch(model, s)).loss for s in range(STEPS)]
    return {"replica": eng.mesh.replica, "model": eng.model_state(), "optim": eng.optim_state(),
            "losses": losses}  # fmt: skip


@pytest.mark.slow
def test_2bw_with_replicas_equals_the_delayed_rule() -> None:
    """2 replicas x 2 stages: DDP sums each stage's gradients across replicas; both
    versions of every replica equal the rule's reference in the replicas' grouping."""
    from test_runtime_dp import BATCH as DP_BATCH
    from test_runtime_dp import make_batch as dp_batch

    torch.set_num_threads(1)
    results = [r["value"] for r in run_ranks(_replicated, 4)]
    ref = DelayedReference("adamw", batch=dp_batch, size=DP_BATCH, microbatches=8, groups=(4, 4))
    want_losses = [ref.step(s) for s in range(STEPS)]
    want_m, want_o = ref.state()
    for replica in (0, 1):
        model, optim = _merged([r for r in results if r["replica"] == replica])
        _assert_same(model, want_m, f"replica {replica} stashed weights")
        _assert_same(optim, want_o, f"replica {replica} optimizer state and newest weights")
    assert all(r["losses"] == want_losses for r in results)


def test_memory_model_counts_the_second_weight_version() -> None:
    """A 2bw stage's predicted peak is 1F1B's plus one copy of its parameters (what
    --recompute auto and the planner's memory limits price)."""
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.memory import estimate_peak

    model = get_model("mlp", **MODEL)
    kw = {"mode": "none", "microbatches": MICROBATCHES, "batch_size": BATCH}
    kw.update(optimizer="adamw", half=False, device=torch.device("cpu"), measure=False)
    plans = {s: Plan.even(model, 2, schedule=s, microbatches=MICROBATCHES) for s in ("1f1b", "2bw")}
    for stage, st in enumerate(plans["2bw"].stages):
        layers = model.build_range(st.start, st.stop, device="meta").values()
        held = sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())
        one = estimate_peak(model, plans["1f1b"], stage, **kw)
        two = estimate_peak(model, plans["2bw"], stage, **kw)
        assert held > 0 and two - one == held
