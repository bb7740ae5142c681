"""Run a function on N real processes with a gloo process group, with a hard timeout.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, each creating the
default group and calling ``fn(rank, world_size, *args)``. The group's store is hosted by the
calling process, as torchrun's agent hosts it, so it outlives any one rank. Return values come back through
files; an exception on any rank fails the test with that rank's traceback; a run that
exceeds ``timeout_s`` kills every process and fails (no test can hang).

Ranks start from a fork server that has imported torch and the runtime once per test session,
not as spawned interpreters: a spawned rank imports torch, ``torch.distributed.pipelining``
and the runtime afresh, several CPU-seconds each, and the suite starts hundreds of ranks on
two cores. The server is a clean process (it runs nothing but the imports), so a rank is as
fresh as a spawned one; the environment is the caller's at the time of the call, as with
spawn (a fork server's own would be that of when it started).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["free_port", "run_ranks"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every rank imports anyway: done once, in the fork server (a module that fails to
# import here fails in the rank, where the test sees the error).
_PRELOAD = ["torch", "torch.distributed", "dynpipe.data", "dynpipe.runtime.train"]


def _context() -> Any:
    if "forkserver" not in mp.get_all_start_methods():  # Windows
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Read when the server starts (the first call in the session); a server already started
    # by the data loader preloads less, which costs time, not correctness.
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _entry(fn, rank, world, port, out_dir, pg_timeout_s, env, args):
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    result: dict[str, Any]
    try:
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        value = fn(rank, world, *args)
        result = {"ok": True, "value": value}
    except BaseException as exc:  # reported to the parent, which fails the test
        result = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
    finally:
        with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as fh:
            pickle.dump(result, fh)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 240.0,
    pg_timeout_s: float = 60.0,
    expect_failure: bool = False,
) -> list[dict[str, Any]]:
    """Results per rank: ``{"ok": True, "value": ...}`` or ``{"ok": False, "error": ...}``."""
    import datetime

    import torch.distributed as dist

    ctx = _context()
    server = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
        wait_for_workers=False,
    )
    port = server.port
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as out:
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, r, world_size, port, out, pg_timeout_s, env, args),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.time() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.time()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if hung:
            raise AssertionError(f"ranks {hung} still running after {timeout_s:.0f}s (hang)")
        results = []
        for r in range(world_size):
            f = Path(out) / f"rank{r}.pkl"
            if f.exists():
                with open(f, "rb") as fh:
                    results.append(pickle.load(fh))
            else:
                results.append(
                    {
                        "ok": False,
                        "error": f"rank {r} died without a result (exit code {procs[r].exitcode})",
                    }
                )
    if not expect_failure:
        bad = [(r, res) for r, res in enumerate(results) if not res["ok"]]
        if bad:
            r, res = bad[0]
            raise AssertionError(f"rank {r} failed: {res.get('traceback') or res['error']}")
    return results


def merged_state(results: list[dict], replica: int) -> tuple[dict, dict]:
    """One replica's model and optimizer state from every rank's ``{"replica", "model",
    "optim"}`` result (each rank returns the layers it holds)."""
    m, o = {}, {}
    for r in results:
        if r["value"].get("replica") == replica:
            m.update(r["value"]["model"])
            o.update(r["value"]["optim"])
    return m, o


def assert_same_tensors(got: dict, want: dict, what: str) -> None:
    """Bit-identical tensors under the same keys."""
    import torch

    assert set(got) == set(want), what
    for k in want:
        assert torch.equal(got[k], want[k]), f"{what}: {k}"


def forced_decision(step: int, bounds, shares=None, *, ranks: int = 4):
    """A decision that moves to ``bounds`` (and batch ``shares``) after window ``step``: what
    the tests' injected policies return to force a move."""
    from dynpipe.runtime.adapt.policy import Decision

    return Decision(
        step=step + 1,
        mode="measured",
        slowdown=(1.0,) * ranks,
        current_ms=1.0,
        proposed_ms=1.0,
        pause_ms=0.0,
        moved_bytes=0,
        repartition=True,
        reason="forced",
        bounds=bounds,
        shares=shares,
    )


def replica_window(step: int, cfg, slow, cf, cb, *, k: int = 5, extra: float = 1.0):
    """What a replicated run of ``cfg`` (a ``ReplicaConfig``) measures under GPipe when
    global rank ``g``'s device runs ``slow[g]`` times slower (rank ``r pp + s`` is stage ``s``
    of replica ``r``), its layers costing ``cf`` / ``cb`` ms clean: every replica's window,
    the job's step 2% beyond its slowest replica's (the all-reduce and the optimizer) times
    ``extra`` (what no per-layer model sees). One replica's is one pipeline's window as the
    training loop hands the replica policy."""
    import dataclasses

    import numpy as np

    from dynpipe.planner.simulate import step_times
    from dynpipe.runtime.adapt.window import Window

    dp, pp = cfg.shape
    subs, pipes = [], []
    for r, m in enumerate(cfg.shares):
        f = [slow[r * pp + s] for s in range(pp)]
        lf = np.concatenate([cf[a:b] * f[s] for s, (a, b) in enumerate(cfg.bounds)])
        lb = np.concatenate([cb[a:b] * f[s] for s, (a, b) in enumerate(cfg.bounds)])
        sf = np.array([lf[a:b].sum() for a, b in cfg.bounds])
        sb = np.array([lb[a:b].sum() for a, b in cfg.bounds])
        pipe = step_times(
            sf[None], sb[None], np.zeros((1, pp - 1)), schedule="gpipe", microbatches=m
        )[0]
        pipes.append(float(pipe))
        subs.append(
            Window(
                step=step,
                bounds=cfg.bounds,
                ranks=tuple(range(pp)),
                microbatches=m,
                schedule="gpipe",
                step_ms=np.full(k, float(pipe)),
                stage_fwd_ms=np.tile(sf * m, (k, 1)),
                stage_bwd_ms=np.tile(sb * m, (k, 1)),
                layer_fwd_ms=lf,
                layer_bwd_ms=lb,
                sampled_fwd_ms=sf,
                sampled_bwd_ms=sb,
            )
        )
    return dataclasses.replace(
        subs[0],
        step_ms=np.full(k, max(pipes) * 1.02 * extra),
        replicas=tuple(subs),
        shares=cfg.shares,
        dropped=(),
        reduce_ms=np.zeros((k, dp)),
    )


def stopped_after(save_dir: str | Path, step: int) -> None:
    """Make a run that ended at ``step`` look like one stopped (killed) after it: a run
    with a save folder ends on a checkpoint of its last step, a killed one does not, so
    that final checkpoint is removed and the newest is the last periodic one."""
    import shutil

    from dynpipe.runtime.checkpoint import list_checkpoints

    done, _ = list_checkpoints(save_dir)
    final = [c for c in done if c.step == step]
    assert final, f"no checkpoint of step {step} in {save_dir}: {[c.step for c in done]}"
    for c in final:
        shutil.rmtree(c.path)
