"""``dynpipe demo --quick``: a real CPU interferer mid-run, at least one repartition, and a
step time that recovers while the interferer still runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_quick_adapts_and_recovers(tmp_path) -> None:
    out = tmp_path / "demo"
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
    summary = json.loads((out / "summary.json").read_text())
    start, stop = summary["interference"]["start"], summary["interference"]["stop"]
    during = [r for r in summary["repartitions"] if start <= r["step"] < stop]
    assert during, summary
    assert summary["steps_to_adapt"] is not None and summary["steps_to_adapt"] <= 15, summary
    st = summary["step_ms"]
    assert st["during_after_adapting"] < st["during_before_adapting"], st
    assert summary["bytes_moved"] > 0
    assert (out / "log.jsonl").stat().st_size > 0
    assert (out / "figures" / "step_time.png").stat().st_size > 0
