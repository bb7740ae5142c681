"""Slowdown predictor: grouped cross-validation, report and the ``dynpipe predictor`` CLI."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from dynpipe.cli import main
from dynpipe.predictor import (
    ForestSlowdown,
    NoInterference,
    RidgeSlowdown,
    SlowdownRegressor,
    StageMean,
    crossval,
    evaluate,
    load_predictor,
)
from dynpipe.predictor.crossval import cv_folds, score
from dynpipe.predictor.synthetic import CONDITIONS, SyntheticDevice, synthetic_profiles
from dynpipe.profiler.schema import write_profiles

SMALL_XGB = {"n_estimators": 60, "max_depth": 4, "learning_rate": 0.15, "n_jobs": 1}
META = {
    "device_name": "Synthetic GPU",
    "device_type": "cuda",
    "driver": "synthetic",
    "torch_version": "synthetic",
    "date": "2025-01-01",
    "command": "synthetic_profiles()",
}


@pytest.fixture(scope="module")
def df() -> pd.DataFrame:
    return synthetic_profiles(seed=0)


@pytest.fixture(scope="module")
def ev(df):
    return evaluate(
        df,
        estimators={
            "xgb": SlowdownRegressor(**SMALL_XGB),
            "rf": ForestSlowdown(n_estimators=20, n_jobs=1),
            "ridge": RidgeSlowdown(),
            "stage-mean": StageMean(),
            "none": NoInterference(),
        },
        n_folds=4,
        calibrate=("xgb",),
    )


def test_folds_hold_out_whole_groups(df):
    cond = cv_folds(df, split="condition", n_folds=4)
    assert len(cond) == 4
    seen = set()
    for train, test in cond:
        held = set(df["condition"].iloc[test])
        assert held.isdisjoint(set(df["condition"].iloc[train]))
        seen |= held
    assert seen == set(df["condition"])
    # default: leave one condition out
    logo = cv_folds(df, split="condition")
    assert len(logo) == df["condition"].nunique()
    assert all(df["condition"].iloc[test].nunique() == 1 for _, test in logo)
    for train, test in cv_folds(df, split="model"):
        assert set(df["model"].iloc[test]).isdisjoint(set(df["model"].iloc[train]))
    for train, test in cv_folds(df, split="interferer"):
        held = set(df["interferer"].iloc[test])
        assert len(held) == 1 and "none" not in held
        assert held.isdisjoint(set(df["interferer"].iloc[train]))
        assert "none" in set(df["interferer"].iloc[train])
    assert cv_folds(df[df["model"] == "mlp_a"], split="model") is None
    assert cv_folds(df, split="device") is None
    other = synthetic_profiles(device=SyntheticDevice(device_name="Other GPU", peak_tflops=90.0))
    both = pd.concat([df, other], ignore_index=True)
    dev = cv_folds(both, split="device")
    assert len(dev) == 2
    for train, test in dev:
        assert both["device_name"].iloc[test].nunique() == 1
        assert set(both["device_name"].iloc[test]).isdisjoint(set(both["device_name"].iloc[train]))


def test_every_estimator_scored_on_every_split(ev, df):
    res = ev.summary["results"]
    assert set(res) == {"condition", "model", "interferer"}
    n_interfered = int((df["interferer"] != "none").sum())
    for split in res.values():
        assert set(split) == {"xgb", "xgb+measured", "rf", "ridge", "stage-mean", "none"}
        for name in ("xgb", "rf", "ridge", "none"):
            assert split[name]["layer"]["all"]["n"] == n_interfered
        for r in split.values():
            assert set(r["layer"]["by_kind"]) <= set(df["kind"])
            assert "none" not in r["layer"]["by_interferer"]
            assert r["stage"]["all"]["n"] > 0


def test_learned_model_beats_no_interference_on_held_out_conditions(ev):
    res = ev.summary["results"]["condition"]
    assert res["xgb"]["layer"]["all"]["mape"] < 0.8 * res["none"]["layer"]["all"]["mape"]
    assert res["xgb"]["stage"]["all"]["mape"] < 0.8 * res["none"]["stage"]["all"]["mape"]
    # Its role at run time: calibrated on the stage a device holds, it must price the other
    # layers better than measurement alone does.
    cal, sm = res["xgb+measured"], res["stage-mean"]
    assert cal["layer"]["all"]["mape"] < 0.85 * sm["layer"]["all"]["mape"]
    assert cal["stage"]["all"]["mape"] < 0.85 * sm["stage"]["all"]["mape"]


def test_calibrated_errors_by_held_out_condition_and_the_floor(ev, df):
    cal = ev.summary["results"]["condition"]["xgb+measured"]["layer"]
    assert set(cal["by_condition"]) == set(df["condition"]) - {"none"}
    assert set(cal["by_model"]) == set(df["model"])
    assert sum(v["n"] for v in cal["by_condition"].values()) == cal["all"]["n"]
    floor = ev.summary["floor"]
    # synthetic gpt blocks and mlp layers repeat: classes of identical layers exist
    assert floor["rows"] > 0 and set(floor["by_model"]) <= set(df["model"])
    same = floor["estimators"]["condition"]
    assert {"xgb", "xgb+measured", "stage-mean", "none"} <= set(same)
    # scored on the floor's rows only: fewer than all interfered rows
    assert same["xgb"]["all"]["n"] == floor["rows"]
    assert same["xgb"]["all"]["n"] < ev.summary["results"]["condition"]["xgb"]["layer"]["all"]["n"]


def test_no_interference_error_matches_hand_computation(ev, df):
    inter = df[df["interferer"] != "none"]
    ape = 100 * np.abs(inter["time_alone_ms"] - inter["time_ms"]) / inter["time_ms"]
    got = ev.summary["results"]["condition"]["none"]["layer"]["all"]["mape"]
    assert got == pytest.approx(ape.mean(), abs=1e-3)


@pytest.mark.parametrize("name", ["stage-mean", "xgb+measured"])
def test_measurement_based_scored_off_the_measured_stage(ev, name):
    sel = ev.stages["split"] == "condition"
    sm = ev.stages[sel & (ev.stages["estimator"] == name)]
    assert (sm["stage"] != sm["current_stage"]).all()
    # on a 2-stage split each stage is scored once, from the other one
    two = sm[sm["n_stages"] == 2]
    assert set(zip(two["stage"], two["current_stage"], strict=True)) == {(0, 1), (1, 0)}
    lay = ev.layers[(ev.layers["split"] == "condition") & (ev.layers["estimator"] == name)]
    assert lay["current_stage"].notna().all()


def test_rescaled_predictor_keeps_its_layer_ratios(ev):
    """xgb+measured = xgb times one factor per (run, measured stage)."""
    lay = ev.layers[ev.layers["split"] == "condition"]
    keys = ["model", "condition", "layer_index", "phase"]
    raw = lay[lay["estimator"] == "xgb"].set_index(keys)["predicted_ms"]
    cal = lay[(lay["estimator"] == "xgb+measured") & (lay["n_stages"] == 2)]
    cal = cal[cal["current_stage"] == 0].set_index(keys)["predicted_ms"]
    ratio = (cal / raw.reindex(cal.index)).groupby(level=["model", "condition"])
    assert (ratio.std().fillna(0) < 1e-9).all()


def test_score_of_perfect_predictions_is_zero(df):
    s = score(df, df["time_ms"].to_numpy())
    assert s["layer"]["all"]["mape"] == 0.0 and s["stage"]["all"]["mape"] == 0.0


def test_nested_tuning_only_sees_training_folds(df, monkeypatch):
    seen: list[set] = []
    real_fit = SlowdownRegressor.fit

    def spy(self, X, y, sample_weight=None, runs=None, groups=None):
        seen.append(set(X.index))
        return real_fit(self, X, y, sample_weight, runs, groups)

    monkeypatch.setattr(crossval, "TUNE_GRID", {"max_depth": [2, 3]})
    monkeypatch.setattr(SlowdownRegressor, "fit", spy)
    sub = df[df["model"] != "cnn_a"]
    out = evaluate(
        sub,
        # Without a spread: its own inner refits are not the search's.
        estimators={
            "xgb": SlowdownRegressor(**{**SMALL_XGB, "n_estimators": 10, "coverage": None})
        },
        splits=("condition",),
        n_folds=3,
        tune=("xgb",),
    )
    assert out.summary["tuned"] == ["xgb"]
    folds = cv_folds(sub.reset_index(drop=True), split="condition", n_folds=3)
    # per outer fold: 2 grid points x 3 inner folds, then the refit on the whole training part;
    # none of them may see a row of that outer fold's test part
    n_fits_per_outer = 2 * 3 + 1
    assert len(seen) == len(folds) * n_fits_per_outer
    for i, (_, test) in enumerate(folds):
        for rows in seen[i * n_fits_per_outer : (i + 1) * n_fits_per_outer]:
            assert not (rows & set(test))


def _write(df: pd.DataFrame, path) -> str:
    write_profiles(df, path, meta=META)
    return str(path)


def test_cli_fit_show_eval(tmp_path, capsys):
    # Small on purpose: the CLI evaluates the baselines at their default sizes.
    conds = tuple(c for c in CONDITIONS if c[0] == "none" or (c[1] == 1.0 and c[2] == 1))
    train = _write(
        synthetic_profiles(models=("mlp_a", "gpt_a"), conditions=conds, seed=0),
        tmp_path / "train.parquet",
    )
    other = _write(
        synthetic_profiles(models=("mlp_b", "gpt_b"), conditions=conds, seed=1),
        tmp_path / "other.parquet",
    )
    out = tmp_path / "p.json.gz"
    common = ["--n-jobs", "1", "--folds", "3", "--splits", "condition,model"]
    rc = main(
        [
            "predictor",
            "fit",
            train,
            "-o",
            str(out),
            "--set",
            "n_estimators=40",
            "--report",
            str(tmp_path / "fit_report"),
            *common,
        ]
    )
    assert rc == 0 and out.is_file()
    pred = load_predictor(out)
    assert pred.estimator.n_estimators == 40
    assert pred.report["primary"] == "xgb"
    assert set(pred.report["results"]) == {"condition", "model"}
    assert pred.training["metadata"]["dynpipe"][0]["device_name"] == "Synthetic GPU"

    assert main(["predictor", "show", str(out)]) == 0
    assert "tel_other_util" in capsys.readouterr().out

    rep = tmp_path / "rep"
    assert main(["predictor", "eval", str(out), other, "-o", str(rep), *common]) == 0
    printed = capsys.readouterr().out
    assert "shipped predictor, no refit" in printed
    summary = json.loads((rep / "report.json").read_text())
    assert summary["predictor"]["trained_on"] == pred.data_fingerprint
    assert summary["shipped"]["layer"]["all"]["n"] > 0
    md = (rep / "report.md").read_text()
    for name in (
        "**xgb**",
        "| xgb+measured |",
        "| rf |",
        "| ridge |",
        "| stage-mean |",
        "| none |",
    ):
        assert name in md
    assert "Held-out interference conditions" in md and "Held-out models" in md
    assert "## Calibrated per-layer accuracy, by held-out condition (xgb+measured)" in md
    assert "## Measurement floor" in md and "| siblings (floor) |" in md
    assert (rep / "pred_vs_measured.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    layers = pd.read_parquet(rep / "predictions_layers.parquet")
    assert {"measured_ms", "predicted_ms", "split", "estimator"} <= set(layers.columns)


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["predictor", "show", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err
    train = _write(synthetic_profiles(models=("mlp_a",), seed=0), tmp_path / "t.parquet")
    rc = main(
        [
            "predictor",
            "fit",
            train,
            "-o",
            str(tmp_path / "x.json"),
            "--report",
            str(tmp_path / "r"),
            "--stages",
            "two",
        ]
    )
    assert rc == 2 and "--stages" in capsys.readouterr().err
