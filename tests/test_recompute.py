"""Activation recomputation: the planner's choice (pure logic) and exact training (gloo).

A recomputed layer keeps only its input and runs its forward again in the backward, under
the RNG state of its first forward: training must stay bit-identical to keeping every
activation, with dropout, and across a live repartition that changes which layers recompute.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from distutil import run_ranks
from test_runtime_equivalence import BATCH, make_batch, optim_config

GPT = {"depth": 2, "width": 32, "heads": 2, "seq_len": 128, "vocab": 32, "dropout": 0.1}


def _costs(fwd, act, out, *, static=0.0, recompute="auto"):
    from dynpipe.planner.costs import CostModel

    n = len(fwd)
    return CostModel(
        model="toy",
        layer_names=tuple(f"l{i}" for i in range(n)),
        fwd_ms=np.array([fwd], float),
        bwd_ms=np.array([fwd], float) * 2,
        param_bytes=np.full(n, static / 4),  # static = param * (2 + opt_mult 2)
        out_bytes=np.array(out, float),
        act_bytes=np.array(act, float),
        opt_mult=np.full(n, 2.0),
        buffer_bytes=np.zeros(n),
        bandwidth=np.zeros(0) + 1e9,
        latency_ms=np.zeros(0),
        recompute=recompute,
    )


# ---- pure logic -------------------------------------------------------------------------
def test_auto_recomputes_nothing_when_the_stage_fits() -> None:
    from dynpipe.planner.recompute import choose_recompute

    cm = _costs([1, 1, 1], [100, 100, 100], [10, 10, 10])
    r = choose_recompute(cm, device=0, start=0, stop=3, in_flight=2, limit=600)
    assert r.layers == () and r.extra_ms == 0 and r.fits and r.peak_bytes == 600
    over = choose_recompute(cm, device=0, start=0, stop=3, in_flight=2, limit=599)
    assert over.layers and over.fits


def test_auto_picks_the_cheapest_layers_per_byte_saved() -> None:
    from dynpipe.planner.recompute import choose_recompute

    # Layer 2 is cheapest to recompute, layer 1 saves as much for twice the time, layer 3
    # saves twice as much for three times layer 2's time.
    cm = _costs([5, 2, 1, 3], [100, 100, 100, 200], [10, 10, 10, 10])
    full = choose_recompute(cm, device=0, start=0, stop=4, in_flight=3, limit=np.inf).peak_bytes
    one = choose_recompute(cm, device=0, start=0, stop=4, in_flight=3, limit=full - 100)
    assert one.layers == (2,) and one.extra_ms == 1 and one.fits
    # Needing more than layer 2 saves: layer 1 next (2 ms per 90 bytes beats 3 per 190? no:
    # 3/190 < 2/90), so layer 3 joins, and layer 2 stays only if still needed.
    two = choose_recompute(cm, device=0, start=0, stop=4, in_flight=3, limit=full - 500)
    assert two.fits and 3 in two.layers
    assert two.peak_bytes <= full - 500
    # Nothing chosen is superfluous: dropping any chosen layer breaks the limit.
    for j in two.layers:
        rest = tuple(x for x in two.layers if x != j)
        assert _peak(cm, rest, 0, 4, 3) > full - 500


def _peak(cm, layers, a, b, k) -> float:
    from dynpipe.planner.recompute import kept_bytes

    act, kept = cm.act_bytes[a:b], kept_bytes(cm)[a:b]
    mask = np.array([i in layers for i in range(a, b)])
    held = np.where(mask, kept, act)
    # The last microbatch's forward end, or a recomputed layer's re-forward in its backward
    # (the layers after it freed, the ones before it still holding what they keep).
    rebuild = [held[: j - a].sum() + act[j - a] for j in layers if a <= j < b]
    return float(cm.static_bytes[a:b].sum() + (k - 1) * held.sum() + max([held.sum(), *rebuild]))


def test_all_and_none_and_what_cannot_fit() -> None:
    from dynpipe.planner.recompute import choose_recompute

    cm = _costs([1, 1, 1], [100, 100, 100], [10, 10, 10])
    every = choose_recompute(cm, device=0, start=0, stop=3, in_flight=2, mode="all")
    assert every.layers == (0, 1, 2) and every.extra_ms == 3
    assert every.peak_bytes == _peak(cm, (0, 1, 2), 0, 3, 2)
    none = choose_recompute(cm, device=0, start=0, stop=3, in_flight=2, mode="none", limit=1)
    assert none.layers == () and not none.fits
    hopeless = choose_recompute(cm, device=0, start=0, stop=3, in_flight=2, limit=10)
    assert not hopeless.fits


def test_planner_recomputes_only_under_memory_pressure_and_prices_it() -> None:
    from dynpipe.planner.dp import plan_partition
    from dynpipe.planner.plan import PlanError

    cm = _costs([1] * 8, [1000] * 8, [50] * 8, static=400)
    free = plan_partition(cm, num_stages=2, microbatches=4, memory_bytes=1e9)
    assert free.recompute == ((), ())
    plain = dataclasses.replace(cm, recompute="none")
    base = plan_partition(plain, num_stages=2, microbatches=4)
    # Stage 0 of an even split holds 2 microbatches of 4 layers: 8000 + static 1600.
    tight = 7000.0
    with pytest.raises(PlanError):
        plan_partition(plain, num_stages=2, microbatches=4, memory_bytes=tight)
    res = plan_partition(cm, num_stages=2, microbatches=4, memory_bytes=tight)
    assert any(res.recompute)
    assert res.step_ms > base.step_ms  # the re-forwards are paid for
    from dynpipe.planner.evaluate import stage_costs

    sc = stage_costs(cm, res.bounds, microbatches=4, memory_bytes=tight)
    assert sc.recompute == res.recompute and max(sc.mem_bytes) <= tight
    # A limit no recomputation can meet: one line with needed/available per stage.
    with pytest.raises(PlanError, match=r"needed/available GiB stage 0 .*lower --batch-size"):
        plan_partition(cm, num_stages=2, microbatches=4, memory_bytes=2500.0)


@pytest.mark.parametrize("stages", [2, 3])
def test_planner_with_recompute_is_the_brute_force_optimum(stages: int) -> None:
    """Every split of 8 uneven layers, each stage with its own recomputation and peak,
    simulated: the DP's choice has the least step time among those that fit."""
    import itertools

    from dynpipe.planner.dp import plan_partition
    from dynpipe.planner.evaluate import stage_costs
    from dynpipe.planner.simulate import simulate

    rng = np.random.default_rng(stages)
    cm = _costs(
        rng.uniform(0.5, 2.0, 8).tolist(),
        rng.uniform(500, 1500, 8).tolist(),
        rng.uniform(20, 80, 8).tolist(),
        static=300,
    )
    limit = 4200.0
    best = np.inf
    for cuts in itertools.combinations(range(1, 8), stages - 1):
        bounds = list(itertools.pairwise((0, *cuts, 8)))
        sc = stage_costs(cm, bounds, microbatches=4, memory_bytes=limit)
        if max(sc.mem_bytes) > limit:
            continue
        sim = simulate(sc.fwd_ms, sc.bwd_ms, comm_ms=sc.comm_ms, microbatches=4)
        best = min(best, sim.step_ms)
    assert np.isfinite(best)
    res = plan_partition(cm, num_stages=stages, microbatches=4, memory_bytes=limit)
    assert res.step_ms == pytest.approx(best, rel=1e-9)
    assert any(res.recompute), "the limit was meant to need recomputation"


def test_plan_carries_recompute_through_json_and_validates_it() -> None:
    from dynpipe.models import get_model
    from dynpipe.planner.costs import CostModel
    from dynpipe.planner.make import make_plan
    from dynpipe.planner.plan import Plan, PlanError

    model = get_model("gpt", **GPT)
    cm = dataclasses.replace(CostModel.from_model(model, microbatch_size=2), recompute="auto")
    loose = make_plan(cm, num_stages=2, microbatches=4)
    assert all(not st.recompute for st in loose.stages)
    limit = 0.9 * max(loose.meta["peak_bytes"])
    plan = make_plan(cm, num_stages=2, microbatches=4, memory_bytes=limit)
    assert any(st.recompute for st in plan.stages)
    assert max(plan.meta["peak_bytes"]) <= limit
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.stages[0].recompute == plan.stages[0].recompute
    again.validate(model, 2)
    d = plan.to_dict()
    d["stages"][0]["recompute"] = ["head"]  # not stage 0's layer
    with pytest.raises(PlanError, match="not its layers"):
        Plan.from_dict(d)
    # Plans without recomputation write no such key (older readers and files agree).
    assert "recompute" not in loose.to_dict()["stages"][0]


# ---- gloo: recomputed pipelines train exactly as eager ones ------------------------------
STEPS = 4


def _run(rank: int, world: int) -> dict:
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.memory import memory_costs, stage_recompute
    from dynpipe.runtime.migrate import repartition
    from dynpipe.runtime.topology import Topology

    torch.set_num_threads(1)
    topo = Topology.from_env(device="cpu")
    model = get_model("gpt", **GPT)  # embed, block00, block01, head
    first = Plan.from_bounds(model, [2, 2], microbatches=4)
    later = Plan.from_bounds(model, [3, 1], microbatches=4)
    listed = dataclasses.replace(
        first,
        stages=(
            dataclasses.replace(first.stages[0], recompute=("block00",)),
            dataclasses.replace(first.stages[1], recompute=("block01", "head")),
        ),
    )
    # A limit that fits stage 0 of the first plan without recomputation and not the later
    # plan's (which gives it one more block): auto must start recomputing there. (Stage 0
    # holds two microbatches in flight; the last stage holds one, where recomputing one
    # layer saves nothing: its activations are rebuilt for that one microbatch.)
    costs = memory_costs(
        model, microbatch_size=BATCH // 4, optimizer="adamw", half=False, recompute="auto"
    )
    keep = [stage_recompute(costs, p, 0, limit=None, microbatches=4) for p in (first, later)]
    every = dataclasses.replace(
        later,
        stages=(
            dataclasses.replace(later.stages[0], recompute=("block00", "block01")),
            later.stages[1],
        ),
    )
    least = stage_recompute(costs, every, 0, limit=None, microbatches=4).peak_bytes
    limit = max(keep[0].peak_bytes, least)
    assert limit < keep[1].peak_bytes, (limit, keep)
    out = {}
    for name, plan, mode, mem in (
        ("eager", first, "none", None),
        ("all", first, "all", None),
        ("listed", listed, None, None),
        ("auto", first, "auto", limit),
    ):
        torch.manual_seed(1234 + rank)  # dropout draws from each rank's own generator
        eng = PipelineEngine(
            model,
            plan,
            topo=topo,
            config=EngineConfig(
                batch_size=BATCH, optim=optim_config("adamw"), recompute=mode, memory_bytes=mem
            ),
        )
        seen, losses = [eng.recomputed], []
        for s in range(STEPS):
            if s == 2:
                repartition(eng, later)
                seen.append(eng.recomputed)
            losses.append(eng.step(s, make_batch(model, s)).loss)
        out[name] = (eng.model_state(), eng.optim_state(), losses, seen)
    return out


@pytest.mark.slow
def test_recomputed_pipelines_are_bit_identical_to_eager() -> None:
    results = [r["value"] for r in run_ranks(_run, 2)]
    for rank, got in enumerate(results):
        want_m, want_o, want_l, _ = got["eager"]
        for name in ("all", "listed", "auto"):
            m, o, losses, _ = got[name]
            assert losses == want_l, (rank, name)
            for k, v in want_m.items():
                assert torch.equal(m[k], v), (rank, name, k)
            for k, v in want_o.items():
                assert torch.equal(o[k], v), (rank, name, k)
    assert results[0]["all"][3] == [("embed", "block00"), ("embed", "block00", "block01")]
    assert results[1]["all"][3] == [("block01", "head"), ("head",)]
    assert results[0]["listed"][3][0] == ("block00",)
    assert results[1]["listed"][3][0] == ("block01", "head")
    # auto: stage 0 fits without recomputing, then recomputes once it holds three layers.
    before, after = results[0]["auto"][3]
    assert before == () and after, (before, after)
    assert results[0]["eager"][3] == [(), ()]


# ---- bench/recompute_memory.py on CPU: its fields, not its numbers -----------------------
@pytest.mark.slow
def test_recompute_memory_bench_writes_every_field(tmp_path) -> None:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "r.json"
    flags = "--width 32 --depth 2 --heads 2 --seq 16 --fits-width 32 --fits-depth 2"
    flags += " --fits-batch 4 --memory-gb 0.001 --steps 1 --in-process --device cpu"
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(root / "bench" / "recompute_memory.py"), *flags.split()]
    got = subprocess.run(
        [*cmd, "-o", str(out)], env=env, capture_output=True, text=True, timeout=240
    )
    assert got.returncode == 0, got.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert [c["case"] for c in rep["cases"]] == ["none", "auto", "fits"]
    for c in rep["cases"]:
        for key in ("batch", "recomputed", "predicted_peak_gib", "measured_peak_gib", "step_ms"):
            assert key in c, (c["case"], key)
        assert c["oom"] is None and c["step_ms"] > 0
    auto = rep["cases"][1]
    # A 1 MiB stage cannot hold these activations: auto recomputes blocks until it fits.
    assert auto["recomputed"] and set(auto["recomputed"]) <= {"block00", "block01"}
    assert auto["predicted_peak_gib"] is not None
    assert auto["predicted_peak_gib"] <= auto["limit_gib"] < rep["cases"][0]["predicted_peak_gib"]


# ---- the training loop: a live move makes the receiving stage recompute -------------------
class _MoveOnce:
    """A policy that moves to ``bounds`` after the first window and keeps what it saw."""

    mode_used = "measured"

    def __init__(self, bounds) -> None:
        self.bounds = bounds
        self.seen: list = []

    def observe(self, window):
        from distutil import forced_decision

        self.seen.append(None if window.memory_bytes is None else window.memory_bytes.tolist())
        if len(self.seen) > 1:
            return None
        return forced_decision(window.step, self.bounds, ranks=2)

    def applied(self, *, step: int, pause_ms: float, moved_bytes: int) -> None:
        pass

    def describe(self) -> str:
        return "forced"

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass


def _live(rank: int, world: int, tmp: str, recompute: str | None, memory_gb: float | None):
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    torch.set_num_threads(1)
    cfg = TrainConfig(
        model="gpt",
        model_args=GPT,
        batch_size=BATCH,
        microbatches=4,
        steps=6,
        progress=False,
        telemetry=False,
        log=f"{tmp}/log.jsonl",
        optim=optim_config("adamw"),
        adapt=AdaptConfig(mode="measured", monitor_every=2),
        recompute=recompute,
        memory_gb=memory_gb,
    )
    got: dict = {}

    def grab(eng, res) -> None:
        got.setdefault("recomputed", []).append(eng.recomputed)
        got["engine"] = eng

    policy = _MoveOnce(((0, 3), (3, 4)))
    out = train(cfg, topo=Topology.from_env(device="cpu"), on_step=grab, policy=policy)
    eng = got["engine"]
    return {
        "losses": out["losses"],
        "model": eng.model_state(),
        "recomputed": got["recomputed"],
        "seen": policy.seen,
        "limit": eng.config.memory_bytes,
    }


@pytest.mark.slow
def test_a_live_move_recomputes_where_layers_arrive_and_stays_exact(tmp_path) -> None:
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.memory import memory_costs, stage_recompute

    model = get_model("gpt", **GPT)
    costs = memory_costs(
        model, microbatch_size=BATCH // 4, optimizer="adamw", half=False, recompute="auto"
    )
    first, later = Plan.from_bounds(model, [2, 2]), Plan.from_bounds(model, [3, 1])
    keep = [
        stage_recompute(costs, p, 0, limit=None, microbatches=4).peak_bytes for p in (first, later)
    ]
    gb = (keep[0] + 0.25 * (keep[1] - keep[0])) / 1024**3
    plain = [r["value"] for r in run_ranks(_live, 2, str(tmp_path / "a"), None, None)]
    auto = [r["value"] for r in run_ranks(_live, 2, str(tmp_path / "b"), "auto", gb)]
    for p, a in zip(plain, auto, strict=True):
        assert a["losses"] == p["losses"]
        assert all(torch.equal(v, p["model"][k]) for k, v in a["model"].items())
    # Stage 0 fitted its two layers; given a third by the move, it recomputes.
    steps = auto[0]["recomputed"]
    assert steps[0] == () and steps[-1], steps
    # The policy's budget for each stage (the model's hold without recomputation plus the
    # reported free memory) is the stage's own limit.
    limit = auto[0]["limit"]
    window = auto[0]["seen"][0]
    for s in (0, 1):
        held = stage_recompute(costs, first, s, limit=None, microbatches=4)
        assert held.layers == () and abs(held.peak_bytes + window[s] - limit) < 1.0
