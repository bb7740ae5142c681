"""Hand a GPU back to its owner and take it again: ``dynpipe release`` / ``dynpipe reclaim``.

A running job's run directory (the folder of its run log) holds ``elastic.json``, the ranks
the job has been asked to leave idle. ``dynpipe release --rank R RUN`` adds ``R``;
``dynpipe reclaim --rank R RUN`` removes it. The file is replaced atomically, so a reader
sees the old list or the new one, never half of one.

The job reads the file at its monitor points only (the end of every ``--monitor-every``
window), on the rank that writes the run log, and broadcasts the list to every rank, so
every rank acts on the same step. A released rank's layers move off it, with their
optimizer state, by the same live migration as any repartition, before the next step: a
request made during step ``s`` leaves the rank empty from step ``s + monitor_every`` at the
latest, after one migration pause. The job never stops: the rank keeps its process and its
place in the process groups, idle, until reclaimed; a reclaimed rank takes layers again at
the next monitor point. Only adapting runs (``--adapt measured`` or ``adaptive``, one
pipeline) read requests.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from dynpipe.errors import UserError

__all__ = ["REQUEST_FILE", "read_released", "register", "request"]

REQUEST_FILE = "elastic.json"


def _run_dir(run: str | Path) -> Path:
    p = Path(run)
    if p.is_file():
        p = p.parent  # the run log itself
    if not p.is_dir():
        raise UserError(
            f"run directory {p} does not exist; give the folder of the run's log "
            "(the --log path's folder, runs/<model>-<time>/ by default)"
        )
    return p


def read_released(run_dir: str | Path) -> frozenset[int]:
    """The ranks the job is asked to leave idle (empty without a request file)."""
    path = Path(run_dir) / REQUEST_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return frozenset()
    except (OSError, json.JSONDecodeError):
        return frozenset()  # unreadable: act on nothing rather than on a guess
    return frozenset(int(r) for r in data.get("released", []))


def _world_size(run: Path, run_dir: Path) -> int | None:
    log = run if run.is_file() else run_dir / "log.jsonl"
    if not log.is_file():
        return None
    with log.open() as fh:
        first = fh.readline()
    try:
        return int(json.loads(first).get("world_size"))
    except (ValueError, TypeError, AttributeError):
        return None


def request(
    run: str | Path, *, release: int | None = None, reclaim: int | None = None
) -> list[int]:
    """Add ``release`` to, or remove ``reclaim`` from, the run's released ranks; returns
    them. The rank is checked against the run log's world size where there is one."""
    run_dir = _run_dir(run)
    rank = release if release is not None else reclaim
    if rank is None or (release is not None and reclaim is not None):
        raise UserError("give exactly one of release= or reclaim=")
    world = _world_size(Path(run), run_dir)
    if rank < 0 or (world is not None and rank >= world):
        hi = f"0–{world - 1}" if world is not None else ">= 0"
        raise UserError(f"rank {rank} is not a rank of this run ({hi}); give one of those")
    released = set(read_released(run_dir))
    if release is not None:
        released.add(rank)
    else:
        released.discard(rank)
    if world is not None and len(released) >= world:
        raise UserError(
            f"releasing rank {rank} would leave none of the {world} ranks to train on; "
            f"reclaim one of {sorted(released - {rank})} first"
        )
    path = run_dir / REQUEST_FILE
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"released": sorted(released)}) + "\n")
    os.replace(tmp, path)  # atomic: the job reads the old list or the new one
    return sorted(released)


def register(sub: argparse._SubParsersAction) -> None:
    for name, verb in (("release", "hand back"), ("reclaim", "take again")):
        p = sub.add_parser(
            name,
            help=f"ask a running job to {verb} one rank's GPU",
            description=(
                "Ask a running job to move every layer off a rank and leave it idle "
                "(release), or to use it again (reclaim). The job acts at its next monitor "
                "point: within --monitor-every steps plus one migration; it never stops."
                if name == "release"
                else "Give a released rank back to a running job: it takes layers again at "
                "the job's next monitor point."
            ),
        )
        p.add_argument("run", help="the run's directory (the folder of its log.jsonl)")
        p.add_argument("--rank", type=int, required=True, help="the rank (its GPU) to act on")
        p.set_defaults(func=_run, verb=name)


def _run(args: argparse.Namespace) -> int:
    kw = {"release": args.rank} if args.verb == "release" else {"reclaim": args.rank}
    released = request(args.run, **kw)
    print(f"released ranks now: {released or 'none'} (the job acts at its next monitor point)")
    return 0
