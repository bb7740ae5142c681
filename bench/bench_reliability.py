"""What each fault costs, measured through ``dynpipe train`` on this machine (CPU, gloo).

    python bench/bench_reliability.py --json bench/results/reliability-cpu.json
    python bench/bench_reliability.py --repeats 3 --width 512

Cases, each on 2 workers training mlp (``--width``, depth 8, batch 64, AdamW):

- ``worker_sigkill``: a worker SIGKILLed mid-run, relaunched by ``--max-restarts 1``:
  seconds from the kill to the relaunched run's resume (from its ``recovered`` log event),
  the steps it redoes, and the job's wall time against an uninterrupted run's.
- ``dead_peer``: the same kill without restarts: seconds until the job has exited, and
  whether its error names the dead rank.
- ``sigterm``: SIGTERM to the launcher: seconds until it has exited with a final checkpoint.
- ``launcher_sigkill``: SIGKILL of the launcher: seconds until its workers are gone.
- ``save_stall``: one process saving the same state again and again, asynchronously (what
  training does) and synchronously, interleaved: how long the training thread is blocked,
  against how long the save takes to be published. Also the stall logged by the
  ``worker_sigkill`` run's own checkpoints.

Numbers are what this machine gave; a loaded 2-core machine spreads them widely.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import torch  # noqa: E402

from dynpipe.runtime.checkpoint import list_checkpoints  # noqa: E402
from dynpipe.runtime.checkpointer import Checkpointer  # noqa: E402
from dynpipe.runtime.records import read_dicts  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _cmd(args: argparse.Namespace, *extra: str, steps: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dynpipe",
        "train",
        "--nproc",
        "2",
        "--model-arg",
        f"width={args.width}",
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
        str(args.timeout),
        *extra,
    ]


def _wait(pred, proc: subprocess.Popen, timeout_s: float = 600.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise RuntimeError("the job ended, or nothing happened in time")


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


def _ckpt_at(root: Path, step: int) -> bool:
    return any(c.step >= step for c in list_checkpoints(root)[0])


def worker_sigkill(args: argparse.Namespace, d: Path) -> dict:
    t0 = time.time()
    ref = subprocess.run(_cmd(args, steps=args.steps), env=ENV, capture_output=True)
    ref_s = time.time() - t0
    assert ref.returncode == 0, ref.stderr[-2000:]
    ck, log = d / "ck", d / "run.jsonl"
    extra = ("--save-every", str(args.save_every), "--save-dir", str(ck), "--max-restarts", "1")
    t0 = time.time()
    proc = subprocess.Popen(_cmd(args, *extra, "--log", str(log), steps=args.steps), env=ENV)
    _wait(lambda: _ckpt_at(ck, 2 * args.save_every), proc)
    # Kill between two checkpoints, so that some steps are lost.
    time.sleep(args.kill_after_s)
    t_kill = time.time()
    _workers(proc)[0].kill()
    proc.wait(timeout=900)
    wall_s = time.time() - t0
    recs = read_dicts(log)
    (rec,) = [r for r in recs if r.get("event") == "recovered"]
    saves = [r for r in recs if r.get("event") == "checkpoint"]
    return {
        "exit": proc.returncode,
        "kill_to_resumed_s": round(rec["time"] - t_kill, 2),
        "steps_redone": rec["steps_lost"],
        "resumed_at_step": rec["step"],
        "job_wall_s": round(wall_s, 2),
        "uninterrupted_wall_s": round(ref_s, 2),
        "checkpoint_stall_ms_median": round(statistics.median(r["stall_ms"] for r in saves), 2),
        "checkpoint_publish_ms_median": round(statistics.median(r["write_ms"] for r in saves), 2),
        "checkpoint_bytes": saves[0]["bytes"],
    }


def dead_peer(args: argparse.Namespace, d: Path) -> dict:
    log = d / "dead.jsonl"
    proc = subprocess.Popen(
        _cmd(args, "--log", str(log), steps=100000),
        env=ENV,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait(lambda: log.is_file() and any(r["type"] == "step" for r in read_dicts(log)), proc)
    victim = _workers(proc)[0]
    rank = victim.environ().get("RANK")
    t_kill = time.time()
    victim.kill()
    _, err = proc.communicate(timeout=600)
    return {
        "exit": proc.returncode,
        "kill_to_exit_s": round(time.time() - t_kill, 2),
        "names_dead_rank": f"rank {rank} (stage {rank}) silent" in err,
    }


def sigterm(args: argparse.Namespace, d: Path) -> dict:
    ck, log = d / "ckt", d / "term.jsonl"
    extra = ("--save-every", str(args.save_every), "--save-dir", str(ck), "--log", str(log))
    proc = subprocess.Popen(
        _cmd(args, *extra, steps=100000), env=ENV, stderr=subprocess.PIPE, text=True
    )
    _wait(lambda: _ckpt_at(ck, args.save_every), proc)
    workers = _workers(proc)
    t_sig = time.time()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    exit_s = time.time() - t_sig
    _, alive = psutil.wait_procs(workers, timeout=10)
    return {
        "exit": proc.returncode,
        "signal_to_exit_s": round(exit_s, 2),
        "stderr_lines": len([ln for ln in err.splitlines() if ln.strip()]),
        "final_checkpoint": "final checkpoint" in err,
        "workers_left": len(alive),
    }


def launcher_sigkill(args: argparse.Namespace, d: Path) -> dict:
    log = d / "kill.jsonl"
    proc = subprocess.Popen(_cmd(args, "--log", str(log), steps=100000), env=ENV)
    _wait(lambda: log.is_file() and any(r["type"] == "step" for r in read_dicts(log)), proc)
    workers = _workers(proc)
    t0 = time.time()
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(workers, timeout=args.timeout)
    return {"workers_gone_s": round(time.time() - t0, 2), "workers_left": len(alive)}


def save_stall(args: argparse.Namespace, d: Path) -> dict:
    torch.set_num_threads(1)
    out = {}
    for mb in (4, 256):
        n = mb * (1 << 20) // 4
        model = {"w": torch.randn(n // 2)}
        optim = {"w/exp_avg": torch.randn(n // 2)}
        times: dict[str, list[float]] = {"async_stall": [], "async_publish": [], "sync": []}
        for i in range(args.repeats * 2):
            ck = Checkpointer(d / f"stall{mb}", keep=1, async_save=bool(i % 2))
            t0 = time.perf_counter()
            ck.save(step=i, model_state=model, optim_state=optim, meta={"step": i})
            t1 = time.perf_counter()
            ck.wait()
            t2 = time.perf_counter()
            if i % 2:
                times["async_stall"].append((t1 - t0) * 1e3)
                times["async_publish"].append((t2 - t0) * 1e3)
            else:
                times["sync"].append((t2 - t0) * 1e3)
        out[f"{mb}MB"] = {k: round(statistics.median(v), 1) for k, v in times.items()}
    return out


CASES = {
    "save_stall": save_stall,
    "worker_sigkill": worker_sigkill,
    "dead_peer": dead_peer,
    "sigterm": sigterm,
    "launcher_sigkill": launcher_sigkill,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--kill-after-s", type=float, default=0.3)
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    results: dict = {
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "torch": torch.__version__,
        },
        "config": vars(args) | {"json": str(args.json)},
    }
    for name in args.cases:
        runs = []
        for _ in range(1 if name == "save_stall" else args.repeats):
            with tempfile.TemporaryDirectory() as d:
                runs.append(CASES[name](args, Path(d)))
            print(name, json.dumps(runs[-1]), flush=True)
        results[name] = runs
    results["machine"]["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
