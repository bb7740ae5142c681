"""Interferers: real processes that share a device with the job being measured.

GPU kinds: ``gemm`` (compute-bound matmul loop), ``copy`` (device-memory-bandwidth-bound
copy loop), ``train`` (a small real training job). CPU kinds: ``spin`` (busy loop) and
``membw`` (streaming over a buffer larger than the last-level cache); ``train`` also runs on
CPU. Intensity is a duty cycle: work for ``intensity * period``, sleep the rest.

    with start_interferer(kind="spin", intensity=0.5, cores=(0,)) as itf:
        ...  # measure; itf.set_intensity(1.0) changes the load without a restart

Each interferer process is its own process group and is bound to its parent (see
``workloads``): it stops on ``stop()``, on its own ``timeout_s``, on SIGTERM/SIGINT, and
when the parent dies, even by SIGKILL. The same API is used by the profiler sweeps and by
the training runtime's interference scenarios.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dynpipe.errors import UserError

__all__ = [
    "CPU_KINDS",
    "GPU_KINDS",
    "KINDS",
    "Interferer",
    "InterfererError",
    "InterfererSpec",
    "llc_bytes",
    "start_interferer",
]

GPU_KINDS = ("gemm", "copy", "train")
CPU_KINDS = ("spin", "membw", "train")
KINDS = ("gemm", "copy", "train", "spin", "membw")


class InterfererError(RuntimeError):
    """An interferer process failed to start or died unexpectedly."""


def llc_bytes() -> int:
    """The last-level cache size from sysfs (32 MiB if unknown): a ``membw`` buffer must
    exceed it to reach DRAM."""
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in base.glob("index*"):
        try:
            text = (idx / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * mult)
    return best or 32 * 2**20


def _device_type(device: str) -> str:
    return device.split(":", 1)[0]


@dataclass(frozen=True)
class InterfererSpec:
    """What to run beside the measured job. ``None`` fields take the kind's default.

    kind:        one of ``KINDS``.
    intensity:   duty cycle in [0, 1]: the fraction of each period spent working.
    count:       number of identical processes.
    device:      ``"cpu"`` or ``"cuda[:N]"``; GPU kinds need a CUDA device.
    cores:       CPU affinity of every process (``None`` leaves it to the OS scheduler).
    period_ms:   duty-cycle period; keep it below the profiler's timing sample length.
    size:        gemm: matrix side (default 8192); spin: loop trip count of one unit.
    buffer_mb:   copy / membw: size of each of the two buffers (membw default: 2x the LLC).
    dtype:       gemm element type.
    model:       train: zoo model name; ``model_config`` its keyword arguments.
    batch_size:  train: batch size of each step.
    """

    kind: str
    intensity: float = 1.0
    count: int = 1
    device: str = "cpu"
    cores: tuple[int, ...] | None = None
    period_ms: float = 25.0
    size: int | None = None
    buffer_mb: float | None = None
    dtype: str | None = None
    model: str | None = None
    model_config: dict[str, Any] = field(default_factory=dict)
    batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UserError(
                f"unknown interferer kind {self.kind!r}; valid kinds are {', '.join(KINDS)} "
                f"(GPU: {', '.join(GPU_KINDS)}; CPU: {', '.join(CPU_KINDS)})"
            )
        if not (0.0 <= float(self.intensity) <= 1.0) or math.isnan(float(self.intensity)):
            raise UserError(
                f"interferer intensity {self.intensity} is outside [0, 1]; it is a duty cycle, "
                "e.g. 0.5 works half of each period"
            )
        if int(self.count) < 1:
            raise UserError(f"interferer count {self.count} must be >= 1")
        if not (1.0 <= float(self.period_ms) <= 1000.0):
            raise UserError(f"interferer period_ms {self.period_ms} must be in [1, 1000]")
        dtype = _device_type(self.device)
        if dtype not in ("cpu", "cuda"):
            raise UserError(f"interferer device {self.device!r} must be 'cpu' or 'cuda[:N]'")
        if dtype == "cuda" and self.kind not in GPU_KINDS:
            raise UserError(
                f"interferer kind {self.kind!r} runs on CPU; on {self.device} use one of "
                f"{', '.join(GPU_KINDS)}"
            )
        if dtype == "cpu" and self.kind not in CPU_KINDS:
            raise UserError(
                f"interferer kind {self.kind!r} needs a GPU (device 'cuda:N'); on CPU use one "
                f"of {', '.join(CPU_KINDS)}"
            )
        if self.cores is not None:
            object.__setattr__(self, "cores", tuple(int(c) for c in self.cores))
            ncpu = os.cpu_count() or 1
            if not self.cores or min(self.cores) < 0 or max(self.cores) >= ncpu:
                raise UserError(
                    f"interferer cores {list(self.cores)} are not a non-empty subset of this "
                    f"machine's cores 0-{ncpu - 1}"
                )

    @property
    def condition_id(self) -> str:
        """Compact id used in datasets: ``kind@intensity x count``, e.g. ``gemm@0.5x2``."""
        return f"{self.kind}@{float(self.intensity):g}x{int(self.count)}"

    def resolved(self) -> dict[str, Any]:
        """The spec with every kind default filled in (what the process actually runs)."""
        d = asdict(self)
        gpu = _device_type(self.device) == "cuda"
        if self.kind == "gemm":
            d["size"] = self.size or 8192
            d["dtype"] = self.dtype or "bfloat16"
        elif self.kind == "spin":
            d["size"] = self.size or 20_000
        elif self.kind == "copy":
            d["buffer_mb"] = self.buffer_mb or 1024.0
        elif self.kind == "membw":
            d["buffer_mb"] = self.buffer_mb or min(max(2 * llc_bytes() / 2**20, 64.0), 1024.0)
        elif self.kind == "train":
            d["model"] = self.model or "mlp"
            if not self.model_config and d["model"] == "mlp":
                width = 2048 if gpu else 256
                d["model_config"] = {"width": width, "in_features": width, "depth": 8 if gpu else 4}
            d["batch_size"] = self.batch_size or (256 if gpu else 64)
        d["cores"] = list(self.cores) if self.cores is not None else None
        return d


class _Child:
    """One interferer process and a thread reading its status lines."""

    def __init__(self, spec: dict[str, Any], index: int) -> None:
        self.index = index
        self.lines: queue.Queue[str] = queue.Queue()
        self.ready = threading.Event()
        self.error: str | None = None
        self.stats: dict[str, Any] | None = None
        env = dict(os.environ)
        # The child imports dynpipe by module name: make sure it finds this very copy.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env.setdefault("OMP_NUM_THREADS", str(len(spec["cores"]) if spec.get("cores") else 1))
        # Own process group, so killpg reaches everything it may start, but the parent's
        # session: with autogroup scheduling a new session would get a CPU share of its own,
        # and how hard an interferer hits would depend on how the machine groups sessions.
        # In the parent's session it inherits the parent's priority and competes on equal
        # terms with the job being measured.
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynpipe.devices.workloads", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
            **group,
        )
        self.reader = threading.Thread(
            target=self._read, name=f"interferer-{self.pid}", daemon=True
        )
        self.reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            head, _, rest = line.partition(" ")
            if head == "READY":
                self.ready.set()
            elif head == "STATS":
                try:
                    self.stats = json.loads(rest)
                except json.JSONDecodeError:
                    self.stats = None
            elif head == "ERROR":
                self.error = rest
            else:
                self.lines.put(line)
        self.ready.set()  # wake any waiter: the process ended, ready or not

    def send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


def _kill_groups(pids: list[int]) -> None:
    # Last-resort cleanup at interpreter exit or garbage collection: never leave load behind.
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


class Interferer:
    """A running set of ``spec.count`` interferer processes. Use ``start_interferer``."""

    def __init__(self, spec: InterfererSpec, *, timeout_s: float | None = None) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        resolved = spec.resolved()
        resolved["timeout_s"] = timeout_s
        resolved["parent_pid"] = os.getpid()
        # PR_SET_PDEATHSIG fires when the *thread* that forked the child exits; only trust it
        # when that thread is the main one. The child's parent-pid watchdog covers the rest.
        resolved["pdeathsig"] = threading.current_thread() is threading.main_thread()
        self.resolved = resolved
        self._children: list[_Child] = []
        self._stopped = False
        self.stats: list[dict[str, Any]] = []
        try:
            for i in range(int(spec.count)):
                self._children.append(_Child(resolved, i))
        except BaseException:
            self.stop()
            raise
        # Runs at garbage collection or interpreter exit if stop() was never called.
        self._finalizer = weakref.finalize(self, _kill_groups, list(self.pids))

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else ("ready" if self.ready else "starting")
        return (
            f"Interferer({self.spec.condition_id} on {self.spec.device}, {state}, pids={self.pids})"
        )

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self._children]

    @property
    def ready(self) -> bool:
        """Every process has set itself up and is running its duty cycle."""
        return bool(self._children) and all(
            c.ready.is_set() and c.error is None and c.proc.poll() is None for c in self._children
        )

    @property
    def alive(self) -> bool:
        """At least one process is still running."""
        return any(c.proc.poll() is None for c in self._children)

    def wait_ready(self, timeout_s: float = 120.0) -> Interferer:
        """Block until every process reports ready; raise ``InterfererError`` otherwise."""
        deadline = time.monotonic() + timeout_s
        for child in self._children:
            if not child.ready.wait(max(0.0, deadline - time.monotonic())):
                self.stop()
                raise InterfererError(
                    f"{self.spec.condition_id} interferer pid {child.pid} was not ready after "
                    f"{timeout_s:g} s; raise ready_timeout_s if the device is slow to initialise"
                )
            if child.error is not None or child.proc.poll() is not None:
                child.proc.wait(timeout=5)
                self.stop()
                why = child.error or f"exited with code {child.proc.returncode}"
                raise InterfererError(
                    f"{self.spec.condition_id} interferer on {self.spec.device} failed to start: "
                    f"{why}"
                )
        return self

    def set_intensity(self, intensity: float, *, timeout_s: float = 10.0) -> None:
        """Change the duty cycle of every process; returns once each has acknowledged."""
        self.spec = replace(self.spec, intensity=float(intensity))  # validates the value
        for child in self._children:
            child.send({"intensity": float(intensity)})
        deadline = time.monotonic() + timeout_s
        for child in self._children:
            try:
                line = child.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise InterfererError(
                    f"interferer pid {child.pid} did not acknowledge intensity {intensity:g} "
                    f"within {timeout_s:g} s"
                ) from None
            if not line.startswith("ACK"):
                raise InterfererError(f"interferer pid {child.pid} answered {line!r} to a change")

    def stop(self, *, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """Stop every process (SIGTERM, then SIGKILL after ``timeout_s``) and reap it.

        Returns each process's own account: iterations, busy and wall seconds, and the
        duty cycle it achieved.
        """
        if self._stopped:
            return self.stats
        self._stopped = True
        for child in self._children:
            if child.proc.poll() is None:
                child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in self._children:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.signal_group(signal.SIGKILL)
                child.proc.wait()
            child.reader.join(timeout=1.0)
            for pipe in (child.proc.stdin, child.proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError, BrokenPipeError):
                        pipe.close()
        self.stats = [c.stats for c in self._children if c.stats is not None]
        if hasattr(self, "_finalizer"):
            self._finalizer.detach()
        return self.stats

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the processes to end by themselves (their ``timeout_s``); True if they did."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for child in self._children:
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                child.proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                return False
        return True

    def __enter__(self) -> Interferer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_interferer(
    spec: InterfererSpec | None = None,
    /,
    *,
    timeout_s: float | None = None,
    wait: bool = True,
    ready_timeout_s: float = 120.0,
    **fields: Any,
) -> Interferer:
    """Start interferer processes from a spec or from its fields (``kind=``, ``intensity=``, ...).

    ``timeout_s`` makes the processes stop by themselves; ``wait`` blocks until all are ready
    (GPU kinds take a few seconds to create their CUDA context).
    """
    if spec is None:
        if "kind" not in fields:
            raise UserError(f"start_interferer needs kind=, one of {', '.join(KINDS)}")
        spec = InterfererSpec(**fields)
    elif fields:
        spec = replace(spec, **fields)
    itf = Interferer(spec, timeout_s=timeout_s)
    if wait:
        itf.wait_ready(ready_timeout_s)
    return itf
