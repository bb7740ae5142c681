"""Peer liveness: a heartbeat per rank in the rendezvous store, read when something fails.

A P2P receive from a dead neighbour fails (or times out) with a transport message that
names an address, not a rank. When a step fails, each surviving rank asks the heartbeats
for a verdict on every peer: *alive* if it beat after the failure, *dead* if its last beat is
older than 2.5 intervals. The transport's error often arrives before a just-killed peer's
beat has gone stale, so the verdict is waited for (a few intervals at most) instead of read
once, and every rank's error names the peer that died.

The same thread also publishes the run's progress (the last finished step) where a
relaunched worker can read it (the launcher's store outlives the workers), so a recovery
can log how many steps it lost, and it notices when that store itself has gone away.

A step that runs out of device memory is not a transport failure: ``out_of_memory`` finds
torch's error under the schedule's wrapping and turns it into one line that says where
(rank, stage, step), with what (batch, microbatch size, peak and total memory) and what to
lower. The failing rank also leaves that line in the store (``Heartbeat.failed``), so the
peers whose receives then fail name it as the cause instead of a closed connection.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from dynpipe.runtime.topology import Topology

__all__ = [
    "Heartbeat",
    "OutOfMemory",
    "StageFailure",
    "find_oom",
    "out_of_memory",
    "read_progress",
    "root_store",
]

_PREFIX = "dynpipe/hb/"
_FAILED = "dynpipe/failed/"
_WHY = "dynpipe/why/"
# torch >= 2.5 names it at the top level; before, torch.cuda.OutOfMemoryError (the same type).
_OOM_TYPES: tuple[type[BaseException], ...] = tuple(
    {t for t in (getattr(torch, "OutOfMemoryError", None), torch.cuda.OutOfMemoryError) if t}
)
# Allocation failures outside torch's allocator (a library's workspace, a kernel launch)
# come as plain RuntimeErrors.
_OOM_TEXT = re.compile(r"CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC")
_GIB = float(1 << 30)


class StageFailure(RuntimeError):
    """A step failed on this rank; the message says where and which peers look dead.

    ``quiet``: the failure of a peer that reported it itself (``Heartbeat.failed``): this
    rank's line would only repeat it, so the worker prints none.
    """

    exit_code = 1
    # The exit status of a rank whose failure is a peer's, which printed why: the launcher
    # names that peer's failure, not this one.
    peer_exit_code = 5

    def __init__(self, message: str, *, quiet: bool = False) -> None:
        super().__init__(message)
        self.quiet = quiet


class OutOfMemory(StageFailure):
    """A step ran out of device memory on this rank; the message says what to lower."""

    exit_code = 4  # the launcher prints no summary of its own for it (``launch``)


def find_oom(exc: BaseException) -> BaseException | None:
    """The out-of-memory error in ``exc`` or its causes (torch's pipelining schedule wraps
    a stage's errors in a ``RuntimeError`` of its own), if there is one."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, _OOM_TYPES) or (
            isinstance(e, RuntimeError) and _OOM_TEXT.search(str(e).split("\n", 1)[0])
        ):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def out_of_memory(
    oom: BaseException,
    *,
    rank: int,
    stage: int,
    num_stages: int,
    step: int,
    batch_size: int,
    microbatches: int,
    schedule: str,
    device: torch.device,
    lower: tuple[str, ...] = (),
) -> OutOfMemory:
    """One line for a step that ran out of memory: where, with what, and what to lower.

    ``lower``: further options that reduce a stage's memory (``--recompute``), named last.
    """
    mb = batch_size // max(1, microbatches)
    asked = re.search(r"Tried to allocate [0-9.]+ [KMGT]?i?B", str(oom))
    mem = ""
    if device.type == "cuda" and torch.cuda.is_available():
        with contextlib.suppress(Exception):
            peak = torch.cuda.max_memory_allocated(device) / _GIB
            free, total = (v / _GIB for v in torch.cuda.mem_get_info(device))
            mem = f"; peak {peak:.1f} GiB allocated of {total:.1f} GiB, {free:.1f} GiB free now"
    if schedule == "1f1b":
        fix = "lower --batch-size, or raise --microbatches (smaller microbatches)"
    else:
        fix = (
            "lower --batch-size, or raise --microbatches with --schedule 1f1b (it holds "
            "fewer microbatches' activations at once)"
        )
    if num_stages > 1:
        fix += ", or give this stage fewer layers (--plan)"
    if lower:
        fix += ", or use " + " / ".join(lower)
    return OutOfMemory(
        f"stage {stage} of {num_stages} ran out of {device.type.upper()} memory at step {step} "
        f"(batch {batch_size} as {microbatches} microbatches of {mb}, schedule {schedule}"
        f"{mem}{'; ' + asked.group(0) if asked else ''}); {fix}"
    )


class Heartbeat:
    """Writes ``time.time()`` under this rank's key every ``interval_s`` in a side thread,
    in the topology's rendezvous store (this launch attempt's keys only).

    ``progress_key``: also publish ``progress(step)`` calls under this key of the root store
    (see ``root_store``). ``on_store_lost``: called once if the store stays unreachable for
    ``store_lost_after_s`` (the process that hosted it, the launcher, has died).
    """

    def __init__(
        self,
        *,
        topo: Topology,
        interval_s: float = 1.0,
        progress_key: str | None = None,
        on_store_lost: Callable[[float], None] | None = None,
        store_lost_after_s: float = 120.0,
    ) -> None:
        self.topo = topo
        self.rank = topo.rank
        self.world_size = topo.world_size
        self.interval_s = interval_s
        self.progress_key = progress_key
        self.on_store_lost = on_store_lost
        self.store_lost_after_s = store_lost_after_s
        self._store = None
        self._root = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._progress: str | None = None
        self._published: str | None = None

    def start(self) -> Heartbeat:
        """Connect to the store (the process group's rendezvous must exist) and start beating;
        with one rank and no progress to publish, or no store, it does nothing."""
        if self.world_size < 2 and self.progress_key is None:
            return self
        self._store = self.topo.connect_store()
        if self._store is None:
            return self
        self._root = root_store(self._store) if self.progress_key else None
        if self.world_size > 1:
            self._beat()
        self._thread = threading.Thread(target=self._run, name="dynpipe-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s)

    def failed(self, reason: str) -> None:
        """Tell the peers this rank is failing and why (one line), before it exits: their
        receives from it fail next, and their errors name this reason."""
        if self._store is None:
            return
        with contextlib.suppress(Exception):
            self._store.set(f"{_WHY}{self.rank}", reason)
            self._store.set(f"{_FAILED}{self.rank}", repr(time.time()))

    def peer_failures(self) -> dict[int, str]:
        """The reasons peers gave for failing (``failed``), by rank."""
        out: dict[int, str] = {}
        if self._store is None:
            return out
        for r in range(self.world_size):
            if r == self.rank:
                continue
            with contextlib.suppress(Exception):
                if self._store.check([f"{_WHY}{r}"]):
                    out[r] = self._store.get(f"{_WHY}{r}").decode()
        return out

    def progress(self, step: int) -> None:
        """Record that ``step`` steps are done; published by the side thread (never blocks)."""
        if self._root is not None:
            self._progress = f"{step} {time.time()!r}"
            self._wake.set()

    def _beat(self) -> None:
        self._store.set(f"{_PREFIX}{self.rank}", repr(time.time()))

    def _run(self) -> None:
        next_beat = time.monotonic() + self.interval_s
        lost_since: float | None = None
        while not self._stop.is_set():
            self._wake.wait(max(0.0, next_beat - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if time.monotonic() >= next_beat:
                    if self.world_size > 1:
                        self._beat()
                    next_beat = time.monotonic() + self.interval_s
                progress = self._progress
                if progress is not None and progress != self._published:
                    self._root.set(self.progress_key, progress)
                    self._published = progress
                lost_since = None
            except Exception:
                # The store is gone: the job is ending, or its launcher died.
                lost_since = lost_since or time.monotonic()
                lost_s = time.monotonic() - lost_since
                if self.on_store_lost is not None and lost_s >= self.store_lost_after_s:
                    self.on_store_lost(lost_s)
                    return
                next_beat = time.monotonic() + self.interval_s

    def dead_peers(
        self, *, since: float | None = None, wait_s: float | None = None
    ) -> list[tuple[int, float]]:
        """Ranks whose heartbeat stopped, with the age of their last beat in seconds.

        ``since``: when the failure was seen (default now). A peer is alive once it beats
        after that or reports a failure of its own, dead once its last beat is older than
        2.5 intervals; this waits for a verdict on every peer, at most ``wait_s`` (default 4
        intervals: a peer that died just after beating is stale 2.5 intervals later). What
        was read stays known if the store goes away meanwhile (its host may be a failing
        rank that exits first).
        """
        if self._store is None:
            return []
        since = time.time() if since is None else since
        deadline = time.time() + (4 * self.interval_s if wait_s is None else wait_s)
        stale_s = 2.5 * self.interval_s
        with contextlib.suppress(Exception):
            self._store.set(f"{_FAILED}{self.rank}", repr(since))
        beats: dict[int, float] = {}
        failing: set[int] = set()
        while True:
            dead, undecided = [], 0
            for r in range(self.world_size):
                if r == self.rank or r in failing:
                    continue
                last = self._read(f"{_PREFIX}{r}")
                if last is not None:
                    beats[r] = max(last, beats.get(r, last))
                if self._read(f"{_FAILED}{r}") is not None:
                    failing.add(r)  # alive, and failing because of someone else
                    continue
                last = beats.get(r)
                if last is None or last > since:
                    continue  # never beat (not started yet) or alive after the failure
                age = time.time() - last
                if age > stale_s:
                    dead.append((r, age))
                else:
                    undecided += 1
            if not undecided or time.time() >= deadline:
                return dead
            time.sleep(min(self.interval_s / 4, max(0.0, deadline - time.time())))

    def _read(self, key: str) -> float | None:
        try:
            # check() never blocks; get() on a missing key would wait for it.
            if not self._store.check([key]):
                return None
            return float(self._store.get(key).decode())
        except Exception:
            return None


def read_progress(key: str, *, topo: Topology) -> tuple[int, float] | None:
    """``(steps done, when)`` last published under ``key`` in the root store, if any."""
    try:
        store = root_store(topo.connect_store())
        if store is None:
            return None
        if not store.check([key]):
            return None
        step, t = store.get(key).decode().split()
        return int(step), float(t)
    except Exception:
        return None


def root_store(store):
    """The store under any prefixes: under torchrun the launcher's own store, which keeps its
    keys across relaunches of the workers."""
    while store is not None and isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store
