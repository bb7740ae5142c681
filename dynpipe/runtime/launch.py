"""Start ``dynpipe train`` workers through torchrun's elastic agent.

``dynpipe train --nproc N ...`` re-runs the same command line as N workers on this node
(``python -m dynpipe train ...`` with ``RANK``/``WORLD_SIZE`` set by the agent). For several
nodes, users call ``torchrun`` themselves with the same arguments (docs/multi-node.md).

The agent relaunches every worker when one dies, up to ``max_restarts`` times; each relaunch
resumes from the run's newest checkpoint (``dynpipe.runtime.train``). SIGTERM / SIGINT /
SIGHUP to the launcher reach the workers through the agent, which waits ``SHUTDOWN_S`` for
them to stop (at an agreed step, after a final checkpoint) before killing them; the
launcher then prints one line and exits with 128 + the signal number.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path

__all__ = ["SHUTDOWN_S", "launch_local"]

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
) -> int:
    """Run ``dynpipe train argv`` as ``nproc`` workers; returns the job's exit status.

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
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
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
        # Named only where torch has it (2.12 on): before, the agent's wait on a stop is its
        # own fixed 30 s, the same as SHUTDOWN_S.
        **_shutdown_timeout(LaunchConfig),
    )
    try:
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
        rank, failure = exc.get_first_failure()
        codes = sorted({f.exitcode for f in exc.failures.values()})
        # Exit code 2 is bad input, already reported in one line by a worker; -15 is the agent
        # stopping the remaining workers after that.
        if 2 in codes and set(codes) <= {2, -15}:
            return 2
        from dynpipe.runtime.health import OutOfMemory

        if OutOfMemory.exit_code in codes:
            return 1  # the rank that ran out of memory said where and what to lower
        tried = f" after {max_restarts} relaunches" if max_restarts else ""
        if failure.exitcode < 0:
            # Killed from outside (the OOM killer, a scheduler, a user): it printed nothing.
            how = f"was killed by {signal.Signals(-failure.exitcode).name}"
            hint = "" if max_restarts else "; --max-restarts N relaunches the workers"
        else:
            how, hint = f"exited with code {failure.exitcode}", "; its error is printed above"
        print(
            f"dynpipe train: {len(exc.failures)} of {nproc} workers failed{tried}; first: rank "
            f"{rank} {how} (exit codes {codes}){hint}",
            file=sys.stderr,
        )
        return 2 if failure.exitcode == 2 else 1
    return 0


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
