"""``dynpipe demo --quick``: a real CPU interferer mid-run, at least one repartition, and a
step time that recovers while the interferer still runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timing]

# How much a busy loop on a shared 2-core machine slows a stage varies from run to run
# (the scheduler favours a process that often sleeps), and now and then it is too little
# for a move to pay within the quick demo's 40 interfered steps: up to three runs.
TRIALS = 3
# Steps from the onset to the first move. The stage timers under a busy loop swing by half
# their value from step to step here, so a modest gain waits for a second window; measured
# on this kind of machine, moves came 5-30 steps after the onset.
WITHIN = 25


def _demo(out) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "dynpipe", "demo", "--quick", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "summary" in proc.stdout
    assert (out / "log.jsonl").stat().st_size > 0
    assert (out / "figures" / "step_time.png").stat().st_size > 0
    return json.loads((out / "summary.json").read_text())


def _adapted(summary: dict) -> bool:
    start, stop = summary["interference"]["start"], summary["interference"]["stop"]
    during = [r for r in summary["repartitions"] if start <= r["step"] < stop]
    st = summary["step_ms"]
    return (
        bool(during)
        and summary["steps_to_adapt"] is not None
        and summary["steps_to_adapt"] <= WITHIN
        and st["during_after_adapting"] is not None
        # A move decided on the onset's own window leaves no steps "before adapting".
        and (
            st["during_before_adapting"] is None
            or st["during_after_adapting"] < st["during_before_adapting"]
        )
        and summary["bytes_moved"] > 0
    )


def test_demo_quick_adapts_and_recovers(tmp_path) -> None:
    seen = []
    for trial in range(TRIALS):
        summary = _demo(tmp_path / f"demo{trial}")
        if _adapted(summary):
            return
        seen.append(summary)
    pytest.fail(f"no adaptation within {WITHIN} steps of the onset in {TRIALS} runs: {seen}")
