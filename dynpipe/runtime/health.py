"""Peer liveness: a heartbeat per rank in the rendezvous store, read when something fails.

A P2P receive from a dead neighbour fails (or times out) with a transport message that
names an address, not a rank. When a step fails, each surviving rank looks at the
heartbeats and names the ranks that stopped beating, so every rank's error says which peer
died.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dynpipe.runtime.topology import Topology

__all__ = ["Heartbeat", "StageFailure"]

_PREFIX = "dynpipe/hb/"


class StageFailure(RuntimeError):
    """A step failed on this rank; the message says where and which peers look dead."""


class Heartbeat:
    """Writes ``time.time()`` under this rank's key every ``interval_s`` in a side thread,
    in the topology's rendezvous store (this launch attempt's keys only)."""

    def __init__(self, *, topo: Topology, interval_s: float = 1.0) -> None:
        self.topo = topo
        self.rank = topo.rank
        self.world_size = topo.world_size
        self.interval_s = interval_s
        self._store = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        """Connect to the store (the process group's rendezvous must exist) and start beating;
        with one rank, or no store, there is no peer to watch and it does nothing."""
        if self.world_size < 2:
            return self
        self._store = self.topo.connect_store()
        if self._store is None:
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
