"""Peer liveness: a heartbeat per rank in the rendezvous store, read when something fails.

A P2P receive from a dead neighbour fails (or times out) with a transport message that
names an address, not a rank. When a step fails, each surviving rank looks at the
heartbeats and names the ranks that stopped beating, so every rank's error says which peer
died.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

__all__ = ["Heartbeat", "StageFailure"]

_PREFIX = "dynpipe/hb/"


class StageFailure(RuntimeError):
    """A step failed on this rank; the message says where and which peers look dead."""


class Heartbeat:
    """Writes ``time.time()`` under this rank's key every ``interval_s`` in a side thread."""

    def __init__(self, *, rank: int, world_size: int, interval_s: float = 1.0) -> None:
        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s
        self._store = _default_store()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        if self._store is None or self.world_size < 2:
            return self
        self._beat()
        self._thread = threading.Thread(target=self._run, name="dynpipe-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s)

    def _beat(self) -> None:
        self._store.set(f"{_PREFIX}{self.rank}", repr(time.time()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # the store went away: the job is ending
                return

    def dead_peers(self, *, wait_s: float | None = None) -> list[tuple[int, float]]:
        """Ranks whose heartbeat is older than 2.5 intervals, with its age in seconds.

        Waits up to ``wait_s`` (default 3 intervals) for a just-died peer's beat to go stale.
        """
        if self._store is None:
            return []
        deadline = time.time() + (3 * self.interval_s if wait_s is None else wait_s)
        while True:
            now = time.time()
            dead = []
            for r in range(self.world_size):
                if r == self.rank:
                    continue
                key = f"{_PREFIX}{r}"
                try:
                    # check() never blocks; get() on a missing key would wait for it.
                    if not self._store.check([key]):
                        continue
                    last = float(self._store.get(key).decode())
                except Exception:
                    continue
                if now - last > 2.5 * self.interval_s:
                    dead.append((r, now - last))
            if dead or time.time() >= deadline:
                return dead
            time.sleep(self.interval_s / 2)


def _default_store():
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None
