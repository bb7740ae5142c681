"""``dynpipe train`` end to end: bad input gives one line and exit 2; a real 2-worker run
writes a complete run log; a dead peer fails the others within the timeout, named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from distutil import run_ranks

from dynpipe.cli import main


def _one_line_error(capsys, argv: list[str], *needles: str) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, lines
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_plan_missing_a_layer(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {
                "model": "mlp",
                "num_layers": 10,
                "stages": [{"start": 0, "stop": 3, "rank": 0}, {"start": 4, "stop": 10, "rank": 1}],
            }
        )
    )
    _one_line_error(capsys, ["train", "--plan", str(bad)], "misses", "layer", "3")


def test_plan_repeating_a_layer(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {
                "model": "mlp",
                "num_layers": 10,
                "stages": [{"start": 0, "stop": 5, "rank": 0}, {"start": 4, "stop": 10, "rank": 1}],
            }
        )
    )
    _one_line_error(capsys, ["train", "--plan", str(bad)], "repeats", "4")


def test_more_stages_than_layers(capsys) -> None:
    _one_line_error(capsys, ["train", "--stages", "11"], "10 layers", "11 stages")


def test_world_size_differs_from_plan(capsys) -> None:
    _one_line_error(
        capsys, ["train", "--stages", "2", "--nproc", "3"], "2 stages", "3 ranks", "--nproc 2"
    )


def test_unknown_model(capsys) -> None:
    _one_line_error(capsys, ["train", "--model", "vgg17"], "vgg17", "vgg16")


def test_missing_data_path(tmp_path, capsys) -> None:
    missing = tmp_path / "nope.txt"
    _one_line_error(
        capsys,
        ["train", "--model", "gpt", "--data", "text", "--data-path", str(missing)],
        str(missing),
    )


@pytest.mark.slow
def test_non_finite_loss_stops_every_worker_with_one_line(tmp_path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "dynpipe",
        "train",
        "--nproc",
        "2",
        "--steps",
        "20",
        "--lr",
        "1e30",
        "--no-progress",
        "--log",
        str(tmp_path / "log.jsonl"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert "loss is nan" in lines[0] or "loss is inf" in lines[0], lines[0]
    assert "--lr" in lines[0]


def test_a_run_with_a_save_folder_ends_on_a_checkpoint_and_says_where(tmp_path) -> None:
    """--save-dir alone (no --save-every) once saved nothing, and a run of 5 steps saving
    every 3 left steps 4-5 to train again."""
    from dynpipe.runtime.checkpoint import list_checkpoints

    for every, saves in (("0", [5]), ("3", [3, 5])):
        ck = tmp_path / f"ck{every}"
        cmd = [sys.executable, "-m", "dynpipe", "train", "--nproc", "2", "--steps", "5"]
        cmd += ["--no-progress", "--save-dir", str(ck), "--save-every", every]
        cmd += ["--log", str(tmp_path / f"log{every}.jsonl")]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        done, _ = list_checkpoints(ck)
        assert [c.step for c in done] == saves
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("dynpipe train: done")]
        assert len(lines) == 1 and "steps 0-5" in lines[0], proc.stdout
        assert str(done[-1].path) in lines[0] and f"log{every}.jsonl" in lines[0], lines[0]


def _train_two_stages(rank: int, world: int, log: str) -> dict:
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.optim import OptimConfig
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    cfg = TrainConfig(
        model="mlp",
        steps=40,
        batch_size=32,
        microbatches=4,
        log=log,
        log_every=8,
        progress=False,
        optim=OptimConfig(name="adamw", lr=3e-3),
    )
    out = train(cfg, topo=Topology.from_env(device="cpu"))
    return {"losses": out["losses"]}


@pytest.mark.slow
def test_run_log_has_header_steps_and_per_stage_timing(tmp_path) -> None:
    from dynpipe.runtime.records import SCHEMA_VERSION, Event, Header, read_log

    log = tmp_path / "run" / "log.jsonl"
    res = run_ranks(_train_two_stages, 2, str(log))
    recs = read_log(log)
    header = recs.records[0]
    assert isinstance(header, Header) and header.schema == SCHEMA_VERSION
    assert header.plan["model"] == "mlp" and header.world_size == 2
    assert header.env["torch"]
    steps = recs.steps
    assert [r.step for r in steps] == list(range(40))
    for r in steps:
        assert [st.stage for st in r.stages] == [0, 1]
        for st in r.stages:
            assert st.fwd_ms > 0 and st.bwd_ms > 0 and st.wait_ms >= 0
        assert r.samples_per_s > 0 and r.step_ms > 0
    end = recs.records[-1]
    assert isinstance(end, Event) and end.event == "end" and end.step == 40
    # Every rank sees the same (global) loss, and the synthetic task is learnable.
    assert res[0]["value"]["losses"] == res[1]["value"]["losses"]
    losses = res[1]["value"]["losses"]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses


def _die_at_step_3(rank: int, world: int) -> str:
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    def on_step(engine, res) -> None:
        if rank == 1 and res.step == 3:
            os._exit(17)  # a peer that vanishes without a word

    cfg = TrainConfig(
        model="mlp", steps=50, batch_size=16, microbatches=4, progress=False, log=os.devnull
    )
    t0 = time.time()
    try:
        train(cfg, topo=Topology.from_env(device="cpu", timeout_s=20), on_step=on_step)
    except Exception as exc:
        return f"{time.time() - t0:.1f}s {type(exc).__name__}: {exc}"
    return "finished"


@pytest.mark.slow
@pytest.mark.timing
def test_dead_peer_fails_other_ranks_naming_it() -> None:
    res = run_ranks(_die_at_step_3, 3, timeout_s=120, pg_timeout_s=20, expect_failure=True)
    assert not res[1]["ok"]  # the dead rank left no result
    for r in (0, 2):
        msg = res[r]["value"]
        assert "StageFailure" in msg, msg
        assert "rank 1 (stage 1)" in msg, msg
        assert f"rank {r} (stage {r})" in msg, msg
        assert float(msg.split("s ", 1)[0]) < 60, msg
