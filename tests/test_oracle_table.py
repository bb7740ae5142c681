"""``bench/oracle_table.py``: the README's oracle table is drawn from result files only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]


def _module():
    return load_script("bench/oracle_table.py")


def _doc(rev: str, adaptive: list[float], static_ms: float = 100.0) -> dict:
    systems = lambda r: {  # noqa: E731
        "static": {"ms": static_ms, "ratio": static_ms / 50.0},
        "adaptive": {"ms": 50.0 * r, "ratio": r},
    }
    return {
        "config": {"config": "vgg16-b128", "interferer": ["gemm"], "stages": [1], "nproc": 2,
                   "warmup": 10, "onset": 80, "end": 160, "steps": 240},
        "revision": rev,
        "device": "NVIDIA H200",
        "phases": {p: {"oracle": {"split": [5, 11], "ms": 50.0}, "systems": systems(r)}
                   for p, r in zip(("clean", "interference", "after"), adaptive, strict=True)},
    }  # fmt: skip


def test_the_newest_run_of_a_configuration_is_its_row(tmp_path, monkeypatch, capsys) -> None:
    mod = _module()
    monkeypatch.setattr(mod, "_commit_time", {"old": 1, "new": 2}.get)
    for rev, ratios in (("new", [1.02, 1.2, 1.04]), ("old", [1.5, 1.5, 1.5])):
        (tmp_path / f"oracle-{rev}.json").write_text(json.dumps(_doc(rev, ratios)))
    assert mod.main(sorted(str(p) for p in tmp_path.iterdir())) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| vgg16")]
    assert len(rows) == 1 and "`new`" in rows[0]
    # Within the goal in bold, the rest plain; the split's bar escaped inside its cell.
    assert "**1.020** / 1.200 / **1.040**" in rows[0]
    assert "5\\|11 50.0" in rows[0]
    # Adaptive's worst phase against static: 60 ms against 100.
    assert rows[0].endswith("| – / 0.600 |")


def test_since_an_unknown_revision_is_one_clear_error(tmp_path, capsys) -> None:
    mod = _module()
    (tmp_path / "oracle-x.json").write_text(json.dumps(_doc("x", [1.0, 1.0, 1.0])))
    assert mod.main([str(tmp_path / "oracle-x.json"), "--since", "0000000deadbeef"]) == 2
    assert "git does not know" in capsys.readouterr().err


@pytest.mark.parametrize("goal", [1.0, 1.5])
def test_the_goal_sets_what_is_bold(tmp_path, capsys, goal) -> None:
    mod = _module()
    (tmp_path / "oracle-x.json").write_text(json.dumps(_doc("x", [1.2, 1.2, 1.2])))
    mod.main([str(tmp_path / "oracle-x.json"), "--goal", str(goal)])
    out = capsys.readouterr().out
    assert ("**1.200**" in out) == (goal >= 1.2)


def test_factors_print_choice_times_execution_where_the_report_has_them(tmp_path, capsys) -> None:
    mod = _module()
    doc = _doc("x", [1.1, 1.0, 1.0])
    doc["phases"]["clean"]["systems"]["adaptive"] |= {"choice": 1.0, "execution": 1.1}
    (tmp_path / "oracle-x.json").write_text(json.dumps(doc))
    assert mod.main([str(tmp_path / "oracle-x.json"), "--factors"]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| vgg16"))
    # measured ran no phase; adaptive's phases without factors print a dash.
    assert row.endswith("| – | 1.000 x 1.100 / – / – |")
