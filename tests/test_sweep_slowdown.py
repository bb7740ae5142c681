"""``bench/sweep_slowdown.py`` over committed oracle sweeps: every split of the sweep paired
with itself clean and under the interferer, on the interfered stage."""

from __future__ import annotations

from pathlib import Path

from script_loader import load_script

LOGS = Path(__file__).resolve().parents[1] / "analysis" / "logs" / "oracle-h200x4-01d66a4"


def test_every_split_is_read_on_the_interfered_stage() -> None:
    tool = load_script("bench/sweep_slowdown.py")
    stage, rows = tool.slowdowns(LOGS / "gpt-w2048-gemm-s1")
    assert stage == 1
    assert len(rows) == 13  # gpt's 14 layers: every 2-stage split
    assert [u for u, _, _ in rows] == sorted(u for u, _, _ in rows)
    # The stage that holds one layer is barely busy; the one that holds most, nearly always.
    assert rows[0][2] == "13|1" and rows[0][0] < 0.05 and rows[-1][0] > 0.9
    # `gemm` slows a busy device more than a barely busy one; `copy` does not.
    busy = [s for u, s, _ in rows if u > 0.8]
    light = [s for u, s, _ in rows if 0.1 < u < 0.4]
    assert min(busy) > max(light)
    _, copy = tool.slowdowns(LOGS / "gpt-w2048-copy-s0")
    assert max(s for u, s, _ in copy if u > 0.1) - min(s for u, s, _ in copy if u > 0.1) < 0.1


def test_a_folder_without_a_sweep_is_skipped(tmp_path) -> None:
    assert load_script("bench/sweep_slowdown.py").slowdowns(tmp_path) is None
