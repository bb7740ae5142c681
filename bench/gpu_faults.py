"""Reliability on one GPU, end to end through ``dynpipe train``: one command, one summary.

    PYTHONPATH=$PWD python bench/gpu_faults.py "$OUT"       # one GPU (about 5 minutes, H100)
    python bench/gpu_faults.py OUT --device cpu --quick     # the same cases on CPU, tiny model
    python bench/gpu_faults.py OUT --cases save_stall oom   # some cases only

Cases, each (but the first, in this process) one worker (``--nproc 1``) under the run's
own launcher and agent:

- ``staging_exact``: a model with a batch-norm layer and AdamW saves after a step and at
  once runs the next one (which changes every saved tensor); the checkpoint, loaded, must
  equal the state at the save, tensor for tensor.
- ``save_resume``: save every K steps (in the background), then resume from the checkpoint of
  step K in a second run; the resumed steps' losses against the first run's.
- ``worker_sigkill``: the worker SIGKILLed after the checkpoint of step 2K, ``--max-restarts
  1``: the job ends with exit 0, and every step's loss (the redone ones included) against
  ``save_resume``'s uninterrupted run. The steps before the kill are a second uninterrupted
  run of the same steps: their difference is the device's run-to-run noise.
- ``sigterm``: SIGTERM to the launcher after the first checkpoint: exit 143, one line on
  stderr naming a final checkpoint whose marker says ``stop:SIGTERM``, no worker left.
- ``save_stall``: the full-size model (gpt width 1024, depth 12, seq 1024, batch 32 in 4
  microbatches, bf16 on GPU) saving every ``--stall-every`` steps: the training thread's
  stall per save (the run log's ``checkpoint`` events) against the median step time, and
  what the steps that ran while the save was written cost beyond the median.
- ``oom``: a step that cannot fit (gpt width 4096, batch 512 in one microbatch on GPU; on
  CPU a layer that raises torch's ``OutOfMemoryError`` at step 3): one stderr line naming
  the stage, the step, the batch and what to lower, a non-zero exit, no hang.

Writes ``OUT/gpu_faults.json`` (every number, the machine, the commands) and
``OUT/gpu_faults.md`` (the summary table, also printed), and each case's run logs under
``OUT/<case>/`` (its checkpoints are deleted after it, unless ``--keep-checkpoints``). ``bench/reliability_table.py`` renders docs/reliability.md's table from
the committed JSON files.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dynpipe.runtime.checkpoint import list_checkpoints, newest_checkpoint  # noqa: E402
from dynpipe.runtime.checkpointer import STAGING_ENV  # noqa: E402
from dynpipe.runtime.records import read_dicts  # noqa: E402

# Sizes per mode: (model args, batch size, microbatches, extra flags).
# Short steps and small saves: the worker is killed between two saves, well before the end.
_SMALL_GPU = (
    ["depth=4", "width=256", "heads=4", "seq_len=256", "vocab=4096"],
    16,
    4,
    ["--bf16"],
)
_FULL_GPU = (
    ["depth=12", "width=1024", "heads=16", "seq_len=1024", "vocab=32000"],
    32,
    4,
    ["--bf16"],
)
# One microbatch of 512 x 1024 tokens: its logits alone (fp32 for the loss) are 67 GB, so
# it cannot fit an H200 (141 GB) either.
_OOM_GPU = (
    ["depth=4", "width=4096", "heads=32", "seq_len=1024", "vocab=32000"],
    512,
    1,
    ["--bf16"],
)
_TINY_CPU = (["depth=2", "width=64", "heads=4", "seq_len=32", "vocab=256"], 8, 4, [])
_STALL_CPU = (["depth=4", "width=256", "heads=4", "seq_len=128", "vocab=1024"], 8, 4, [])


class Suite:
    """The cases' shared settings and helpers (commands, waits, the worker's process)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.cpu = args.device == "cpu"
        self.small = _TINY_CPU if self.cpu else _SMALL_GPU
        self.full = _STALL_CPU if self.cpu else _FULL_GPU
        self.steps = args.steps or (24 if args.quick else 200)
        self.every = args.save_every or (6 if args.quick else 20)
        path = [str(ROOT), str(ROOT / "tests")]
        if os.environ.get("PYTHONPATH"):
            path.append(os.environ["PYTHONPATH"])
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        if self.cpu:
            self.env.setdefault("OMP_NUM_THREADS", "1")
        self.commands: dict[str, list[str]] = {}

    def cmd(self, size: tuple, *extra: str, steps: int, model: str = "gpt") -> list[str]:
        margs, batch, micro, flags = size
        words = [sys.executable, "-m", "dynpipe", "train", "--model", model]
        for a in margs:
            words += ["--model-arg", a]
        words += [
            "--nproc",
            "1",
            "--device",
            self.args.device,
            *flags,
            "--device-batches",
            "4",
            "--batch-size",
            str(batch),
            "--microbatches",
            str(micro),
            "--optimizer",
            "adamw",
            "--lr",
            "1e-4",
            "--steps",
            str(steps),
            # Step records reach the log at window ends: windows that end on every save, so a
            # relaunch from a checkpoint redoes (and logs) every step whose record was lost.
            "--log-every",
            "2" if self.every % 2 == 0 else "1",
            "--no-progress",
            "--no-telemetry",
            "--timeout",
            str(self.args.timeout),
            *extra,
        ]
        return words

    def run(
        self, name: str, words: list[str], timeout_s: float = 600
    ) -> subprocess.CompletedProcess:
        self.commands[name] = words
        return subprocess.run(
            words, env=self.env, capture_output=True, text=True, timeout=timeout_s
        )

    def popen(self, name: str, words: list[str]) -> subprocess.Popen:
        self.commands[name] = words
        return subprocess.Popen(
            words, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )


def _wait(what: str, pred, proc: subprocess.Popen, timeout_s: float = 300.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        if proc.poll() is not None:
            raise RuntimeError(f"the job ended (exit {proc.returncode}) before {what}")
        time.sleep(0.05)
    raise RuntimeError(f"no {what} within {timeout_s:.0f}s")


def _parents() -> dict[int, int]:
    """Every process's parent, from /proc (psutil may not be installed where this runs)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parent[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    return parent


def _children(pid: int, parent: dict[int, int] | None = None) -> list[int]:
    """Descendants of ``pid``."""
    parent = _parents() if parent is None else parent
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def _workers(proc: subprocess.Popen) -> list[int]:
    """The launcher's worker processes: those its agent started (``python -m dynpipe
    train``), or those its fork server forked (whose command line is the server's)."""
    parent = _parents()
    cmd = {}
    for pid in _children(proc.pid, parent):
        try:
            cmd[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
    ours = {p for p, c in cmd.items() if "dynpipe" in c}
    return sorted(p for p in ours if "forkserver" not in cmd[p] or parent.get(p) in ours)


def _alive(pids: list[int], timeout_s: float) -> list[int]:
    """The processes of ``pids`` still running (zombies count as gone) after ``timeout_s``."""
    deadline = time.time() + timeout_s
    while True:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.append(pid)
        if not alive or time.time() >= deadline:
            return alive
        time.sleep(0.1)


def _published(root: Path, min_step: int):
    done, _ = list_checkpoints(root)
    return next((c for c in done if c.step >= min_step), None)


def _losses(log: Path) -> dict[int, float]:
    """Loss per step; a step run again after a relaunch counts with its last record."""
    return {r["step"]: r["loss"] for r in read_dicts(log) if r["type"] == "step"}


def _events(log: Path, name: str) -> list[dict]:
    return [r for r in read_dicts(log) if r["type"] == "event" and r["event"] == name]


def _compare(got: dict[int, float], want: dict[int, float]) -> dict[str, Any]:
    """Losses of the same steps: identical bits, or how far apart (relative)."""
    steps = sorted(set(got) & set(want))
    rel = [abs(got[s] - want[s]) / max(abs(want[s]), 1e-12) for s in steps]
    return {
        "steps_compared": len(steps),
        "bit_identical": bool(steps) and all(got[s] == want[s] for s in steps),
        "max_rel_diff": max(rel, default=None),
    }


def _close(cmp: dict[str, Any], tol: float) -> bool:
    return cmp["steps_compared"] > 0 and (
        cmp["bit_identical"] or (cmp["max_rel_diff"] is not None and cmp["max_rel_diff"] <= tol)
    )


def _tail(text: str, n: int = 1500) -> str:
    return text[-n:]


# -- cases ------------------------------------------------------------------------------------


def save_resume(s: Suite, d: Path, state: dict) -> dict:
    ck, log_a, log_b = d / "ck", d / "uninterrupted.jsonl", d / "resumed.jsonl"
    save = ("--save-every", str(s.every), "--save-dir", str(ck), "--keep-checkpoints", "100")
    a = s.run(
        "save_resume:uninterrupted", s.cmd(s.small, *save, "--log", str(log_a), steps=s.steps)
    )
    if a.returncode != 0:
        return {
            "ok": False,
            "error": f"uninterrupted run exit {a.returncode}",
            "stderr": _tail(a.stderr),
        }
    done, skipped = list_checkpoints(ck)
    steps_saved = [c.step for c in done]
    first = next(c for c in done if c.step == s.every)
    b = s.run(
        "save_resume:resumed",
        s.cmd(s.small, "--resume", str(first.path), "--log", str(log_b), steps=s.steps),
    )
    if b.returncode != 0:
        return {"ok": False, "error": f"resumed run exit {b.returncode}", "stderr": _tail(b.stderr)}
    ref = _losses(log_a)
    state["reference"] = ref
    got = _losses(log_b)
    cmp = _compare(got, ref)
    saves = _events(log_a, "checkpoint")
    expected = list(range(s.every, s.steps + 1, s.every))
    if s.steps % s.every:
        expected.append(s.steps)
    return {
        "ok": steps_saved == expected
        and not skipped
        and sorted(got) == list(range(s.every, s.steps))
        and _close(cmp, s.args.tolerance),
        "saved_steps": steps_saved,
        "resumed_from": first.step,
        **cmp,
        "checkpoint_bytes": saves[0]["bytes"] if saves else None,
        "stall_ms_median": round(statistics.median(r["stall_ms"] for r in saves), 2)
        if saves
        else None,
    }


def worker_sigkill(s: Suite, d: Path, state: dict) -> dict:
    ref = state.get("reference")
    if ref is None:
        return {"ok": False, "error": "needs save_resume's uninterrupted run (run it first)"}
    ck, log = d / "ck", d / "run.jsonl"
    save = ("--save-every", str(s.every), "--save-dir", str(ck), "--max-restarts", "1")
    proc = s.popen("worker_sigkill", s.cmd(s.small, *save, "--log", str(log), steps=s.steps))
    try:
        _wait(f"a checkpoint at step {2 * s.every}", lambda: _published(ck, 2 * s.every), proc)
        workers = _wait("the worker", lambda: _workers(proc), proc)
        t_kill = time.time()
        os.kill(workers[0], signal.SIGKILL)  # what an OOM killer or a preemption does
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    recovered = _events(log, "recovered")
    got = _losses(log)
    cmp = _compare(got, ref)
    out: dict[str, Any] = {"exit": proc.returncode, **cmp}
    if recovered:
        rec = recovered[0]
        before = {k: v for k, v in got.items() if k < rec["step"]}
        # Steps before the resumed one were run once, by the first attempt: against the
        # reference they are two uninterrupted runs, i.e. the device's own noise.
        out.update(
            resumed_at_step=rec["step"],
            steps_redone=rec["steps_lost"],
            kill_to_resumed_s=round(rec["time"] - t_kill, 2),
            noise_max_rel_diff=_compare(before, ref)["max_rel_diff"],
        )
    out["ok"] = (
        proc.returncode == 0
        and len(recovered) == 1
        and sorted(got) == list(range(s.steps))
        and _close(cmp, s.args.tolerance)
    )
    if not out["ok"]:
        out["stderr"] = _tail(err)
    return out


def sigterm(s: Suite, d: Path, state: dict) -> dict:
    ck, log = d / "ck", d / "run.jsonl"
    save = ("--save-every", str(s.every), "--save-dir", str(ck), "--log", str(log))
    proc = s.popen("sigterm", s.cmd(s.small, *save, steps=100000))
    try:
        _wait("a checkpoint", lambda: _published(ck, s.every), proc)
        workers = _workers(proc)
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        exit_s = time.time() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    alive = _alive(workers, timeout_s=10)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    final = newest_checkpoint(ck)
    stopped = _events(log, "stopped")
    one_line = len(lines) == 1 and "Traceback" not in err
    # The final checkpoint is the stop's own, or a periodic one of the very step it stopped at.
    final_ok = (
        final is not None
        and final.meta.get("reason") in ("stop:SIGTERM", "periodic")
        and bool(stopped)
        and stopped[-1]["checkpoint"] == str(final.path)
        and f"final checkpoint {final.path} (step {final.step})" in (lines or [""])[0]
    )
    out = {
        "exit": proc.returncode,
        "signal_to_exit_s": round(exit_s, 2),
        "stderr_lines": len(lines),
        "line": lines[0] if lines else None,
        "final_checkpoint_step": final.step if final else None,
        "final_reason": final.meta.get("reason") if final else None,
        "workers_left": len(alive),
        "ok": proc.returncode == 128 + signal.SIGTERM
        and one_line
        and final_ok
        and stopped[-1]["step"] == final.step
        and not alive,
    }
    if not out["ok"]:
        out["stderr"] = _tail(err)
    return out


def staging_exact(s: Suite, d: Path, state: dict) -> dict:
    """In this process: save after a step, change everything at once (the next forward
    updates batch-norm statistics, the next optimizer step the parameters and moments), then
    load the checkpoint: it must hold exactly the state at the save."""
    from torch import nn

    from dynpipe.runtime.checkpoint import load_checkpoint
    from dynpipe.runtime.checkpointer import Checkpointer
    from dynpipe.runtime.optim import export_state

    dev = torch.device(s.args.device)
    width, depth = (64, 3) if s.cpu else (4096, 8)
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.BatchNorm1d(width)]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers).to(dev)
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, width, device=dev)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    ckpt = Checkpointer(d / "ck", keep=1)
    rounds, bad, stalls = 3, [], []
    for i in range(rounds):
        model_state = dict(model.state_dict())
        optim_state = export_state(opt, named)
        want = {k: v.detach().cpu().clone() for k, v in {**model_state, **optim_state}.items()}
        t0 = time.perf_counter()
        ckpt.save(
            step=i, model_state=model_state, optim_state=optim_state, meta={}, params=set(named)
        )
        stalls.append((time.perf_counter() - t0) * 1e3)
        step()  # changes every saved tensor while the copies may still run
        (rec,) = ckpt.wait()
        got = {k: torch.zeros_like(v, device="cpu") for k, v in model_state.items()}
        opt_got, _ = load_checkpoint(rec.path, model_state=got, held_params=set(named))
        got.update(opt_got)
        bad += [f"{i}:{k}" for k in want if k not in got or not torch.equal(got[k].cpu(), want[k])]
    return {
        "ok": not bad,
        "rounds": rounds,
        "tensors": len(want),
        "mismatched": bad[:10],
        "bytes": rec.bytes,
        "stall_ms": [round(t, 2) for t in stalls],
    }


def save_stall(s: Suite, d: Path, state: dict) -> dict:
    out = {}
    modes = s.args.stall_modes or (["pinned"] if s.cpu else ["pinned", "sync"])
    for mode in modes:
        s.env[STAGING_ENV] = mode
        try:
            out[mode] = _save_stall(s, d / mode, f"save_stall:{mode}")
        finally:
            s.env.pop(STAGING_ENV, None)
    first = out[modes[0]]
    return {**first, "ok": first.get("ok", False), "staging": modes[0], "modes": out}


def _save_stall(s: Suite, d: Path, name: str) -> dict:
    ck, log = d / "ck", d / "run.jsonl"
    # On GPU a save of the full model (2.6 GB) takes seconds to write and hash; a save due
    # before the last one is written waits for it, and that wait is reported apart.
    every = s.args.stall_every or (8 if s.args.quick else 40)
    steps = s.args.stall_steps or (3 * every if s.args.quick else 4 * every)
    save = ("--save-every", str(every), "--save-dir", str(ck), "--keep-checkpoints", "2")
    p = s.run(name, s.cmd(s.full, *save, "--log", str(log), steps=steps))
    if p.returncode != 0:
        return {"ok": False, "error": f"exit {p.returncode}", "stderr": _tail(p.stderr)}
    step_ms = {r["step"]: r["step_ms"] for r in read_dicts(log) if r["type"] == "step"}
    saves = [r for r in _events(log, "checkpoint") if r["step"] < steps]  # not the final wait
    # The first steps compile and warm up: the step time is the median after them.
    warm = sorted(k for k in step_ms if k >= min(every, 5))
    median_ms = statistics.median(step_ms[k] for k in warm)
    per_save = []
    for r in saves:
        # Steps that ran while this save was written (after the one it saved).
        during, t = [], 0.0
        for k in range(r["step"], steps):
            if t >= r["write_ms"] or k not in step_ms:
                break
            during.append(k)
            t += step_ms[k]
        extra = sum(step_ms[k] - median_ms for k in during)
        per_save.append(
            {
                "step": r["step"],
                "stall_ms": r["stall_ms"],
                # Blocked on the previous save's write (saves closer than a write lasts).
                "wait_ms": r.get("wait_ms", 0.0),
                "write_ms": r["write_ms"],
                "steps_during_write": len(during),
                "extra_ms_during_write": round(extra, 2),
            }
        )
    # What staging costs the training thread; a wait for the previous write is reported
    # apart (it measures the disk against the save period, not the staging).
    stalls = [x["stall_ms"] - x["wait_ms"] for x in per_save]
    later = stalls[1:] or stalls  # the first save also sets up its buffers
    worst = max(later, default=float("nan"))
    waits = [x["wait_ms"] for x in per_save]
    return {
        "ok": bool(per_save) and worst / median_ms < s.args.stall_goal,
        "model": " ".join(s.full[0]),
        "batch": s.full[1],
        "microbatches": s.full[2],
        "bf16": "--bf16" in s.full[3],
        "median_step_ms": round(median_ms, 2),
        "checkpoint_bytes": saves[0]["bytes"] if saves else None,
        "saves": per_save,
        "first_stall_ms": round(stalls[0], 2) if stalls else None,
        "stall_ms_median": round(statistics.median(later), 2) if later else None,
        "stall_ms_max": round(worst, 2),
        "stall_pct_of_step": round(100 * statistics.median(later) / median_ms, 2)
        if later
        else None,
        "stall_pct_of_step_max": round(100 * worst / median_ms, 2),
        "goal_pct": 100 * s.args.stall_goal,
        "write_ms_median": round(statistics.median(x["write_ms"] for x in per_save), 1),
        "wait_ms_max": round(max(waits, default=0.0), 2),
        "save_every_ms": round(every * median_ms, 1),
        "extra_ms_during_write_median": round(
            statistics.median(x["extra_ms_during_write"] for x in per_save), 2
        ),
    }


def oom(s: Suite, d: Path, state: dict) -> dict:
    log = d / "run.jsonl"
    if s.cpu:
        size = (["width=64", "depth=6", "at_layer=3", "at_step=3"], 32, 4, [])
        words = s.cmd(size, "--log", str(log), steps=20, model="usermodel_oom:oom_mlp")
    else:
        words = s.cmd(_OOM_GPU, "--log", str(log), steps=20)
    t0 = time.time()
    try:
        p = s.run("oom", words, timeout_s=300)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": "still running after 300 s (hang)"}
    wall = time.time() - t0
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    line = next((ln for ln in lines if "ran out of" in ln), None)
    names = line is not None and all(
        w in line for w in ("stage 0 of 1", "at step", "microbatches of", "--batch-size")
    )
    out = {
        "exit": p.returncode,
        "wall_s": round(wall, 2),
        "stderr_lines": len(lines),
        "line": line,
        "ok": p.returncode != 0 and len(lines) == 1 and names and "Traceback" not in p.stderr,
    }
    if not out["ok"]:
        out["stderr"] = _tail(p.stderr, 3000)
    return out


CASES = {
    "staging_exact": staging_exact,
    "save_resume": save_resume,
    "worker_sigkill": worker_sigkill,
    "sigterm": sigterm,
    "save_stall": save_stall,
    "oom": oom,
}


# -- summary ----------------------------------------------------------------------------------


def summary_rows(result: dict) -> list[tuple[str, str, str]]:
    """(case, what was checked, what this run gave) per case, for the Markdown table."""
    c = result["cases"]
    rows = []

    def verdict(name: str) -> str:
        return "pass" if c[name].get("ok") else "FAIL"

    def rel(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1e}"

    if "staging_exact" in c:
        r = c["staging_exact"]
        rows.append(
            (
                "save, then change everything at once",
                "the checkpoint holds exactly the state at the save (every tensor)",
                f"{verdict('staging_exact')}: {r.get('rounds')} saves of {r.get('tensors')} "
                f"tensors, {len(r.get('mismatched') or [])} mismatched",
            )
        )
    if "save_resume" in c:
        r = c["save_resume"]
        same = (
            "bit-identical"
            if r.get("bit_identical")
            else f"max rel. diff {rel(r.get('max_rel_diff'))}"
        )
        rows.append(
            (
                "save every K, resume",
                "losses after resuming step K equal the uninterrupted run's",
                f"{verdict('save_resume')}: {same} over {r.get('steps_compared', 0)} steps",
            )
        )
    if "worker_sigkill" in c:
        r = c["worker_sigkill"]
        same = (
            "bit-identical"
            if r.get("bit_identical")
            else f"max rel. diff {rel(r.get('max_rel_diff'))}"
        )
        rows.append(
            (
                "worker SIGKILL, --max-restarts 1",
                "finishes (exit 0); every step's loss equals the uninterrupted run's",
                f"{verdict('worker_sigkill')}: {same}; resumed at step {r.get('resumed_at_step')}, "
                f"{r.get('steps_redone')} steps redone, {r.get('kill_to_resumed_s')} s kill to "
                f"resumed; noise {rel(r.get('noise_max_rel_diff'))}",
            )
        )
    if "sigterm" in c:
        r = c["sigterm"]
        rows.append(
            (
                "launcher SIGTERM",
                "exit 143, one stderr line, final checkpoint, no worker left",
                f"{verdict('sigterm')}: exit {r.get('exit')}, {r.get('stderr_lines')} line(s), "
                f"final checkpoint at step {r.get('final_checkpoint_step')}, "
                f"{r.get('signal_to_exit_s')} s to exit",
            )
        )
    if "save_stall" in c:
        r = c["save_stall"]
        if "median_step_ms" in r:
            got = (
                f"{verdict('save_stall')}: stall {r['stall_ms_median']} ms median, "
                f"{r['stall_ms_max']} ms max = {r['stall_pct_of_step']}% / "
                f"{r['stall_pct_of_step_max']}% of a {r['median_step_ms']} ms step (first save "
                f"{r['first_stall_ms']} ms); write {r['write_ms_median']} ms of "
                f"{r['checkpoint_bytes'] / 1e9:.2f} GB every {r.get('save_every_ms')} ms, "
                f"waited up to {r.get('wait_ms_max')} ms for the previous write, steps "
                f"meanwhile +{r['extra_ms_during_write_median']} ms"
            )
            for mode, m in (r.get("modes") or {}).items():
                if mode != r.get("staging") and "stall_ms_median" in m:
                    got += (
                        f"; {mode} staging: {m['stall_ms_median']} ms ({m['stall_pct_of_step']}%)"
                    )
        else:
            got = f"{verdict('save_stall')}: {r.get('error')}"
        rows.append(
            (
                "async save stall",
                f"training thread blocked < {result['config']['stall_goal'] * 100:.0f}% of a step",
                got,
            )
        )
    if "oom" in c:
        r = c["oom"]
        rows.append(
            (
                "out of memory in a step",
                "one line (stage, step, batch, what to lower), non-zero exit, no hang",
                f"{verdict('oom')}: exit {r.get('exit')}, {r.get('stderr_lines')} line(s) in "
                f"{r.get('wall_s')} s",
            )
        )
    return rows


def render(result: dict) -> str:
    m = result["machine"]
    head = (
        f"{result['mode']} on {m['device_name']} (torch {m['torch']}, "
        f"{m['cpus']} CPUs), {result['wall_s']:.0f} s, revision {m.get('revision') or '?'}"
    )
    lines = [head, "", "| case | checked | result |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in summary_rows(result)]
    return "\n".join(lines) + "\n"


def _machine(device: str) -> dict:
    from dynpipe.runtime.runlog import code_revision

    cuda = device != "cpu" and torch.cuda.is_available()
    return {
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor() or "CPU",
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "revision": code_revision(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="folder for the summary and every case's logs")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="short runs (for CPU checks)")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--steps", type=int, default=None, help="steps of the fault runs")
    p.add_argument("--save-every", type=int, default=None, help="K of the fault runs")
    p.add_argument("--stall-every", type=int, default=None, help="save period of save_stall")
    p.add_argument("--stall-steps", type=int, default=None)
    p.add_argument(
        "--stall-modes",
        nargs="+",
        choices=["pinned", "sync"],
        default=None,
        help=f"{STAGING_ENV} values to time (default: pinned and sync on GPU, pinned on CPU)",
    )
    p.add_argument("--stall-goal", type=float, default=0.05, help="stall / step time goal")
    p.add_argument("--tolerance", type=float, default=1e-2, help="max relative loss diff")
    p.add_argument("--timeout", type=float, default=60.0, help="the runs' --timeout")
    p.add_argument(
        "--keep-checkpoints", action="store_true", help="keep each case's checkpoint folders"
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_faults: no CUDA device here; use --device cpu --quick", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    suite = Suite(args)
    result: dict[str, Any] = {
        "suite": "gpu_faults",
        "mode": f"{args.device}{' quick' if args.quick else ''}",
        "machine": _machine(args.device),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "cases": {},
    }
    state: dict[str, Any] = {}
    t0 = time.time()
    for name in args.cases:
        d = args.out / name
        d.mkdir(parents=True, exist_ok=True)
        t = time.time()
        try:
            got = CASES[name](suite, d, state)
        except Exception as exc:  # one case's failure is reported; the others still run
            got = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        got["case_s"] = round(time.time() - t, 1)
        if not suite.cpu:
            torch.cuda.empty_cache()  # staging_exact's memory: the next cases need the card
        if not args.keep_checkpoints:  # gigabytes on GPU; the logs and the summary stay
            for ck in sorted(d.rglob("ck"), reverse=True):
                shutil.rmtree(ck, ignore_errors=True)
        result["cases"][name] = got
        brief = {k: v for k, v in got.items() if k not in ("saves", "stderr", "modes")}
        print(f"{name}: {json.dumps(brief)}", flush=True)
    result["wall_s"] = round(time.time() - t0, 1)
    result["commands"] = {k: " ".join(v[1:]) for k, v in suite.commands.items()}
    result["machine"]["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    (args.out / "gpu_faults.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    table = render(result)
    (args.out / "gpu_faults.md").write_text(table)
    print(table)
    return 0 if all(c.get("ok") for c in result["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
