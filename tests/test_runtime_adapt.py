"""The controller reacts to an emulated 3x slowdown like the best static plan would, moves
back when it ends, and the restart baseline reaches its plan through a real relaunch."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

import pytest
import torch
from distutil import run_ranks

pytestmark = pytest.mark.slow

MODEL = {"depth": 8, "width": 384, "in_features": 384, "num_classes": 384}  # 10 equal layers
# Ten windows after the end: the policy takes the first window after a change as unconfirmed
# and a move back must gain beyond what the estimates' noise could make, which on a loaded
# 2-core machine took more than the seven windows a 95-step run leaves.
ONSET, DEPART, STEPS = 30, 60, 110


def _scenario(path, onset: int, depart: int, factor: float = 3.0) -> str:
    path.write_text(
        f'name = "test"\n[[events]]\nstep = {onset}\naction = "start"\nkind = "emulate"\n'
        f'factor = {factor}\nstage = 1\n[[events]]\nstep = {depart}\naction = "stop"\n'
        "stage = 1\n"
    )
    return str(path)


def _adapt_then_static(rank: int, world: int, scenario: str, log: str) -> dict:
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.optim import OptimConfig
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    # One thread per rank (two ranks share two cores), and a 15% minimum gain:
    # beside a busy loop on a 2-core machine a clean window's stage timers swing past 5%,
    # while the 3x slowdown this test is about promises far more.
    torch.set_num_threads(1)
    topo = Topology.from_env(device="cpu")
    cfg = TrainConfig(
        model="mlp",
        model_args=MODEL,
        steps=STEPS,
        batch_size=64,
        microbatches=4,
        progress=False,
        log=log,
        scenario=scenario,
        telemetry=False,
        adapt=AdaptConfig(mode="measured", monitor_every=5, min_gain=0.15),
    )
    train(cfg, topo=topo)

    # Every static 2-stage split under the same emulated slowdown, in the same processes,
    # measured in interleaved rounds so that machine noise hits every split alike.
    model = get_model("mlp", **MODEL)
    x, y = model.input_spec.example(64)
    engines = {}
    for k in range(1, len(model)):
        eng = PipelineEngine(
            model,
            Plan.from_bounds(model, [k, len(model) - k]),
            topo=topo,
            config=EngineConfig(batch_size=64, optim=OptimConfig()),
        )
        eng.timer.dilation = 3.0 if rank == 1 else 1.0
        eng.step(0, (x, y))
        engines[k] = eng
    import torch.distributed as dist

    from dynpipe.runtime.records import read_log

    def rounds(times: dict[int, list[float]], ks: list[int], n: int) -> None:
        for _ in range(n):
            for k in ks:
                times[k] += [engines[k].step(s, (x, y)).step_ms for s in range(4)]

    def medians(times: dict[int, list[float]]) -> dict[int, float]:
        # Decisions to retry must be the same on every rank: the slowest rank's medians.
        ks = sorted(times)
        meds = torch.tensor([statistics.median(times[k]) for k in ks], dtype=torch.float64)
        dist.all_reduce(meds, op=dist.ReduceOp.MAX)
        return dict(zip(ks, meds.tolist(), strict=True))

    def timed(ks: list[int], contender: int | None) -> dict[int, float]:
        times: dict[int, list[float]] = {k: [] for k in ks}
        rounds(times, ks, 3)
        med = medians(times)
        best = min(med, key=med.get)
        if contender is not None and med[contender] > 1.10 * med[best]:
            # A 2-core machine's noise can swing one round: time the two contenders again,
            # side by side, before judging.
            rounds(times, [contender, best], 4)
        return {k: statistics.median(v) for k, v in times.items()}

    # The split the adaptive run settled on during the slowdown, and the one it ended on (the
    # log is complete once every rank is past train()).
    dist.barrier()
    reps = read_log(log).events("repartition")
    during = [e for e in reps if ONSET <= e.step < DEPART]
    chosen = during[-1]["new_plan"]["stages"][0]["stop"] if during else None
    end = reps[-1]["new_plan"]["stages"][0]["stop"] if reps else None
    slowed = timed(list(engines), chosen)
    # And every split again with the slowdown gone: what the run should end near.
    for eng in engines.values():
        eng.timer.dilation = 1.0
    clean = timed(list(engines), end)
    return {"slowed": slowed, "clean": clean}


@pytest.mark.timing
def test_controller_adapts_to_emulated_slowdown_and_moves_back(tmp_path) -> None:
    from dynpipe.runtime.records import read_log

    log = tmp_path / "adaptive.jsonl"
    res = run_ranks(
        _adapt_then_static,
        2,
        _scenario(tmp_path / "s.toml", ONSET, DEPART),
        str(log),
        timeout_s=400,
    )
    # The last stage's step times (every rank waits for the step) of every static split, under
    # the slowdown and without it.
    static, clean = res[1]["value"]["slowed"], res[1]["value"]["clean"]
    best_split, best_ms = min(static.items(), key=lambda kv: kv[1])
    recs = read_log(log)
    events = recs.events()
    reps = recs.events("repartition")
    assert any(e["emulated"] for e in recs.events("interference_start"))
    assert reps, recs.events("decision")
    # Every window's decision records what deciding cost, moves or not.
    assert all(e["decide_ms"] >= 0 for e in recs.events("decision"))
    first = reps[0]
    # Within three windows of the onset, plus the step during which the policy reads one:
    # the onset's window raises the change and the next confirms it, but beside a busy loop
    # on a 2-core machine the confirming window can read within its noise once (the first
    # move came at step 46, one window later than the two that quiet runs take).
    assert ONSET < first.step <= ONSET + 16, first.step
    # It moved layers off the slowed stage 1.
    assert first["new_plan"]["stages"][1]["start"] > first["old_plan"]["stages"][1]["start"]
    # The plan it settled on during the slowdown runs within 10% of the best static plan for
    # this condition (all splits timed side by side under the same emulated slowdown).
    during = [e for e in reps if ONSET <= e.step < DEPART]
    chosen = during[-1]["new_plan"]["stages"][0]["stop"]
    assert static[chosen] <= 1.10 * best_ms, (chosen, best_split, static)
    # And the run itself recovered: steps after adapting are much faster than before it, by
    # 15%, or by what the static splits measured side by side say the chosen one gains over
    # the first, if less (beside a busy loop that takes a core, a stage that shares its core
    # runs slowed throughout, and the slowdown's own share of the step is smaller).
    start = first["old_plan"]["stages"][0]["stop"]
    expect = max(0.85, 1.10 * static[chosen] / static[start])
    steps = {r.step: r.step_ms for r in recs.steps}
    slowed = statistics.median(steps[s] for s in range(ONSET, first.step))
    adapted = statistics.median(steps[s] for s in range(first.step + 5, DEPART))
    assert adapted < expect * slowed, (adapted, slowed, expect)
    # After the slowdown ends it moves layers back to stage 1, where the split it adapted to
    # runs more than 10% slower than the best without the slowdown, the static splits timed
    # side by side (on an idle machine 9|1 runs far slower than 5|5; beside a busy loop that
    # takes one core the stages no longer run alike, and it can be as fast as any).
    decisions = [(e.step, e["reason"]) for e in events if e.event == "decision"]
    back = [e for e in reps if e.step > DEPART]
    if clean[chosen] > 1.10 * min(clean.values()):
        assert back, (decisions, clean)
        assert back[0]["new_plan"]["stages"][1]["start"] < back[0]["old_plan"]["stages"][1]["start"]


def _final_state(ckpt: str) -> tuple[dict, dict]:
    from dynpipe.models import get_model
    from dynpipe.runtime.checkpoint import load_checkpoint
    from dynpipe.runtime.optim import OptimConfig
    from dynpipe.runtime.reference import ReferenceTrainer

    ref = ReferenceTrainer(
        model=get_model("mlp", **MODEL),
        batch_size=64,
        microbatches=4,
        optim=OptimConfig(name="adamw", lr=1e-3),
    )
    optim, _ = load_checkpoint(
        ckpt, model_state=ref.model_state(), held_params=set(ref.named_params)
    )
    return {k: v.clone() for k, v in ref.model_state().items()}, optim


def _run(tmp_path, name: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "dynpipe",
        "train",
        "--nproc",
        "2",
        "--model",
        "mlp",
        *[a for k, v in MODEL.items() for a in ("--model-arg", f"{k}={v}")],
        "--steps",
        "60",
        "--batch-size",
        "64",
        "--optimizer",
        "adamw",
        "--lr",
        "1e-3",
        "--no-progress",
        "--no-telemetry",
        "--log",
        str(tmp_path / name / "log.jsonl"),
        "--save-dir",
        str(tmp_path / name / "ckpt"),
        "--save-every",
        "60",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)


def test_restart_baseline_relaunches_under_new_plan_bit_identically(tmp_path) -> None:
    from dynpipe.runtime.records import read_log

    # The onset at a window's first step (windows end at steps 11, 16, 21) and 5x: the
    # window that decides the restart sees it in every step. At step 20 and 3x, that
    # window held it in two steps of five, and beside a busy loop on a 2-core machine its
    # other steps read stage 0 slower: the restart moved a layer onto stage 1.
    scenario = _scenario(tmp_path / "s.toml", 17, 1000, factor=5.0)
    proc = _run(tmp_path, "restart", "--adapt", "restart", "--scenario", scenario)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = read_log(tmp_path / "restart" / "log.jsonl")
    headers = recs.headers
    restart = recs.events("restart")
    resumed = recs.events("resumed")
    assert restart and resumed, [e.event for e in recs.events()]
    assert [e.step for e in resumed] == [e.step for e in restart]
    assert all(e["pause_ms"] > 0 for e in resumed)
    # Each relaunch runs the plan the controller decided before exiting.
    assert len(headers) == len(restart) + 1, (len(headers), len(restart))
    for header, event in zip(headers[1:], restart, strict=True):
        assert header.plan["stages"] == event["new_plan"]["stages"]
    # The run ends with fewer layers on the slowed stage than it began with. Not asserted of
    # the first restart: on a loaded 2-core machine a window before the onset can read stage 0
    # slower, and the restart it decides moves a layer onto stage 1 (CI saw 5|5 -> 4|6 once).
    assert headers[-1].plan["stages"][1]["start"] > headers[0].plan["stages"][1]["start"]
    assert any(e.step > 17 for e in restart), [e.step for e in restart]
    steps = sorted(r.step for r in recs.steps)
    assert steps == list(range(60)), "every step ran exactly once across the relaunch"

    proc = _run(tmp_path, "static", "--adapt", "static")
    assert proc.returncode == 0, proc.stderr[-3000:]
    m1, o1 = _final_state(str(tmp_path / "restart" / "ckpt"))
    m2, o2 = _final_state(str(tmp_path / "static" / "ckpt"))
    assert set(m1) == set(m2) and set(o1) == set(o2)
    for k in m1:
        assert torch.equal(m1[k], m2[k]), k
    for k in o1:
        assert torch.equal(o1[k], o2[k]), k
    from dynpipe.runtime.checkpoint import list_checkpoints

    # Every restart and the final save went to a fresh folder; the newest is step 60.
    done, _ = list_checkpoints(tmp_path / "restart" / "ckpt")
    assert done[-1].step == 60 and len({c.save_id for c in done}) == len(done)


class _Misled:
    """A policy whose speed model is wrong once: it proposes piling 9 of 10 equal layers onto
    stage 0, whose device computes 6x slower all run long (emulated, so the move is slower
    whatever else the machine runs). Injected through ``train(policy=...)``; every other
    window is the real controller's."""

    def __init__(self, inner) -> None:
        self.inner, self.fired = inner, False
        self.mode_used = inner.mode_used

    def observe(self, window):
        d = self.inner.observe(window)
        if d is None or self.fired or window.bounds != ((0, 5), (5, 10)):
            return d
        self.fired = True
        import dataclasses

        from dynpipe.runtime.adapt.record import MoveRecord

        bad = ((0, 9), (9, 10))
        self.inner.pending = MoveRecord(
            step=window.step + 1,
            src=window.bounds,
            dst=bad,
            reason="misled",
            before_ms=window.median_step_ms,
            model_before_ms=d.current_ms,
            predicted_ms=d.current_ms / 2,
            slowdown=d.slowdown,
            regime=self.inner.est.regime,
        )
        return dataclasses.replace(d, repartition=True, bounds=bad, reason="misled")

    def applied(self, **kw) -> None:
        self.inner.applied(**kw)

    def describe(self) -> str:
        return "misled once, then the controller"

    def state(self) -> dict:
        return self.inner.state()

    def load_state(self, state: dict) -> None:
        self.inner.load_state(state)


def _misled(rank: int, world: int, log: str, scenario: str) -> list[float]:
    from dynpipe.models import get_model
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.adapt.make import make_policy
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    torch.set_num_threads(1)
    # Two settling windows: the move is judged against steps 10-14, past the start-up that a
    # loaded machine stretches unevenly (steps 5-9 once read stage 0 at 15x, the bad move
    # then "faster").
    adapt = AdaptConfig(mode="measured", monitor_every=5, settle_windows=2)
    cfg = TrainConfig(
        model="mlp",
        model_args=MODEL,
        scenario=scenario,
        steps=70,
        batch_size=64,
        microbatches=4,
        progress=False,
        log=log,
        telemetry=False,
        adapt=adapt,
    )
    inner = make_policy(adapt, model=get_model("mlp", **MODEL), microbatch_size=16, num_ranks=2)
    return train(cfg, topo=Topology.from_env(device="cpu"), policy=_Misled(inner))["losses"]


@pytest.mark.timing
def test_a_move_that_makes_steps_slower_is_undone(tmp_path) -> None:
    from dynpipe.runtime.records import read_log

    log = tmp_path / "misled.jsonl"
    scenario = tmp_path / "s.toml"
    scenario.write_text(
        'name = "slow0"\n[[events]]\nstep = 1\naction = "start"\nkind = "emulate"\n'
        "factor = 6.0\nstage = 0\n"
    )
    # The premise is the emulation's: 9 layers at 6x on stage 0 run slower than 5. Beside
    # other load, sleep-based emulation has once in 10-30 runs measured the bad split
    # faster (not explained), or slower by less than the windows' noise (a fresh-clone CI
    # run: judged "no better"); such a run tests nothing, so it is run again, at most twice.
    for _ in range(3):
        log.unlink(missing_ok=True)
        run_ranks(_misled, 2, str(log), str(scenario), timeout_s=300)
        recs = read_log(log)
        judged = recs.events("judged")
        if judged and judged[0]["verdict"] == "slower":
            break
    reps = recs.events("repartition")
    assert len(reps) >= 2, [(e.event, e.get("reason")) for e in recs.events()]
    assert [len(s["layers"]) for s in reps[0]["new_plan"]["stages"]] == [9, 1]
    assert judged and judged[0]["verdict"] == "slower", judged
    assert judged[0]["after_ms"] > judged[0]["before_ms"]
    # Undone: after the step during which the judging window was read, or (a loaded
    # machine's windows) the next window's.
    back = reps[1]
    assert judged[0].step + 2 <= back.step <= judged[0].step + 2 + 5, (back.step, judged)
    decisions = [e for e in recs.events("decision") if e.step == back.step]
    if back["new_plan"]["stages"] == reps[0]["old_plan"]["stages"]:
        # Back to the plan it left, on a measurement, not the model: "measured ... under
        # these conditions", or, where the move's readings looked like a change of
        # conditions, "devices read as they ran before: measured ... then".
        assert decisions and "measured" in decisions[0]["reason"], decisions
    else:
        # Or further off the slowed stage than the plan it left (1 | 9, which runs faster
        # than 5 | 5 with stage 0 at 6x): a fresh-clone CI run's timing step made that
        # move twice in a row, and this test alone about one run in ten, at this code and
        # before it.
        kept = [len(s["layers"]) for s in back["new_plan"]["stages"]]
        left = [len(s["layers"]) for s in reps[0]["old_plan"]["stages"]]
        assert kept[0] < left[0], (kept, left, decisions)
