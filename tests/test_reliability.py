"""Faults end to end, through ``dynpipe train`` on CPU (gloo), as a user meets them:

- a worker SIGKILLed mid-run is relaunched (``--max-restarts``), resumes from the newest
  checkpoint and ends with every step's loss equal to an uninterrupted run's;
- the same after resuming from an older checkpoint into a folder holding newer ones: the
  relaunch resumes its own run's checkpoint, and no published folder is ever rewritten;
- SIGTERM to the launcher: one line, exit 143, a final checkpoint, no process left behind;
- SIGKILL of the launcher: its workers are gone within ``--timeout``;
- the multi-node form of docs/multi-node.md (``torchrun ... -m dynpipe -- train ...``) runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dynpipe.runtime.checkpoint import META_FILE, list_checkpoints, newest_checkpoint
from dynpipe.runtime.records import read_dicts

pytestmark = pytest.mark.slow

TIMEOUT_S = 20
# Steps of a run: after the checkpoint a test waits for, enough left (80+ steps) that its
# kill lands while the run still trains.
STEPS = 120


def _cmd(*extra: str, steps: int = STEPS) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dynpipe",
        "train",
        "--nproc",
        "2",
        "--model-arg",
        "width=256",
        "--model-arg",
        "depth=8",
        "--batch-size",
        "64",
        "--optimizer",
        "adamw",
        "--lr",
        "1e-3",
        "--steps",
        str(steps),
        "--log-every",
        "5",
        "--no-progress",
        "--no-telemetry",
        "--timeout",
        str(TIMEOUT_S),
        *extra,
    ]


def _env(tmp_path: Path) -> dict[str, str]:
    tmp = tmp_path / "systmp"
    tmp.mkdir(exist_ok=True)
    return {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}


def _losses(log: Path) -> dict[int, float]:
    """Loss per step; a step run again after a relaunch counts with its last record."""
    return {r["step"]: r["loss"] for r in read_dicts(log) if r["type"] == "step"}


def _events(log: Path, name: str) -> list[dict]:
    return [r for r in read_dicts(log) if r["type"] == "event" and r["event"] == name]


def _wait_for(what: str, pred, proc: subprocess.Popen, timeout_s: float = 300.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(f"the job ended (exit {proc.returncode}) before {what}")
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout_s:.0f}s")


def _workers(proc: subprocess.Popen) -> list[psutil.Process]:
    """The launcher's worker processes: those its agent started (``python -m dynpipe
    train``), or those its fork server forked (whose command line is the server's)."""
    cmd = {}
    for k in psutil.Process(proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):  # ended since it was listed
            cmd[k] = (" ".join(k.cmdline()), k.ppid())
    ours = {k.pid for k, (c, _) in cmd.items() if "dynpipe" in c}
    return [
        k
        for k, (c, ppid) in cmd.items()
        if k.pid in ours and ("forkserver" not in c or ppid in ours)
    ]


def _published(root: Path, min_step: int, newer_than: int = 0):
    done, _ = list_checkpoints(root)
    return next((c for c in done if c.step >= min_step and c.seq > newer_than), None)


def _kill_a_worker(proc: subprocess.Popen) -> None:
    workers = _wait_for("two workers", lambda: len(_workers(proc)) >= 2 and _workers(proc), proc)
    workers[0].kill()  # SIGKILL: what an OOM killer or a preemption does


def test_a_killed_worker_is_relaunched_and_ends_as_if_never_interrupted(tmp_path) -> None:
    env = _env(tmp_path)
    ref = subprocess.run(
        _cmd("--log", str(tmp_path / "ref.jsonl")), env=env, capture_output=True, text=True
    )
    assert ref.returncode == 0, ref.stderr[-2000:]

    ck, log = tmp_path / "ck", tmp_path / "run.jsonl"
    args = ("--save-every", "20", "--save-dir", str(ck), "--max-restarts", "1", "--log", str(log))
    proc = subprocess.Popen(_cmd(*args), env=env, stderr=subprocess.PIPE, text=True)
    _wait_for("a checkpoint at step 20", lambda: _published(ck, 20), proc)
    _kill_a_worker(proc)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]

    (rec,) = _events(log, "recovered")
    assert rec["attempt"] == 1 and rec["step"] % 20 == 0 and rec["step"] >= 20
    assert rec["lost_from"] == "store" and rec["reached_step"] >= rec["step"]
    assert rec["steps_lost"] == rec["reached_step"] - rec["step"]
    steps = [r["step"] for r in read_dicts(log) if r["type"] == "step"]
    assert sorted(set(steps)) == list(range(STEPS))
    # Bit-identical to the uninterrupted run, the steps redone after the relaunch included.
    assert _losses(log) == _losses(tmp_path / "ref.jsonl")
    assert not list((tmp_path / "systmp").glob("torchelastic_*"))


def test_a_relaunch_after_resuming_an_older_step_keeps_to_its_own_run(tmp_path) -> None:
    """Run A saves steps 10..STEPS; run B resumes from A's step 10 into the same folder and a
    worker of B is killed: B resumes from its own newest checkpoint (not A's last), ends
    with A's losses, and every checkpoint A published is untouched."""
    env = _env(tmp_path)
    ck = tmp_path / "ck"
    common = ("--save-every", "10", "--save-dir", str(ck), "--keep-checkpoints", "100")
    a = subprocess.run(
        _cmd(*common, "--log", str(tmp_path / "a.jsonl")), env=env, capture_output=True, text=True
    )
    assert a.returncode == 0, a.stderr[-2000:]
    done, _ = list_checkpoints(ck)
    a_markers = {c.path: (c.path / META_FILE).read_bytes() for c in done}
    a_last = done[-1].seq
    start = next(c for c in done if c.step == 10)

    log = tmp_path / "b.jsonl"
    args = (*common, "--resume", str(start.path), "--max-restarts", "1", "--log", str(log))
    proc = subprocess.Popen(_cmd(*args), env=env, stderr=subprocess.PIPE, text=True)
    mine = _wait_for("run B's checkpoint at step 20", lambda: _published(ck, 20, a_last), proc)
    _kill_a_worker(proc)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]

    (rec,) = _events(log, "recovered")
    assert mine.step <= rec["step"] < STEPS  # B's own checkpoint, not A's newest
    assert _losses(log) == {s: v for s, v in _losses(tmp_path / "a.jsonl").items() if s >= 10}
    for path, marker in a_markers.items():
        assert (path / META_FILE).read_bytes() == marker
    done, _ = list_checkpoints(ck)
    # B published its own checkpoints at 20, 30, ..., STEPS beside all of A's.
    assert len({c.path.name for c in done}) == len(done) == len(a_markers) + (STEPS - 10) // 10


def test_sigterm_stops_the_job_with_one_line_and_a_final_checkpoint(tmp_path) -> None:
    ck, log = tmp_path / "ck", tmp_path / "run.jsonl"
    args = ("--save-every", "50", "--save-dir", str(ck), "--log", str(log))
    proc = subprocess.Popen(
        _cmd(*args, steps=100000),
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for("a checkpoint", lambda: _published(ck, 50), proc)
    workers = _workers(proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, lines
    final = newest_checkpoint(ck)
    # The stop's own checkpoint, or the periodic one when the stop fell on its step.
    assert final.meta["reason"] == "stop:SIGTERM" or final.step % 50 == 0
    assert lines[0] == (
        f"dynpipe train: stopped by SIGTERM; final checkpoint {final.path} (step {final.step})"
    )
    (stopped,) = _events(log, "stopped")
    assert stopped["step"] == final.step and stopped["checkpoint"] == str(final.path)
    assert max(_losses(log)) == final.step - 1  # the checkpoint holds every step run
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, alive
    assert not list((tmp_path / "systmp").glob("torchelastic_*"))


@pytest.mark.timing
def test_workers_exit_when_their_launcher_is_killed(tmp_path) -> None:
    log = tmp_path / "run.jsonl"
    proc = subprocess.Popen(
        _cmd("--log", str(log), steps=100000), env=_env(tmp_path), stderr=subprocess.DEVNULL
    )
    _wait_for("training", lambda: log.is_file() and _losses(log), proc)
    workers = _workers(proc)
    assert len(workers) == 2
    t0 = time.time()
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(workers, timeout=TIMEOUT_S)
    assert not alive, f"{alive} outlived their launcher by {time.time() - t0:.1f}s"


def test_the_readme_multinode_form_runs_under_torchrun(tmp_path) -> None:
    log = tmp_path / "run.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "dynpipe",
        "--",
        "train",
        "--device",
        "cpu",
        "--steps",
        "5",
        "--no-progress",
        "--log",
        str(log),
    ]
    proc = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(_losses(log)) == list(range(5))


def _train(rank: int, world: int, cfg: dict, env: dict[str, str]) -> dict:
    os.environ.update(env)
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    # The controller measures and saves what it learned, but a gain of 99% is never
    # predicted: no move, however a loaded machine times the stages, so the plan the first
    # run saves is the one it was given.
    adapt = AdaptConfig(mode="measured", monitor_every=4, min_gain=0.99)
    out = train(TrainConfig(**cfg, adapt=adapt), topo=Topology.from_env(device="cpu"))
    return {"start": out["start"], "plan": out["plan"].to_dict(), "losses": out["losses"]}


def test_a_relaunch_resumes_under_the_plan_and_adaptation_state_it_saved(tmp_path) -> None:
    from distutil import run_ranks

    from dynpipe.models import get_model
    from dynpipe.planner import Plan

    model = get_model("mlp", depth=8, width=32)
    Plan.from_bounds(model, [3, 7]).save(tmp_path / "3-7.json")
    base = {
        "model": "mlp",
        "model_args": {"depth": 8, "width": 32},
        "batch_size": 32,
        "save_every": 10,
        "save_dir": str(tmp_path / "ck"),
        "log": str(tmp_path / "log.jsonl"),
        "progress": False,
        "telemetry": False,
    }
    env = {"TORCHELASTIC_RUN_ID": "job-1", "TORCHELASTIC_RESTART_COUNT": "0"}
    first = run_ranks(_train, 2, {**base, "steps": 20, "plan": str(tmp_path / "3-7.json")}, env)
    saved = newest_checkpoint(tmp_path / "ck")
    assert saved.step == 20 and saved.run_id == "job-1"
    assert saved.meta["adapt_state"]["estimates"]  # what the controller learned, saved
    # The relaunch names no plan: it continues under the one the checkpoint was saved with.
    env = {**env, "TORCHELASTIC_RESTART_COUNT": "1"}
    again = run_ranks(_train, 2, {**base, "steps": 30}, env)
    assert again[1]["value"]["start"] == 20
    assert first[1]["value"]["plan"]["stages"] == saved.meta["plan"]["stages"]
    # The plan the relaunch started under (its log header), and the one it ended with.
    from dynpipe.runtime.records import read_log

    headers = read_log(tmp_path / "log.jsonl").headers
    assert len(headers) == 2 and headers[1].start_step == 20
    assert headers[1].plan["stages"] == saved.meta["plan"]["stages"]
    assert again[1]["value"]["plan"]["stages"] == saved.meta["plan"]["stages"]
    even = Plan.even(model, 2, schedule="1f1b", microbatches=4).to_dict()["stages"]
    assert saved.meta["plan"]["stages"] != even  # the command line's plan would be this one
    (rec,) = _events(tmp_path / "log.jsonl", "recovered")
    assert rec["step"] == 20 and rec["steps_lost"] == 0 and rec["lost_from"] == "log"
