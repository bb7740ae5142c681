"""Interferer processes: readiness, duty cycle, clean stop, and no orphans in any exit path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from dynpipe.devices.interfere import InterfererSpec, start_interferer
from dynpipe.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
LAST_CORE = (os.cpu_count() or 1) - 1


def _gone(pid: int) -> bool:
    """Not running any more: reaped, or a zombie waiting for its (new) parent to reap it."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], timeout_s: float = 8.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [p for p in left if not _gone(p)]
        time.sleep(0.05)
    return left


def test_spec_validation_is_one_line():
    with pytest.raises(UserError) as err:
        InterfererSpec(kind="gemmm")
    msg = str(err.value)
    assert "gemmm" in msg and "gemm, copy, train, spin, membw" in msg and "\n" not in msg
    with pytest.raises(UserError, match="outside"):
        InterfererSpec(kind="spin", intensity=1.5)
    with pytest.raises(UserError, match="needs a GPU"):
        InterfererSpec(kind="gemm", device="cpu")
    with pytest.raises(UserError, match="runs on CPU"):
        InterfererSpec(kind="spin", device="cuda:0")
    with pytest.raises(UserError, match="cores"):
        InterfererSpec(kind="spin", cores=(os.cpu_count() or 1,))
    assert InterfererSpec(kind="copy", intensity=0.5, count=2, device="cuda").condition_id == (
        "copy@0.5x2"
    )


def test_start_ready_set_intensity_and_clean_stop():
    itf = start_interferer(kind="spin", intensity=0.3, count=2, cores=(LAST_CORE,), period_ms=20)
    try:
        assert itf.ready and itf.alive and len(itf.pids) == 2
        for pid in itf.pids:
            proc = psutil.Process(pid)
            assert proc.cpu_affinity() == [LAST_CORE]
            assert os.getpgid(pid) == pid  # its own process group
        time.sleep(0.6)
        itf.set_intensity(0.3)  # acknowledged by every process
    finally:
        stats = itf.stop()
    assert not itf.alive
    assert _wait_gone(itf.pids, 0.1) == []
    assert len(stats) == 2
    for s in stats:
        # The duty cycle is measured in wall time, so it holds on a loaded core too.
        assert 0.15 <= s["duty"] <= 0.5, s
        assert s["iters"] > 0


def test_membw_and_context_manager():
    with start_interferer(kind="membw", intensity=1.0, buffer_mb=16, cores=(LAST_CORE,)) as itf:
        assert itf.ready
        time.sleep(0.3)
        pids = itf.pids
    assert _wait_gone(pids, 0.1) == []
    assert itf.stats and itf.stats[0]["iters"] > 0


def test_own_timeout_ends_processes():
    itf = start_interferer(kind="spin", intensity=0.2, count=2, timeout_s=0.5)
    assert itf.wait(timeout_s=10), "interferers ignored their own timeout"
    assert not itf.alive
    assert _wait_gone(itf.pids, 1.0) == []
    itf.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_child_cleanly(sig):
    itf = start_interferer(kind="spin", intensity=0.5, cores=(LAST_CORE,))
    pid = itf.pids[0]
    time.sleep(0.3)  # inside its duty loop
    os.kill(pid, sig)
    assert itf.wait(timeout_s=5)
    # A clean exit: the child reported what it did before leaving.
    assert itf._children[0].proc.returncode == 0
    itf.stop()
    assert itf.stats and itf.stats[0]["wall_s"] > 0 and itf.stats[0]["iters"] > 0


def test_failed_start_is_reported():
    # A GPU kind on a machine without CUDA (or a CPU-only torch) fails in the child.
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from dynpipe.devices.interfere import InterfererError

    with pytest.raises(InterfererError, match="failed to start"):
        start_interferer(kind="gemm", device="cuda:0", ready_timeout_s=60)


_PARENT = textwrap.dedent(
    """
    import json, sys, threading, time
    from dynpipe.devices.interfere import start_interferer
    box = {}
    def go():
        box["itf"] = start_interferer(kind="spin", intensity=0.3, count=2)
    if sys.argv[1] == "thread":
        # Started from a thread that then ends: PR_SET_PDEATHSIG would fire on that
        # thread's exit, so only the parent-pid watchdog may end the children.
        t = threading.Thread(target=go); t.start(); t.join()
    else:
        go()
    print(json.dumps(box["itf"].pids), flush=True)
    time.sleep(120)
    """
)


@pytest.mark.parametrize("where", ["main", "thread"])
def test_no_orphans_when_parent_is_sigkilled(where):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, where], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        line = parent.stdout.readline()
        pids = json.loads(line)
        assert len(pids) == 2
        time.sleep(0.5)  # past the start-up: the children are in their duty loop
        assert all(not _gone(p) for p in pids), "children died before the parent"
        parent.kill()
        parent.wait(timeout=10)
        left = _wait_gone(pids, 8.0)
        assert left == [], f"orphans {left} outlived their SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_interferer_started_in_thread_survives_thread_exit():
    # The converse of the SIGKILL test: a thread that starts an interferer and ends must not
    # take the interferer with it.
    box = {}
    t = threading.Thread(
        target=lambda: box.setdefault("itf", start_interferer(kind="spin", intensity=0.2))
    )
    t.start()
    t.join()
    itf = box["itf"]
    try:
        time.sleep(0.6)
        assert itf.alive and itf.ready
    finally:
        itf.stop()
    assert _wait_gone(itf.pids, 0.1) == []


def test_cli_interfere_runs_until_timeout(capsys):
    from dynpipe.cli import main

    rc = main(
        [
            "interfere",
            "--kind",
            "spin",
            "--intensity",
            "0.2",
            "--timeout",
            "0.5",
            "--cores",
            str(LAST_CORE),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "ready: spin@0.2x1" in out and "stopped:" in out


def test_cli_interfere_unknown_kind(capsys):
    from dynpipe.cli import main

    rc = main(["interfere", "--kind", "nope"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and "'nope'" in err and "spin" in err
