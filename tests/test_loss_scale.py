"""One loss scale for the whole pipeline: its schedule (pure logic), a skipped step on every
rank when one stage's gradient overflows (gloo, float32 with the scaler on), the scale in
checkpoints, and the bad-input lines of --fp16 and --recompute."""

from __future__ import annotations

import math

import pytest
import torch
from distutil import run_ranks
from test_runtime_equivalence import BATCH, make_batch, optim_config

GPT = {"depth": 2, "width": 32, "heads": 2, "seq_len": 8, "vocab": 32}


# ---- pure logic -------------------------------------------------------------------------
def test_scale_backs_off_grows_and_round_trips() -> None:
    from dynpipe.runtime.scaler import LossScaler, ScalerConfig

    s = LossScaler(ScalerConfig(init_scale=1024.0, growth_interval=3))
    assert s.update(True) and s.scale == 512.0 and s.growth_tracker == 0
    assert not s.update(False) and not s.update(False) and s.scale == 512.0
    assert not s.update(False) and s.scale == 1024.0 and s.growth_tracker == 0
    s.update(False)
    t = LossScaler(ScalerConfig(init_scale=1024.0, growth_interval=3))
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.growth_tracker, t.skipped) == (1024.0, 1, 1)
    grads = [torch.full((3,), 2048.0), torch.tensor([1.0, math.inf])]
    assert float(s.unscale_(grads)) == 1.0 and torch.equal(grads[0], torch.full((3,), 2.0))
    assert float(s.unscale_([torch.ones(2)])) == 0.0
    with pytest.raises(Exception, match="backoff_factor"):
        ScalerConfig(backoff_factor=1.5)


def test_bad_precision_and_memory_input_is_one_line() -> None:
    from dynpipe.errors import UserError
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.memory import check_run_memory

    with pytest.raises(UserError, match="--fp16 and --bf16"):
        TrainConfig(fp16=True, bf16=True)
    model = get_model("gpt", **GPT)
    plan = Plan.even(model, 2)
    cases = [
        (TrainConfig(model="gpt", fp16=True), "--fp16 needs a GPU"),
        (TrainConfig(model="gpt", recompute="auto"), "--memory-gb GB"),
        (
            TrainConfig(model="gpt", recompute="auto", memory_gb=1e-5, batch_size=8),
            r"needed/available GiB stage 0 [0-9.]+/1e-05, stage 1 .*lower --batch-size",
        ),
    ]
    for cfg, want in cases:
        with pytest.raises(UserError, match=want) as got:
            check_run_memory(cfg, model, plan, device="cpu")
        assert "\n" not in str(got.value)
    check_run_memory(
        TrainConfig(model="gpt", recompute="auto", memory_gb=8), model, plan, device="cpu"
    )


# ---- gloo: an overflow on one stage skips the step everywhere -----------------------------
STEPS = 6
POISON = 2  # the step whose stage-1 gradient is made infinite


def _scaled(rank: int, world: int, poison: bool, init_scale: float | None) -> dict:
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.scaler import ScalerConfig
    from dynpipe.runtime.topology import Topology

    torch.set_num_threads(1)
    model = get_model("gpt", **GPT)
    eng = PipelineEngine(
        model,
        Plan.even(model, world),
        topo=Topology.from_env(device="cpu"),
        config=EngineConfig(
            batch_size=BATCH,
            optim=optim_config("adamw"),
            loss_scale=None
            if init_scale is None
            else ScalerConfig(init_scale=init_scale, growth_interval=2),
        ),
    )

    def poison_stage_1(engine: PipelineEngine, step: int) -> None:
        if poison and step == POISON and engine.stage_index == 1:
            next(p for p in engine.named_params.values() if p.grad is not None).grad[0] = math.inf

    eng.grad_hook = poison_stage_1
    states, scales, skipped, losses = [], [], [], []
    for s in range(STEPS):
        states.append({k: v.clone() for k, v in eng.model_state().items()})
        res = eng.step(s, make_batch(model, s))
        scales.append(res.loss_scale)
        skipped.append(res.skipped)
        losses.append(res.loss)
    states.append(eng.model_state())
    return {
        "states": states,
        "scales": scales,
        "skipped": skipped,
        "losses": losses,
        "final_scale": None if eng.scaler is None else eng.scaler.scale,
        "optim": eng.optim_state(),
    }


@pytest.mark.slow
def test_an_overflow_on_one_stage_skips_the_step_on_every_stage() -> None:
    poisoned = [r["value"] for r in run_ranks(_scaled, 2, True, 2.0**10)]
    for rank, got in enumerate(poisoned):
        assert got["skipped"] == [s == POISON for s in range(STEPS)], rank
        before, after = got["states"][POISON], got["states"][POISON + 1]
        assert all(torch.equal(before[k], after[k]) for k in before), rank  # step skipped
        assert any(not torch.equal(got["states"][-2][k], got["states"][-1][k]) for k in before), (
            rank
        )  # and training goes on
        # Grows after every 2 clean steps, halves at the overflow; the same on every rank.
        assert got["scales"] == [1024.0, 1024.0, 2048.0, 1024.0, 1024.0, 2048.0], rank
        assert all(math.isfinite(x) for x in got["losses"])
    assert poisoned[0]["losses"] == poisoned[1]["losses"]


@pytest.mark.slow
def test_a_power_of_two_scale_trains_exactly_as_unscaled() -> None:
    """Scaling by 2**k and unscaling is exact in float32: the scaled pipeline's weights and
    losses are the unscaled one's, bit for bit (the scaler changes nothing but the range)."""
    scaled = [r["value"] for r in run_ranks(_scaled, 2, False, 2.0**12)]
    plain = [r["value"] for r in run_ranks(_scaled, 2, False, None)]
    for a, b in zip(scaled, plain, strict=True):
        assert a["losses"] == b["losses"] and not any(a["skipped"])
        assert a["scales"] == [4096.0, 4096.0, 8192.0, 8192.0, 16384.0, 16384.0]
        for s in range(STEPS + 1):
            assert all(torch.equal(v, b["states"][s][k]) for k, v in a["states"][s].items())
        assert all(torch.equal(v, b["optim"][k]) for k, v in a["optim"].items())


# ---- checkpoints carry the scale ---------------------------------------------------------
def _train(rank: int, world: int, cfg) -> dict:
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    got = {}

    def grab(eng, res) -> None:
        # Overflow on stage 1 at step 1 (the hook is in place from step 1 on).
        def poison(engine, step: int) -> None:
            if step == 1 and engine.stage_index == 1:
                next(p for p in engine.named_params.values() if p.grad is not None).grad[0] = (
                    math.nan
                )

        eng.grad_hook = poison
        got["engine"] = eng

    out = train(cfg, topo=Topology.from_env(device="cpu"), on_step=grab)
    eng = got["engine"]
    return {
        "losses": out["losses"],
        "scaler": eng.scaler.state_dict(),
        "model": eng.model_state(),
        "optim": eng.optim_state(),
    }


@pytest.mark.slow
def test_a_checkpoint_resumes_the_loss_scale_exactly(tmp_path) -> None:
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.optim import OptimConfig

    torch.set_num_threads(1)

    def cfg(name: str, **kw) -> TrainConfig:
        base = dict(
            model="gpt",
            model_args=GPT,
            batch_size=BATCH,
            microbatches=4,
            progress=False,
            telemetry=False,
            log=str(tmp_path / name / "log.jsonl"),
            log_every=3,
            # On CPU the engine runs the scale in float32 (autocast is CUDA's only).
            fp16=True,
            optim=OptimConfig(name="adamw", lr=3e-3, clip_grad=0.5, total_steps=6),
        )
        return TrainConfig(**{**base, **kw})

    ckpt = str(tmp_path / "ckpt")
    whole = [r["value"] for r in run_ranks(_train, 2, cfg("whole", steps=6))]
    run_ranks(_train, 2, cfg("a", steps=3, save_dir=ckpt))
    resumed = [r["value"] for r in run_ranks(_train, 2, cfg("b", steps=6, resume=ckpt))]
    # The overflow at step 1 halved the scale before the checkpoint; the resumed run has it.
    assert whole[0]["scaler"] == {"scale": 2.0**15, "growth_tracker": 4, "skipped": 1}
    for w, r in zip(whole, resumed, strict=True):
        assert r["scaler"] == w["scaler"]
        assert r["losses"] == w["losses"][3:]
        assert all(torch.equal(v, w["model"][k]) for k, v in r["model"].items())
        assert all(torch.equal(v, w["optim"][k]) for k, v in r["optim"].items())


def _mismatched(rank: int, world: int) -> str:
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.scaler import ScalerConfig
    from dynpipe.runtime.topology import Topology

    model = get_model("gpt", **GPT)
    eng = PipelineEngine(
        model,
        Plan.even(model, world),
        topo=Topology.from_env(device="cpu"),
        config=EngineConfig(batch_size=BATCH, loss_scale=ScalerConfig()),
    )
    eng.step(0, make_batch(model, 0))
    if rank == 1:
        eng.scaler.scale *= 2  # what a rank that missed an update would hold
    try:
        eng.step(1, make_batch(model, 1))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_ranks_with_different_loss_scales_stop_with_the_numbers() -> None:
    got = [r["value"] for r in run_ranks(_mismatched, 2)]
    assert all("loss scales differ across ranks at step 1" in g for g in got), got
