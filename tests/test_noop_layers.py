"""Layers that do no work (``Dropout(0)``, ``Identity``, ``Flatten``) under every adaptation
mode: their readings are timer noise, sometimes below zero, and a measurement must never
stop training. A user convnet with such layers adapts to an emulated slowdown and ends
with the losses of one process; default CPU runs on 1 and 2 workers are bit-identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dynpipe.runtime.adapt.window import Window
from dynpipe.runtime.timing import LayerProbe

TESTS = Path(__file__).parent
ROOT = TESTS.parent
MODEL = "usermodel_noop:noop_convnet"


def test_probe_reads_a_pass_through_layer_as_no_work() -> None:
    # Identity and Dropout(0) return their input tensor itself: both boundary hooks sit on
    # one tensor and fire in registration order, which once read as a negative backward.
    layers = [nn.Linear(8, 8), nn.Identity(), nn.Dropout(p=0.0), nn.Flatten(), nn.Linear(8, 2)]
    probe = LayerProbe(device=torch.device("cpu"))
    probe.sampling = True
    x = torch.randn(4, 8, requires_grad=True)
    for chunk in range(3):
        probe.chunk = chunk
        out = probe.run(layers, x)
        probe.begin_backward(chunk)
        out.sum().backward()
        probe.end_backward(chunk)
    fwd, bwd, *_ = probe.collect()
    assert len(fwd) == len(bwd) == len(layers)
    assert all(np.isfinite(fwd)) and all(np.isfinite(bwd)), (fwd, bwd)
    assert min(fwd) >= 0 and min(bwd) >= 0, (fwd, bwd)


def test_window_takes_impossible_readings_as_data() -> None:
    step = {"step": 4, "step_ms": 10.0, "stages": [{"fwd_ms": 1.0, "bwd_ms": 2.0}] * 2}
    layers = {"fwd_ms": [1.0, -0.002, 0.5, float("inf")], "bwd_ms": [2.0, None, -1e-3, 1.0]}
    win = Window.from_records(
        [step],
        bounds=[(0, 2), (2, 4)],
        ranks=[0, 1],
        microbatches=4,
        schedule="1f1b",
        layers=layers,
    )
    assert win.layer_fwd_ms[1] == 0.0 and np.isnan(win.layer_fwd_ms[3])
    assert np.isnan(win.layer_bwd_ms[1]) and win.layer_bwd_ms[2] == 0.0


def _scenario(path: Path, onset: int) -> str:
    path.write_text(
        f'name = "noop"\n[[events]]\nstep = {onset}\naction = "start"\nkind = "emulate"\n'
        "factor = 10.0\nstage = 1\n"
    )
    return str(path)


def _train(tmp: Path, name: str, *extra: str, nproc: int = 2, steps: int = 36) -> list[float]:
    log = tmp / name / "log.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT)])
    cmd = [
        sys.executable, "-m", "dynpipe", "train", "--model", MODEL, "--nproc", str(nproc),
        "--steps", str(steps), "--batch-size", "16", "--no-progress", "--no-telemetry",
        "--log", str(log), *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    steps_run = {r["step"]: r["loss"] for r in recs if r["type"] == "step"}
    assert sorted(steps_run) == list(range(steps)), f"{name}: steps {sorted(steps_run)}"
    moves = [r for r in recs if r["type"] == "event" and r["event"] in ("repartition", "restart")]
    _train.moves[name] = moves  # type: ignore[attr-defined]
    return [steps_run[s] for s in range(steps)]


_train.moves = {}  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def noop_run(tmp_path_factory) -> tuple[Path, str, list[float]]:
    """The scenario, and the losses of one process: what every run must reproduce."""
    tmp = tmp_path_factory.mktemp("noop")
    return tmp, _scenario(tmp / "s.toml", onset=15), _train(tmp, "one", nproc=1)


_MODES = {
    "static": (),
    "measured": ("--adapt", "measured"),
    "adaptive": ("--adapt", "adaptive", "--predictor", str(ROOT / "predictor" / "cpu.json.gz")),
    "sweep": ("--adapt", "sweep"),
    "restart": ("--adapt", "restart", "--save-every", "100"),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "nproc"), [(m, 2) for m in _MODES] + [("measured", 3)], ids=lambda v: str(v)
)
def test_noop_layers_adapt_under_every_mode(noop_run, mode: str, nproc: int) -> None:
    tmp, scenario, one = noop_run
    name = f"{mode}{nproc}"
    extra = [*_MODES[mode], "--scenario", scenario]
    if mode == "restart":
        extra += ["--save-dir", str(tmp / name / "ckpt")]
    # Default CPU runs on any number of workers compute what one process does, to the bit
    # (``--cpu-threads``), under any split and any number of moves.
    assert _train(tmp, name, *extra, nproc=nproc) == one
    if mode != "static":
        # A 10x slowdown of stage 1 from step 15 moves layers, on a loaded machine too (the
        # sweep moves by design).
        moves = _train.moves[name]  # type: ignore[attr-defined]
        assert any(m["step"] > 15 for m in moves), [m["step"] for m in moves]
