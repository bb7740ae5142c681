"""Device telemetry sampled in a side thread: what a running stage can observe about its device.

``TelemetrySampler`` ticks at ~20 Hz and accumulates one reading per tick; ``window()``
returns the means of the ``tel_*`` columns (``columns``) since the previous window
and starts a new one. The profiler stores these means beside each measured layer time; the
training runtime reads the same window every few steps, so the predictor sees at run time
exactly the features it was trained on.

GPU readings come from NVML (nvidia-ml-py); CPU readings from ``/proc`` through psutil,
restricted to the cores the process may run on. A reading the platform lacks is NaN, and a
missing NVML gives one warning, never an error.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import warnings
from collections.abc import Iterable
from typing import Any

from dynpipe.devices.columns import TELEMETRY_COLUMNS, empty_telemetry

__all__ = ["TelemetrySampler", "parse_device"]

_NAN = float("nan")
_PERCENT = ("tel_util", "tel_mem_util", "tel_other_util", "tel_other_mem_util")
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def parse_device(device: Any) -> tuple[str, int | None]:
    """``"cpu"`` / ``"cuda"`` / ``"cuda:1"`` / ``torch.device`` -> ``(type, index)``."""
    text = str(device)
    kind, _, idx = text.partition(":")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"telemetry device {text!r} must be 'cpu' or 'cuda[:N]'")
    if kind == "cpu":
        return "cpu", None
    return "cuda", int(idx) if idx else 0


class _CpuProbe:
    """Utilisation of our cores and of the other processes running on them."""

    def __init__(self, cores: Iterable[int], pid: int, scan_interval_s: float) -> None:
        import psutil

        self._psutil = psutil
        self.cores = sorted(set(cores))
        self.pid = pid
        self.scan_interval_s = scan_interval_s
        self._last_cpu = self._core_times()
        self._last_own = self._own_cpu_s()
        self._last_t = time.perf_counter()
        self._proc_ticks: dict[int, int] = {}
        self._last_scan = 0.0
        self._other_procs = _NAN
        self._freq = _NAN
        self._mem_used_mb = _NAN
        self._scan()

    def _core_times(self) -> list[tuple[float, float]]:
        per = self._psutil.cpu_times(percpu=True)
        out = []
        for c in self.cores:
            t = per[c]
            idle = t.idle + getattr(t, "iowait", 0.0)
            out.append((sum(t), idle))
        return out

    def _own_cpu_s(self) -> float:
        if self.pid == os.getpid():
            t = os.times()
            return t.user + t.system
        try:
            t = self._psutil.Process(self.pid).cpu_times()
            return t.user + t.system
        except self._psutil.Error:
            return _NAN

    def _scan(self) -> None:
        # Other processes that used CPU since the last scan and last ran on one of our cores.
        # Read /proc directly: psutil's per-process objects cost ~10x more per process.
        now = time.perf_counter()
        dt = now - self._last_scan if self._last_scan else 0.0
        self._last_scan = now
        ticks: dict[int, int] = {}
        active = 0
        try:
            names = os.listdir("/proc")
        except OSError:
            names = []
        cores = set(self.cores)
        for name in names:
            if not name.isdigit():
                continue
            pid = int(name)
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    raw = f.read()
            except OSError:
                continue
            # Fields after the ')' that closes the command name; see proc(5).
            rest = raw[raw.rfind(b")") + 2 :].split()
            try:
                used = int(rest[11]) + int(rest[12])
                last_cpu = int(rest[36])
            except (IndexError, ValueError):
                continue
            ticks[pid] = used
            if pid == self.pid or dt <= 0:
                continue
            # A pid absent from the previous scan started since then: all its time is new.
            if used > self._proc_ticks.get(pid, 0) and last_cpu in cores:
                active += 1
        self._proc_ticks = ticks
        if dt > 0:
            self._other_procs = float(active)
        # Slow-moving readings share the scan's cadence: each costs as much as a whole tick.
        self._mem_used_mb = self._psutil.virtual_memory().used / 2**20
        try:
            per = self._psutil.cpu_freq(percpu=True)
            vals = [per[c].current for c in self.cores if c < len(per) and per[c].current]
            self._freq = sum(vals) / len(vals) if vals else _NAN
        except (AttributeError, NotImplementedError, OSError):
            self._freq = _NAN

    def read(self) -> dict[str, float]:
        now = time.perf_counter()
        cpu = self._core_times()
        own = self._own_cpu_s()
        dt = now - self._last_t
        busy = 0.0
        total = 0.0
        for (tot1, idle1), (tot0, idle0) in zip(cpu, self._last_cpu, strict=True):
            total += tot1 - tot0
            busy += (tot1 - tot0) - (idle1 - idle0)
        util = 100.0 * busy / total if total > 0 else _NAN
        own_pct = 100.0 * (own - self._last_own) / (dt * len(self.cores)) if dt > 0 else _NAN
        self._last_cpu, self._last_own, self._last_t = cpu, own, now
        # Until the first count exists, scan again soon: a short first window needs one.
        wait = self.scan_interval_s if not math.isnan(self._other_procs) else 0.1
        if now - self._last_scan >= wait:
            self._scan()
        # /proc/stat counts 10 ms clock ticks, so one 50 ms tick is coarse; it is left
        # unclamped here so the window mean is unbiased, and clamped in window().
        other = util - own_pct if not math.isnan(own_pct) else _NAN
        return {
            "tel_util": util,
            "tel_clock_mhz": self._freq,
            "tel_mem_used_mb": self._mem_used_mb,
            "tel_other_procs": self._other_procs,
            "tel_other_util": other,
        }


class _NvmlProbe:
    """NVML readings for one GPU, with the other processes told apart by pid.

    Utilisation is read every tick; the slower-moving readings (clock, memory, power,
    throttle reasons, the process list and per-process utilisation, which the driver itself
    samples only a few times a second) every ``slow_every`` ticks and repeated in between:
    each NVML call costs a fraction of a millisecond of CPU.
    """

    _LOOKBACK_US = 1_000_000  # per-process samples: the latest within this window counts

    def __init__(
        self, index: int, own_pids: set[int], self_on_device: bool, slow_every: int = 4
    ) -> None:
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.handle = self._handle(index)
        self.own_pids = own_pids
        self.self_on_device = self_on_device
        self.slow_every = max(1, int(slow_every))
        self._dead: set[str] = set()  # readings this GPU does not support: not retried
        self._last_ts = 0
        self._warned_ns = False
        self._ticks = 0
        self._slow: dict[str, float] = {}
        self._proc_util()  # learn where the driver's sample clock is

    def _handle(self, index: int):
        # CUDA numbers the visible devices; NVML numbers all of them.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        visible = [v.strip() for v in visible if v.strip()]
        if index < len(visible):
            ident = visible[index]
            if ident.isdigit():
                return self.nv.nvmlDeviceGetHandleByIndex(int(ident))
            return self.nv.nvmlDeviceGetHandleByUUID(ident)
        return self.nv.nvmlDeviceGetHandleByIndex(index)

    def _try(self, name: str, fn, *args):
        if name in self._dead:
            return None
        try:
            return fn(*args)
        except self.nv.NVMLError_NotSupported:
            self._dead.add(name)
        except self.nv.NVMLError:
            pass
        return None

    def _proc_util(self) -> dict[int, tuple[float, float]] | None:
        """Latest (SM %, memory %) per pid within the look-back window; None if unknown.

        The cursor trails the newest sample seen by the look-back, so a process whose samples
        carry slightly older timestamps than ours is not skipped for good.
        """
        since = max(0, self._last_ts - self._LOOKBACK_US)
        try:
            samples = self.nv.nvmlDeviceGetProcessUtilization(self.handle, since)
        except self.nv.NVMLError_NotSupported:
            self._dead.add("proc_util")
            return None
        except self.nv.NVMLError:  # NotFound: no sample in the window, every process idle
            return {} if self._last_ts else None
        latest: dict[int, tuple[int, float, float]] = {}
        for smp in samples:
            ts = int(smp.timeStamp)
            self._last_ts = max(self._last_ts, ts)
            if smp.pid not in latest or ts >= latest[smp.pid][0]:
                latest[smp.pid] = (ts, float(smp.smUtil), float(smp.memUtil))
        return {pid: (sm, mem) for pid, (_, sm, mem) in latest.items()}

    def _read_slow(self) -> dict[str, float]:
        nv = self.nv
        out: dict[str, float] = {}
        clock = self._try("clock", nv.nvmlDeviceGetClockInfo, self.handle, nv.NVML_CLOCK_SM)
        if clock is not None:
            out["tel_clock_mhz"] = float(clock)
        mem = self._try("mem", nv.nvmlDeviceGetMemoryInfo, self.handle)
        if mem is not None:
            out["tel_mem_used_mb"] = mem.used / 2**20
        power = self._try("power", nv.nvmlDeviceGetPowerUsage, self.handle)
        if power is not None:
            out["tel_power_w"] = power / 1000.0
        reasons_fn = (
            getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        reasons = self._try("throttle", reasons_fn, self.handle)
        if reasons is not None:
            idle = getattr(nv, "nvmlClocksThrottleReasonGpuIdle", 1)
            out["tel_throttle"] = 1.0 if int(reasons) & ~int(idle) else 0.0
        procs = self._try("procs", nv.nvmlDeviceGetComputeRunningProcesses, self.handle)
        if procs is not None:
            out.update(self._others({int(p.pid) for p in procs}))
        return out

    def _others(self, pids: set[int]) -> dict[str, float]:
        others = pids - self.own_pids
        if (
            pids
            and self.self_on_device
            and not pids & self.own_pids
            and any(not os.path.exists(f"/proc/{p}") for p in pids)
        ):
            # NVML reports pids of another pid namespace (containers): we cannot tell which
            # process is us, so we count ourselves out but cannot split the utilisation.
            # Only where a listed pid is not one this process can see: where every listed
            # process is visible here, this one is just not listed (yet: NVML may list a
            # new context late), and the others' use is theirs.
            if not self._warned_ns:
                warnings.warn(
                    "NVML lists GPU processes by pids this process cannot see (pid namespace); "
                    "tel_other_util / tel_other_mem_util will be NaN. Run with --pid=host to "
                    "separate other jobs' utilisation",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._warned_ns = True
            return {"tel_other_procs": float(len(pids) - 1)}
        out = {"tel_other_procs": float(len(others))}
        if not others:
            out.update(tel_other_util=0.0, tel_other_mem_util=0.0)
            return out
        per = self._proc_util() if "proc_util" not in self._dead else None
        if per is not None:
            # A listed process without a sample in the look-back window ran no kernel.
            vals = [per.get(p, (0.0, 0.0)) for p in others]
            out["tel_other_util"] = min(100.0, sum(v[0] for v in vals))
            out["tel_other_mem_util"] = min(100.0, sum(v[1] for v in vals))
        return out

    def read(self) -> dict[str, float]:
        out = empty_telemetry()
        rates = self._try("util", self.nv.nvmlDeviceGetUtilizationRates, self.handle)
        if rates is not None:
            out["tel_util"] = float(rates.gpu)
            out["tel_mem_util"] = float(rates.memory)
        if self._ticks % self.slow_every == 0:
            self._slow = self._read_slow()
        self._ticks += 1
        out.update(self._slow)
        return out

    def close(self) -> None:
        with contextlib.suppress(self.nv.NVMLError):
            self.nv.nvmlShutdown()


class TelemetrySampler:
    """Samples device telemetry every ``interval_s`` in a daemon thread.

    device:         ``"cpu"`` or ``"cuda[:N]"`` (the device our work runs on).
    cores:          CPU cores to watch (default: this process's affinity).
    interval_s:     tick period; 0.05 s gives 20 Hz.
    own_pids:       pids counted as "us" besides this process (e.g. sibling stage workers).
    self_on_device: this process has a context on the GPU (so NVML lists it).
    scan_interval_s: how often the CPU probe scans /proc for other processes.

    ``window()`` returns the per-column means since the previous ``window()`` plus
    ``tel_samples`` (ticks behind them); NaN readings are skipped, a column with no readings
    is NaN. ``tick_cost_ms`` is the measured CPU time of one tick (the sampler's overhead).
    """

    def __init__(
        self,
        device: Any = "cpu",
        *,
        cores: Iterable[int] | None = None,
        interval_s: float = 0.05,
        own_pids: Iterable[int] = (),
        self_on_device: bool = True,
        scan_interval_s: float = 0.5,
    ) -> None:
        self.device_type, self.device_index = parse_device(device)
        self.interval_s = float(interval_s)
        pid = os.getpid()
        if cores is None:
            cores = (
                os.sched_getaffinity(0)
                if hasattr(os, "sched_getaffinity")
                else range(os.cpu_count() or 1)
            )
        self.cores = sorted(set(cores))
        self._lock = threading.Lock()
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._ticks = 0
        self._tick_s = 0.0
        self._tick_n = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._cpu = _CpuProbe(self.cores, pid, scan_interval_s)
        self._gpu: _NvmlProbe | None = None
        self.nvml_error: str | None = None
        if self.device_type == "cuda":
            try:
                self._gpu = _NvmlProbe(
                    self.device_index or 0, {pid, *map(int, own_pids)}, self_on_device
                )
            except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, bad index
                self.nvml_error = f"{type(exc).__name__}: {exc}"
                warnings.warn(
                    f"NVML unavailable ({self.nvml_error}); GPU telemetry columns will be NaN",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def sample(self) -> dict[str, float]:
        """One reading of every ``tel_*`` column, taken now (not added to the window)."""
        out = empty_telemetry()
        if self.device_type == "cpu":
            out.update(self._cpu.read())
        elif self._gpu is not None:
            out.update(self._gpu.read())
        return out

    def _tick(self) -> None:
        t0 = time.thread_time()
        reading = self.sample()
        cost = time.thread_time() - t0
        with self._lock:
            for key, val in reading.items():
                if not math.isnan(val):
                    self._sums[key] = self._sums.get(key, 0.0) + val
                    self._counts[key] = self._counts.get(key, 0) + 1
            self._ticks += 1
            self._tick_s += cost
            self._tick_n += 1

    def _loop(self) -> None:
        next_t = time.perf_counter()
        while not self._stop.is_set():
            self._tick()
            next_t += self.interval_s
            delay = next_t - time.perf_counter()
            if delay < 0:  # fell behind (a loaded machine): do not burst to catch up
                next_t = time.perf_counter()
                delay = 0.0
            self._stop.wait(delay)

    def start(self) -> TelemetrySampler:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="telemetry", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2.0)
            self._thread = None

    def close(self) -> None:
        self.stop()
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None

    def __enter__(self) -> TelemetrySampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset(self) -> None:
        """Drop what has accumulated: the next window starts now."""
        with self._lock:
            self._sums.clear()
            self._counts.clear()
            self._ticks = 0

    def window(self) -> dict[str, float]:
        """Means of every ``tel_*`` column since the last call, and ``tel_samples``; resets."""
        with self._lock:
            empty = self._ticks == 0
        if empty:
            self._tick()  # a window shorter than one tick still gets a reading
        with self._lock:
            out: dict[str, float] = {
                key: (self._sums[key] / self._counts[key] if self._counts.get(key) else _NAN)
                for key in TELEMETRY_COLUMNS
            }
            for key in _PERCENT:
                if not math.isnan(out[key]):
                    out[key] = min(100.0, max(0.0, out[key]))
            out["tel_samples"] = self._ticks
            self._sums.clear()
            self._counts.clear()
            self._ticks = 0
        return out

    @property
    def tick_cost_ms(self) -> float:
        """Mean CPU time of one tick so far: the sampler's own load on the device it watches."""
        with self._lock:
            return 1e3 * self._tick_s / self._tick_n if self._tick_n else _NAN
