"""TensorBoard output: live from a training run, and converted from its JSONL log.

A 2-stage gloo run with a forced repartition writes event files through ``--tensorboard``;
TensorBoard's own reader reads them back, and converting the run's log gives the same
scalars at the same steps.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distutil import run_ranks

MODEL = {"depth": 2, "width": 32, "in_features": 32, "num_classes": 8}  # 4 layers
STEPS = 20


class _ForcedMove:
    """The real controller, except that its first decision moves a layer (2|2 -> 3|1)."""

    def __init__(self, inner) -> None:
        self.inner, self.fired = inner, False
        self.mode_used = inner.mode_used

    def observe(self, window):
        d = self.inner.observe(window)
        if d is None or self.fired or window.bounds != ((0, 2), (2, 4)):
            return d
        self.fired = True
        from dynpipe.runtime.adapt.record import MoveRecord

        dst = ((0, 3), (3, 4))
        self.inner.pending = MoveRecord(
            step=window.step + 1,
            src=window.bounds,
            dst=dst,
            reason="forced",
            before_ms=window.median_step_ms,
            model_before_ms=d.current_ms,
            predicted_ms=d.current_ms / 2,
            slowdown=d.slowdown,
            regime=self.inner.est.regime,
        )
        return dataclasses.replace(d, repartition=True, bounds=dst, reason="forced")

    def applied(self, **kw) -> None:
        self.inner.applied(**kw)

    def describe(self) -> str:
        return "one forced move, then the controller"

    def state(self) -> dict:
        return self.inner.state()

    def load_state(self, state: dict) -> None:
        self.inner.load_state(state)


def _train(rank: int, world: int, log: str, tb: str) -> None:
    from dynpipe.models import get_model
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.adapt.make import make_policy
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    torch.set_num_threads(1)
    adapt = AdaptConfig(mode="measured", monitor_every=5, settle_windows=0)
    cfg = TrainConfig(
        model="mlp",
        model_args=MODEL,
        steps=STEPS,
        batch_size=16,
        microbatches=2,
        eval_every=10,
        eval_batches=1,
        progress=False,
        log=log,
        tensorboard=tb,
        adapt=adapt,
    )
    inner = make_policy(adapt, model=get_model("mlp", **MODEL), microbatch_size=8, num_ranks=2)
    train(cfg, topo=Topology.from_env(device="cpu"), policy=_ForcedMove(inner))


def _read(logdir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {
        tag: [(e.step, round(e.value, 4)) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }
    texts = {
        tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
        for tag in acc.Tags()["tensors"]
    }
    return scalars, texts


@pytest.mark.slow
def test_live_tensorboard_matches_the_log_and_its_conversion(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    from dynpipe.runtime.records import read_log

    log, live = tmp_path / "run.jsonl", tmp_path / "tb-live"
    res = run_ranks(_train, 2, str(log), str(live), timeout_s=240)
    assert all(r["ok"] for r in res), res
    recs = read_log(log)
    moves = recs.events("repartition")
    assert moves, "the forced move did not happen"

    scalars, texts = _read(live)
    steps = recs.steps
    assert [s for s, _ in scalars["train/loss"]] == [r.step for r in steps]
    assert [v for _, v in scalars["train/loss"]] == [round(r.loss, 4) for r in steps]
    for tag in ("perf/step_ms", "perf/samples_per_s", "train/lr", "stage0/compute_ms"):
        assert len(scalars[tag]) == len(steps), tag
    assert {"stage0/wait_ms", "stage1/wait_ms", "device0/slowdown", "device1/slowdown"} <= set(
        scalars
    )
    assert [s for s, _ in scalars["eval/loss"]] == [e.step for e in recs.evals]
    # The move: its pause and bytes as scalars at its step, its split in the text log.
    assert scalars["migration/bytes"] == [(m.step, float(m["bytes"])) for m in moves]
    assert [s for s, _ in scalars["migration/pause_ms"]] == [m.step for m in moves]
    # The step record of the move's step already runs the new split (3|1).
    assert (moves[0].step, 3.0) in scalars["stage0/layers"], scalars["stage0/layers"]
    events = texts["adapt/events/text_summary"]
    assert any(s == moves[0].step and "repartition** 2|2 -> 3|1" in t for s, t in events), events
    assert any("forced" in t for _, t in events)

    # The same run converted from its log: the same scalars and texts.
    out = tmp_path / "tb-converted"
    proc = subprocess.run(
        [sys.executable, "-m", "dynpipe", "figures", "--tensorboard", str(out), str(log)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    conv_scalars, conv_texts = _read(out / "run")
    assert conv_scalars == scalars
    assert conv_texts == texts


def test_missing_tensorboard_is_one_line_before_launch(tmp_path) -> None:
    """Without the package, --tensorboard stops in one line and starts no worker."""
    code = (
        "import sys, builtins\n"
        "real = builtins.__import__\n"
        "def fake(name, *a, **k):\n"
        "    if name == 'tensorboard' or name.startswith('tensorboard.') or "
        "name == 'torch.utils.tensorboard':\n"
        "        raise ImportError(f'No module named {name!r}', name=name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = fake\n"
        "from dynpipe.cli import main\n"
        "sys.exit(main(['train', '--nproc', '2', '--steps', '2', '--tensorboard', "
        f"{str(tmp_path / 'tb')!r}, '--log', {str(tmp_path / 'x.jsonl')!r}]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'dynpipe[tb]'" in lines[0], proc.stderr
    assert not (tmp_path / "x.jsonl").exists()


def test_entries_map_each_record_kind() -> None:
    """The one mapping both paths use: steps, evals, telemetry, decisions and moves."""
    from dynpipe.analysis.tensorboard import entries
    from dynpipe.runtime.records import Eval, Event, Header, StageTiming, Step, Telemetry

    st = StageTiming(stage=1, rank=1, layers=(2, 5), fwd_ms=1.5, bwd_ms=2.5, wait_ms=0.25)
    step = {
        e.tag: e.value for e in entries(Step(step=7, wall=1.0, step_ms=9.0, loss=0.5, stages=(st,)))
    }
    assert step["train/loss"] == 0.5 and step["perf/step_ms"] == 9.0
    assert step["stage1/compute_ms"] == 4.0 and step["stage1/wait_ms"] == 0.25
    assert step["stage1/layers"] == 3.0
    assert "train/lr" not in step and "stage1/update_ms" not in step  # None is not drawn
    ev = {e.tag: e.value for e in entries(Eval(step=7, loss=1.0, accuracy=0.75))}
    assert ev == {"eval/loss": 1.0, "eval/accuracy": 0.75}
    tel = entries(
        Telemetry(step=9, devices=({"tel_util": 50.0, "tel_power_w": None}, {"tel_util": 10.0}))
    )
    assert {(e.tag, e.value) for e in tel} == {("device0/util", 50.0), ("device1/util", 10.0)}
    dec = entries(
        Event(
            event="decision",
            step=10,
            fields={
                "mode": "measured",
                "slowdown": [1.0, 3.0],
                "current_ms": 30.0,
                "proposed_ms": 20.0,
                "repartition": True,
                "reason": "predicted 30 -> 20",
            },
        )
    )
    assert {e.tag: e.value for e in dec if e.text is None}["device1/slowdown"] == 3.0
    (text,) = [e for e in dec if e.text is not None]
    assert text.step == 10 and "**move**" in text.text and "predicted 30 -> 20" in text.text
    plan = {"stages": [{"start": 0, "stop": 2}, {"start": 2, "stop": 4}]}
    new = {"stages": [{"start": 0, "stop": 3}, {"start": 3, "stop": 4}]}
    mv = entries(
        Event(
            event="repartition",
            step=11,
            fields={"old_plan": plan, "new_plan": new, "bytes": 1024, "pause_ms": 5.0},
        )
    )
    assert {e.tag: e.value for e in mv if e.text is None} == {
        "migration/bytes": 1024.0,
        "migration/pause_ms": 5.0,
    }
    assert any(e.text and "2|2 -> 3|1" in e.text and "1,024 bytes" in e.text for e in mv)
    assert entries(Header()) == []
