"""Stopping a worker on a signal, within a bounded time, and never outliving its launcher.

SIGTERM, SIGINT or SIGHUP (torchrun's agent forwards to the workers what the launcher gets)
request a stop. Training runs on to a step boundary every rank agrees on (the first rank to
see the request proposes the next boundary through the job's store), writes a final
checkpoint there when the run has a checkpoint folder, and exits with 128 + the signal
number. A stop that has not finished ``grace_s`` after the signal exits anyway, without the
checkpoint: the agent kills workers that outlast its own shutdown timeout (30 s). A second
signal more than ``_DUPLICATE_S`` after the first stops at once; one within it is the same
Ctrl-C delivered twice (by the terminal to the whole process group, then by the agent).

``bind_to_parent`` makes the kernel kill a worker when its launcher dies (Linux
``PR_SET_PDEATHSIG``), with a parent-pid watchdog for every other case.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from types import FrameType

import torch.distributed as dist

__all__ = ["GRACE_S", "StopRequest", "Stopped", "bind_to_parent"]

GRACE_S = 25.0
_DUPLICATE_S = 2.0
_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
_STOP_KEY = "dynpipe/stop_at"
_PR_SET_PDEATHSIG = 1


class Stopped(SystemExit):
    """Raised on every rank that stops for a signal; its code is 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class StopRequest:
    """Records stop signals; the training loop asks it at every step boundary."""

    def __init__(self, *, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.rank: int | None = None  # named in the messages once the worker knows it
        self.signum: int | None = None
        self.stop_at: int | None = None
        self.consistent = True
        self._first: float | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def install(self) -> StopRequest:
        """Handle the stop signals in this process (main thread only)."""
        for name in _SIGNALS:
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), self._handle)
        return self

    def request(self, signum: int) -> None:
        """What a signal does; callable directly (tests, or a store-lost callback)."""
        self._handle(signum, None)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first = signum, now
            threading.Thread(
                target=self._deadline, args=(signum,), name="dynpipe-stop-deadline", daemon=True
            ).start()
        elif now - (self._first or now) > _DUPLICATE_S:
            raise Stopped(signum)

    def _deadline(self, signum: int) -> None:
        time.sleep(self.grace_s)
        print(
            f"dynpipe train: rank {self.rank}: still running {self.grace_s:.0f}s after "
            f"{signal.Signals(signum).name}; exiting without a final checkpoint",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signum)

    def store_lost(self, lost_s: float) -> None:
        """The job's store has been unreachable for ``lost_s``: its launcher is gone."""
        print(
            f"dynpipe train: rank {self.rank}: the job's store has not answered for {lost_s:.0f}s "
            "(its launcher is gone); exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    def at_boundary(self, step: int, *, agree: bool = True) -> bool:
        """Stop before running ``step``? ``agree``: every rank stops at the same step (for
        the final checkpoint and the last log records); the first to ask proposes it."""
        if self.signum is None:
            return False
        if self.stop_at is None:
            store = _store() if agree else None
            if store is None:
                self.stop_at = step
            else:
                # Every rank is within a step of every other (each step needs them all), so
                # the boundary after the proposer's next step is ahead of everyone.
                try:
                    self.stop_at = int(store.compare_set(_STOP_KEY, "", str(step + 1)).decode())
                except Exception:
                    self.stop_at, self.consistent = step, False
        if step > self.stop_at:
            self.consistent = False  # the others stopped earlier: no common step to save
        return step >= self.stop_at


def _store():
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def bind_to_parent(*, use_pdeathsig: bool = True) -> None:
    """Exit when the parent process (the launcher's agent) dies, however it dies."""
    parent = os.getppid()
    if use_pdeathsig and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            # SIGKILL: the launcher is gone, so is the store every graceful path needs.
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:
            pass  # the watchdog below still covers us
    if os.getppid() != parent:
        os._exit(1)  # the parent died before we bound to it

    def watchdog() -> None:
        # PDEATHSIG follows the *thread* that forked us; the poll covers every other case.
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watchdog, name="dynpipe-parent-watchdog", daemon=True).start()
