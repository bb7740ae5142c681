"""Start ``dynpipe train`` workers through torchrun's elastic agent.

``dynpipe train --nproc N ...`` re-runs the same command line as N workers on this node
(``python -m dynpipe train ...`` with ``RANK``/``WORLD_SIZE`` set by the agent). For several
nodes, users call ``torchrun`` themselves with the same arguments (docs/multi-node.md).

Workers start from a fork server that has imported torch and the training code once: a
worker started as a fresh interpreter spends several CPU-seconds importing torch and
``torch.distributed.pipelining`` (5.6 s on a 2-core VM), which N workers on a small machine
pay N times over. The server runs nothing but those imports (no tensor work, no CUDA), so a
worker it forks is as fresh as a spawned one.

The agent relaunches every worker when one dies, up to ``max_restarts`` times; each relaunch
resumes from the run's newest checkpoint (``dynpipe.runtime.train``). SIGTERM / SIGINT /
SIGHUP to the launcher reach the workers through the agent, which waits ``SHUTDOWN_S`` for
them to stop (at an agreed step, after a final checkpoint) before killing them; the
launcher then prints one line and exits with 128 + the signal number.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["SHUTDOWN_S", "launch_local", "record_exit", "start_fork_server"]

# What every worker imports: done once, in the fork server (with the entry's own module).
_PRELOAD = ["torch", "torch.distributed", "dynpipe.runtime.train"]

# How long the agent waits for stopping workers before it kills them; the workers give up
# on their final checkpoint a few seconds earlier (signals.GRACE_S).
SHUTDOWN_S = 30


def _shutdown_timeout(config_type: type) -> dict[str, int]:
    fields = {f.name for f in dataclasses.fields(config_type)}
    return {"shutdown_timeout": SHUTDOWN_S} if "shutdown_timeout" in fields else {}


def launch_local(
    argv: list[str],
    *,
    nproc: int,
    max_restarts: int = 0,
    checkpoint_dir: str | Path | None = None,
    log: str | Path | None = None,
    entry: Callable[[list[str], str], None] | None = None,
) -> int:
    """Run ``dynpipe train argv`` as ``nproc`` workers; returns the job's exit status.

    ``entry(argv, exits)``: the worker, forked from the fork server (it records its exit
    status with ``record_exit``); without it, or where workers cannot be forked, each worker
    is ``python -m dynpipe train argv``.

    The agent's own failure report (a table per failed rank) is replaced by one line: each
    worker already printed its error, and the first failing rank is named here.
    ``checkpoint_dir``: where the run saves, to name its final checkpoint after a stop;
    ``log``: the run log, whose ``stopped`` event names it.
    """
    started = time.time()
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # torch's elastic loggers each carry their own level: quiet every one of them.
    # (torch.multiprocessing's: the workers' processes when they are forked, whose clean-up
    # after a failed worker would otherwise add a line per stopped peer.)
    quiet = ("torch.distributed", "torch.multiprocessing")
    for name in [n for n in logging.root.manager.loggerDict if n.startswith(quiet)]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    for name in ("torch.distributed.elastic", "torch.multiprocessing.spawn"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    run_id = f"dynpipe-{uuid.uuid4().hex[:8]}"
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.2,
        # No log folder at all (torch's default leaves an empty torchelastic_* in the temp
        # directory on every launch): each worker prints its own errors to the console.
        logs_specs=DefaultLogsSpecs(log_dir=os.devnull),
        start_method=_start_method() if entry is not None else "spawn",
        # Named only where torch has it (2.12 on): before, the agent's wait on a stop is its
        # own fixed 30 s, the same as SHUTDOWN_S.
        **_shutdown_timeout(LaunchConfig),
    )
    with tempfile.TemporaryDirectory(prefix="dynpipe-exits-") as exits:
        try:
            if config.start_method == "forkserver":
                start_fork_server(entry.__module__)
                elastic_launch(config, entry)(list(argv), exits)
            else:
                elastic_launch(config, sys.executable)("-m", "dynpipe", "train", *argv)
        except SignalException as exc:
            sig = signal.Signals(exc.sigval)
            print(
                f"dynpipe train: stopped by {sig.name}; "
                f"{_final_checkpoint(checkpoint_dir, run_id, log=log, since=started)}",
                file=sys.stderr,
            )
            return 128 + int(sig)
        except ChildFailedError as exc:
            failures = _failures(exc, Path(exits))
            return _report(failures, nproc=nproc, max_restarts=max_restarts)
    return 0


def _failures(exc: Any, exits: Path) -> dict[int, tuple[float, int]]:
    """Every failed rank of the last attempt: (when, exit code). The agent reports the
    workers it found failed at one poll (a forked worker's context stops at the first it
    sees); the workers' own exit records (``record_exit``) complete that, so the launcher's line
    names the rank that failed first whichever order the agent saw them in."""
    out = {r: (f.timestamp, f.exitcode) for r, f in exc.failures.items()}
    attempts: dict[int, dict[int, tuple[float, int]]] = {}
    for f in exits.glob("rank*-attempt*"):
        rank, attempt = (int(x) for x in f.name[4:].split("-attempt"))
        code, when = f.read_text().split()
        attempts.setdefault(attempt, {})[rank] = (float(when), int(code))
    if attempts:
        last = attempts[max(attempts)]
        out.update({r: v for r, v in last.items() if v[1] != 0})
    return out


def _report(failures: dict[int, tuple[float, int]], *, nproc: int, max_restarts: int) -> int:
    """The job's exit status after failed workers, and its one line where no worker has
    said it all already."""
    from dynpipe.runtime.health import OutOfMemory, StageFailure

    codes = sorted({code for _, code in failures.values()})
    # Stopped by the agent after another worker failed, or failed because another did.
    stopped = {-15, 128 + 15, StageFailure.peer_exit_code}
    # Exit code 2 is bad input, already reported in one line by a worker.
    if 2 in codes and set(codes) <= {2} | stopped:
        return 2
    if OutOfMemory.exit_code in codes:
        return 1  # the rank that ran out of memory said where and what to lower
    first = [r for r in failures if failures[r][1] not in stopped]
    if not first and StageFailure.peer_exit_code in codes:
        # The worker whose failure the others echo printed it, and was stopped before its
        # own exit was recorded: its line is the job's.
        return 1
    rank = min(first or failures, key=lambda r: failures[r][0])
    code = failures[rank][1]
    tried = f" after {max_restarts} relaunches" if max_restarts else ""
    if code < 0:
        # Killed from outside (the OOM killer, a scheduler, a user): it printed nothing.
        how = f"was killed by {signal.Signals(-code).name}"
        hint = "" if max_restarts else "; --max-restarts N relaunches the workers"
    else:
        how, hint = f"exited with code {code}", "; its error is printed above"
    print(
        f"dynpipe train: {len(failures)} of {nproc} workers failed{tried}; first: rank "
        f"{rank} {how} (exit codes {codes}){hint}",
        file=sys.stderr,
    )
    return 2 if code == 2 else 1


def _start_method() -> str:
    """``forkserver`` where this platform has it and CUDA is not initialised in this
    process; otherwise each worker is a fresh interpreter (the agent's own way)."""
    import torch

    return "spawn" if torch.cuda.is_initialized() or not _can_fork() else "forkserver"


def _can_fork() -> bool:
    import multiprocessing as mp
    from multiprocessing import util

    if "forkserver" not in mp.get_all_start_methods():
        return False
    # The server listens on a Unix socket in the temporary directory, whose path the
    # kernel limits to 107 bytes: a long TMPDIR leaves the workers to start fresh.
    return len(os.path.join(util.get_temp_dir(), "listener-12345678")) <= 100


def start_fork_server(entry_module: str) -> None:
    """Start the workers' fork server now, importing torch, the training code and
    ``entry_module``, unless it runs already. Called before the launcher validates its
    input, the server's imports run beside the launcher's own (on 2 cores the first
    worker starts 3-4 s sooner); a launcher that then fails has it stopped at exit."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    if not _can_fork() or getattr(forkserver._forkserver, "_forkserver_pid", None):
        return
    mp.set_forkserver_preload([*_PRELOAD, entry_module])
    forkserver.ensure_running()
    atexit.register(_stop_fork_server)


def _stop_fork_server() -> None:
    """Kill the fork server (it holds no state). Left to stop by itself when the launcher
    exits, it runs its interpreter's clean-up of torch's modules (1.4 s on a 2-core VM)
    while still holding the launcher's stdout and stderr: whoever reads them waits."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError, ChildProcessError):
        server._stop()


def record_exit(exits: str, code: int) -> None:
    """A forked worker's exit status, for the launcher (``_failures``)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    with contextlib.suppress(OSError):
        (Path(exits) / f"rank{os.environ['RANK']}-attempt{attempt}").write_text(
            f"{code} {time.time()}"
        )


def _final_checkpoint(
    directory: str | Path | None,
    run_id: str,
    *,
    log: str | Path | None = None,
    since: float = 0.0,
) -> str:
    if directory is None:
        return "no checkpoint written (no --save-dir)"
    stopped = _stopped(log, since=since)
    if stopped is not None and stopped.get("checkpoint"):
        # What the workers stopped on: a stop at a step a periodic save had just written
        # makes no second checkpoint of that step, so its marker says "periodic".
        return f"final checkpoint {stopped['checkpoint']} (step {stopped['step']})"
    from dynpipe.runtime.checkpoint import newest_checkpoint

    info = newest_checkpoint(directory, run_id=run_id)
    if info is None:
        return f"no checkpoint of this run in {directory}"
    if str(info.meta.get("reason", "")).startswith("stop:"):
        return f"final checkpoint {info.path} (step {info.step})"
    return f"no final checkpoint; the newest is {info.path} (step {info.step})"


def _stopped(log: str | Path | None, *, since: float) -> dict | None:
    """The run log's last ``stopped`` event written after ``since`` (None if there is none).
    Read as plain JSON lines from the end: a worker killed while writing may leave half a
    line."""
    if log is None or not Path(log).is_file():
        return None
    try:
        lines = Path(log).read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if '"stopped"' not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == "stopped" and float(rec.get("time", 0)) >= since:
            return rec
    return None
