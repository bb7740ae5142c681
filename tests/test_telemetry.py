"""Telemetry sampler: CPU readings, the NVML path (through a stand-in NVML), degradation, cost."""

from __future__ import annotations

import math
import os
import sys
import time
import types
import warnings
from types import SimpleNamespace

import pytest

from dynpipe.devices.columns import TELEMETRY_COLUMNS
from dynpipe.devices.telemetry import TelemetrySampler, parse_device


def test_parse_device():
    assert parse_device("cpu") == ("cpu", None)
    assert parse_device("cuda") == ("cuda", 0)
    assert parse_device("cuda:3") == ("cuda", 3)
    with pytest.raises(ValueError, match="cpu"):
        parse_device("tpu:0")


def test_cpu_window_has_schema_columns_and_resets():
    with TelemetrySampler("cpu", interval_s=0.02) as s:
        time.sleep(0.3)
        w = s.window()
        assert set(w) == {*TELEMETRY_COLUMNS, "tel_samples"}
        assert w["tel_samples"] >= 1
        assert 0.0 <= w["tel_util"] <= 100.0
        assert 0.0 <= w["tel_other_util"] <= 100.0
        assert w["tel_mem_used_mb"] > 0
        for col in ("tel_mem_util", "tel_other_mem_util", "tel_throttle", "tel_power_w"):
            assert math.isnan(w[col]), col  # no such reading on a CPU
        w2 = s.window()  # a fresh window right away: never empty
        assert w2["tel_samples"] >= 1


@pytest.mark.timing
def test_cpu_sampler_ticks_on_time_and_cheaply():
    with TelemetrySampler("cpu", interval_s=0.02) as s:
        time.sleep(0.3)
        assert s.window()["tel_samples"] >= 5
        # A fresh window right away holds at most a tick or two: the window was reset.
        assert s.window()["tel_samples"] <= 3
    # The sampler's own cost per tick stays far below its 20 ms budget per tick.
    assert s.tick_cost_ms < 2.0


@pytest.mark.timing
def test_cpu_telemetry_sees_a_busy_neighbour():
    from dynpipe.devices.interfere import start_interferer

    core = (os.cpu_count() or 1) - 1
    with (
        TelemetrySampler("cpu", cores=[core], interval_s=0.05) as s,
        start_interferer(kind="spin", intensity=1.0, cores=(core,)),
    ):
        s.reset()
        time.sleep(1.3)  # spans two /proc scans
        w = s.window()
    assert w["tel_other_util"] >= 60.0, w  # this process is idle: the load is someone else's
    assert w["tel_other_procs"] >= 1.0, w


# --------------------------------------------------------------------- a stand-in NVML


class _NVMLError(Exception):
    pass


class _NotSupported(_NVMLError):
    pass


class _NotFound(_NVMLError):
    pass


def _fake_nvml(proc_pids: list[int], util_samples: dict[int, tuple[int, int]]):
    nv = types.ModuleType("pynvml")
    nv.NVMLError = _NVMLError
    nv.NVMLError_NotSupported = _NotSupported
    nv.NVMLError_NotFound = _NotFound
    nv.NVML_CLOCK_SM = 1
    nv.nvmlClocksThrottleReasonGpuIdle = 0x1
    nv.calls = {"init": 0, "proc_util": 0}
    nv.ts = 1000

    def init():
        nv.calls["init"] += 1

    nv.buffer = []

    def proc_util(handle, last_seen):
        # Like the driver: a buffer of timestamped samples, filled less often than it is read;
        # samples newer than ``last_seen`` come back, none at all is NotFound.
        nv.calls["proc_util"] += 1
        if nv.calls["proc_util"] % 3:
            nv.ts += 100_000
            nv.buffer += [
                SimpleNamespace(pid=p, timeStamp=nv.ts, smUtil=sm, memUtil=mem)
                for p, (sm, mem) in util_samples.items()
            ]
        fresh = [smp for smp in nv.buffer if smp.timeStamp > last_seen]
        if not fresh:
            raise _NotFound()
        return fresh

    nv.nvmlInit = init
    nv.nvmlShutdown = lambda: None
    nv.nvmlDeviceGetHandleByIndex = lambda i: ("gpu", i)
    nv.nvmlDeviceGetHandleByUUID = lambda u: ("gpu", u)
    nv.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(gpu=80, memory=40)
    nv.nvmlDeviceGetClockInfo = lambda h, c: 1755
    nv.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(used=10 * 2**30)

    def power(h):
        raise _NotSupported()

    nv.nvmlDeviceGetPowerUsage = power
    nv.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0x4 | 0x1  # SW power cap + idle
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: [SimpleNamespace(pid=p) for p in proc_pids]
    nv.nvmlDeviceGetProcessUtilization = proc_util
    return nv


def test_nvml_readings_and_other_processes(monkeypatch):
    me = os.getpid()
    nv = _fake_nvml([me, 111, 222], {me: (50, 30), 111: (30, 10), 222: (20, 5)})
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    s = TelemetrySampler("cuda:0")
    for _ in range(6):
        s._tick()
    w = s.window()
    assert w["tel_util"] == 80 and w["tel_mem_util"] == 40
    assert w["tel_clock_mhz"] == 1755 and w["tel_mem_used_mb"] == 10 * 1024
    assert math.isnan(w["tel_power_w"])  # not supported on this GPU: NaN, not an error
    assert w["tel_throttle"] == 1.0  # a reason other than idle
    assert w["tel_other_procs"] == 2  # ourselves excluded
    assert w["tel_other_util"] == 50 and w["tel_other_mem_util"] == 15  # sums of the others
    s.close()


def test_nvml_listed_process_without_recent_samples_counts_as_idle(monkeypatch):
    me = os.getpid()
    nv = _fake_nvml([me, 111], {me: (70, 20), 111: (40, 10)})
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    s = TelemetrySampler("cuda:0")
    s._tick()
    assert s.window()["tel_other_util"] == 40
    nv.ts += 5_000_000  # the driver moves on; process 111 stops launching kernels
    nv.buffer.append(SimpleNamespace(pid=me, timeStamp=nv.ts, smUtil=90, memUtil=30))
    nv.nvmlDeviceGetProcessUtilization = lambda h, since: [
        smp for smp in nv.buffer if smp.timeStamp > since and smp.pid == me
    ]
    for _ in range(3):  # slow readings refresh every 4th tick; these repeat the old one
        s._tick()
    s.reset()
    for _ in range(4):
        s._tick()
    w = s.window()
    assert w["tel_other_procs"] == 1 and w["tel_other_util"] == 0.0
    s.close()


def test_nvml_idle_only_is_not_throttle_and_no_others_is_zero(monkeypatch):
    me = os.getpid()
    nv = _fake_nvml([me], {me: (90, 60)})
    nv.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0x1
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    s = TelemetrySampler("cuda")
    w = s.window()
    assert w["tel_throttle"] == 0.0
    assert w["tel_other_procs"] == 0 and w["tel_other_util"] == 0.0
    s.close()


def _namespace_warnings(monkeypatch, pids: list[int]) -> tuple[dict, int]:
    """Four ticks of a sampler whose NVML lists ``pids`` (40% each): its window, and how
    many pid-namespace warnings it gave."""
    nv = _fake_nvml(pids, {p: (40, 10) for p in pids})
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    s = TelemetrySampler("cuda:0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            s._tick()
        w = s.window()
    s.close()
    return w, len([c for c in caught if "pid namespace" in str(c.message)])


def test_nvml_foreign_pid_namespace_warns_once(monkeypatch):
    w, warned = _namespace_warnings(monkeypatch, [999_991, 999_992])
    assert warned == 1
    assert w["tel_other_procs"] == 1  # one of the two is us
    assert math.isnan(w["tel_other_util"])  # cannot split the utilisation honestly


def test_nvml_not_yet_listing_this_process_is_no_foreign_namespace(monkeypatch):
    """NVML lists a new context a moment late: beside a visible process (an interferer this
    process started) that is no pid namespace, and the other process's use is read."""
    w, warned = _namespace_warnings(monkeypatch, [os.getppid()])
    assert warned == 0
    assert w["tel_other_procs"] == 1 and w["tel_other_util"] == 40.0


def test_cuda_visible_devices_maps_to_nvml_index(monkeypatch):
    nv = _fake_nvml([], {})
    seen = []
    nv.nvmlDeviceGetHandleByIndex = lambda i: seen.append(i) or ("gpu", i)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    TelemetrySampler("cuda:1").close()
    assert seen == [5]


def test_missing_nvml_degrades_to_nan_with_one_warning(monkeypatch):
    nv = _fake_nvml([], {})

    def broken_init():
        raise _NVMLError("NVML Shared Library Not Found")

    nv.nvmlInit = broken_init
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with TelemetrySampler("cuda:0", interval_s=0.02) as s:
            time.sleep(0.1)
            w = s.window()
            s.window()
    assert len(caught) == 1 and "NVML unavailable" in str(caught[0].message)
    assert all(math.isnan(w[c]) for c in TELEMETRY_COLUMNS)
    assert s.nvml_error is not None
