"""Start ``dynpipe train`` workers through torchrun's elastic agent.

``dynpipe train --nproc N ...`` re-runs the same command line as N workers on this node
(``python -m dynpipe train ...`` with ``RANK``/``WORLD_SIZE`` set by the agent). For several
nodes, users call ``torchrun`` themselves with the same arguments (see the README).
"""

from __future__ import annotations

import logging
import sys
import uuid

__all__ = ["launch_local"]


def launch_local(argv: list[str], *, nproc: int, max_restarts: int = 0) -> int:
    """Run ``dynpipe train argv`` as ``nproc`` workers; returns the job's exit status.

    The agent's own failure report (a table per failed rank) is replaced by one line: each
    worker already printed its error, and the first failing rank is named here.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"dynpipe-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.2,
    )
    try:
        elastic_launch(config, sys.executable)("-m", "dynpipe", "train", *argv)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        codes = sorted({f.exitcode for f in exc.failures.values()})
        # Exit code 2 is bad input, already reported in one line by a worker; -15 is the agent
        # stopping the remaining workers after that.
        if 2 in codes and set(codes) <= {2, -15}:
            return 2
        print(
            f"dynpipe train: {len(exc.failures)} of {nproc} workers failed; first: rank {rank} "
            f"with exit code {failure.exitcode} (exit codes {codes}); its error is printed above",
            file=sys.stderr,
        )
        return 2 if failure.exitcode == 2 else 1
    return 0
