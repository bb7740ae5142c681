"""The interfering workloads, run as ``python -m dynpipe.devices.workloads SPEC_JSON``.

One process per interferer. It sets itself up (buffers, CUDA context, one warm-up unit),
prints ``READY``, then alternates bursts of work with sleeps so that the fraction of wall
time spent working is the requested intensity. A burst repeats whole work units until it has
lasted ``intensity * period``; the sleep after it is scaled to the burst actually done, so
the duty cycle holds even when one unit is longer than the period.

Protocol on the pipes (one line each):
  child -> parent: ``READY <pid>``, ``ACK <intensity>``, ``STATS <json>``, ``ERROR <text>``
  parent -> child: ``{"intensity": x}`` (change the duty cycle without a restart)

The process ends on SIGTERM/SIGINT, at its own deadline, when its stdin closes, or when
its parent dies (``PR_SET_PDEATHSIG`` plus a parent-pid watchdog), so it never outlives
the process that started it. GPU kinds import torch here, in the child, only.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["main"]

_PR_SET_PDEATHSIG = 1
_GRACE_S = 3.0  # after a stop request, a unit stuck in a long call gets this long


class _State:
    # Plain attributes, no locks: the signal handler writes them, so it must never block.
    def __init__(self, intensity: float) -> None:
        self.intensity = intensity
        self.stopping = False


def _emit(line: str) -> None:
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        pass  # the parent is gone; the watchdog ends us


def _stop_self() -> None:
    # Every stop request goes through the SIGTERM handler, so there is one path to an exit.
    os.kill(os.getpid(), signal.SIGTERM)


def _bind_to_parent(parent_pid: int, use_pdeathsig: bool) -> None:
    if use_pdeathsig and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except OSError:
            pass  # the watchdog below still covers us
    if os.getppid() != parent_pid:
        os._exit(0)  # the parent died before we could bind to it

    def watchdog() -> None:
        # PDEATHSIG follows the *thread* that forked us; the poll covers every other case,
        # and the hard exit covers a main thread stuck in a long native call.
        while os.getppid() == parent_pid:
            time.sleep(0.25)
        _stop_self()
        time.sleep(_GRACE_S)
        os._exit(0)

    threading.Thread(target=watchdog, name="parent-watchdog", daemon=True).start()


def _control_reader(state: _State) -> None:
    for line in sys.stdin:
        try:
            msg = json.loads(line)
            value = float(msg["intensity"])
        except (ValueError, KeyError, TypeError):
            _emit(f"ERROR bad control line {line.strip()!r}")
            continue
        state.intensity = min(max(value, 0.0), 1.0)
        _emit(f"ACK {state.intensity:g}")
    _stop_self()  # stdin closed: the parent is gone or done with us


def _sleep(state: _State, seconds: float) -> None:
    end = time.perf_counter() + seconds
    while not state.stopping:
        left = end - time.perf_counter()
        if left <= 0:
            return
        time.sleep(min(left, 0.01))


# --------------------------------------------------------------------------- work units


def _cpu_spin(spec: dict[str, Any]) -> Callable[[], None]:
    n = int(spec.get("size") or 20_000)

    def unit() -> None:
        x = 0
        for i in range(n):
            x += i

    return unit


def _cpu_membw(spec: dict[str, Any]) -> Callable[[], None]:
    import numpy as np

    nbytes = int(float(spec["buffer_mb"]) * 2**20)
    chunk = 8 * 2**20 // 8
    src = np.ones(nbytes // 8, dtype=np.float64)  # ones, not empty: fault every page in now
    dst = np.zeros_like(src)
    pos = [0]

    def unit() -> None:
        # Walk the buffers a chunk at a time so a burst can stop on time and every byte of a
        # larger-than-cache buffer is streamed in turn.
        a = pos[0]
        b = min(a + chunk, src.size)
        np.copyto(dst[a:b], src[a:b])
        pos[0] = 0 if b >= src.size else b

    return unit


def _torch_device(spec: dict[str, Any]):
    import torch

    dev = torch.device(spec["device"])
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"{spec['kind']} interferer needs CUDA but torch sees no GPU")
        dev = torch.device("cuda", dev.index or 0)
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    return torch, dev


def _gpu_gemm(spec: dict[str, Any]) -> Callable[[], None]:
    torch, dev = _torch_device(spec)
    n = int(spec["size"])
    dtype = getattr(torch, spec["dtype"])
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    c = torch.empty(n, n, device=dev, dtype=dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def unit() -> None:
        torch.mm(a, b, out=c)
        sync()  # the burst must measure device time, not launch time

    return unit


def _gpu_copy(spec: dict[str, Any]) -> Callable[[], None]:
    torch, dev = _torch_device(spec)
    nbytes = int(float(spec["buffer_mb"]) * 2**20)
    src = torch.ones(nbytes // 4, device=dev, dtype=torch.float32)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def unit() -> None:
        dst.copy_(src)
        sync()

    return unit


def _train(spec: dict[str, Any]) -> Callable[[], None]:
    torch, dev = _torch_device(spec)
    from dynpipe.models import get_model

    model = get_model(spec["model"], **spec.get("model_config", {}))
    net = model.build_sequential(device=dev)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    x, y = model.input_spec.example(int(spec["batch_size"]), device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def unit() -> None:
        opt.zero_grad(set_to_none=True)
        loss = model.loss_fn(net(x), y)
        loss.backward()
        opt.step()
        sync()

    return unit


_UNITS: dict[str, Callable[[dict[str, Any]], Callable[[], None]]] = {
    "spin": _cpu_spin,
    "membw": _cpu_membw,
    "gemm": _gpu_gemm,
    "copy": _gpu_copy,
    "train": _train,
}


def _run(unit: Callable[[], None], state: _State, period_s: float, deadline: float) -> dict:
    iters = 0
    busy = 0.0
    t_start = time.perf_counter()
    while not state.stopping and time.perf_counter() < deadline:
        duty = state.intensity
        if duty <= 0.0:
            _sleep(state, period_s)
            continue
        target = duty * period_s
        t0 = time.perf_counter()
        while True:
            unit()
            iters += 1
            burst = time.perf_counter() - t0
            if burst >= target or state.stopping:
                break
        busy += burst
        if duty < 1.0:
            _sleep(state, burst * (1.0 - duty) / duty)
    wall = time.perf_counter() - t_start
    return {
        "iters": iters,
        "busy_s": round(busy, 4),
        "wall_s": round(wall, 4),
        "duty": round(busy / wall, 4) if wall > 0 else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    state = _State(float(spec["intensity"]))

    def on_signal(signum: int, frame: Any) -> None:
        state.stopping = True
        signal.alarm(int(_GRACE_S))  # default SIGALRM action ends a unit that never returns

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    cores = spec.get("cores")
    if cores:
        os.sched_setaffinity(0, cores)  # first: threads started below inherit it
    _bind_to_parent(int(spec["parent_pid"]), bool(spec.get("pdeathsig", True)))
    try:
        unit = _UNITS[spec["kind"]](spec)
        unit()  # warm-up: first CUDA kernel, page faults, allocator
    except Exception as exc:
        _emit(f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return 1
    timeout = spec.get("timeout_s")
    deadline = time.perf_counter() + float(timeout) if timeout else float("inf")
    threading.Thread(target=_control_reader, args=(state,), name="control", daemon=True).start()
    _emit(f"READY {os.getpid()}")
    stats = _run(unit, state, float(spec["period_ms"]) / 1e3, deadline)
    _emit("STATS " + json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
