"""``bench/predictor_transfer.py``: a shipped predictor scored on profiles it never saw,
raw and calibrated as the runtime calibrates it, with the reports' own code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_loader import ROOT, load_script

pytest.importorskip("xgboost")


def test_a_shipped_predictor_on_unseen_profiles_is_scored_calibrated_and_raw(
    tmp_path: Path,
) -> None:
    mod = load_script("bench/predictor_transfer.py")
    out = tmp_path / "transfer"
    # h200.json.gz was fitted on the older H200 files; the quieter batch-64 file is new to it.
    rc = mod.main(
        [
            str(ROOT / "predictor/h200.json.gz"),
            str(ROOT / "profiles/h200q-bs64.parquet"),
            "-o",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    res = report["results"]["condition"]
    mape = {k: v["layer"]["all"]["mape"] for k, v in res.items()}
    name = next(k for k in mape if k.endswith("+measured"))
    # Calibrated on the held stage, the predictor beats measurement alone (every layer of a
    # device slowed alike), which beats assuming no interference.
    assert mape[name] < mape["stage-mean"] < mape["none"], mape
    assert "none" not in report["splits"]["condition"]["held_out"]
    assert (out / "report.md").read_text().startswith("# `")
    assert (out / "pred_vs_measured.png").stat().st_size > 0
