"""Slowdown predictor: features, estimators, persistence, stages and the run-time API."""

from __future__ import annotations

import json
import pickle
import pickletools
import warnings

import numpy as np
import pandas as pd
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.model_selection import GridSearchCV, GroupKFold

from dynpipe.errors import UserError
from dynpipe.predictor import (
    ForestSlowdown,
    NoInterference,
    RidgeSlowdown,
    SlowdownRegressor,
    StageMean,
    extract_features,
    fit_predictor,
    load_predictor,
    predict_layer_times,
    prepare_layers,
    rescale_to_measured,
    save_predictor,
)
from dynpipe.predictor.features import (
    NUMERIC_STATIC,
    NUMERIC_STATIC_V1,
    NUMERIC_WORK,
    FeatureSchema,
)
from dynpipe.predictor.floor import sibling_floor
from dynpipe.predictor.io import Predictor, dataset_fingerprint
from dynpipe.predictor.stages import (
    assign_stages,
    balanced_ranges,
    measured_stage_slowdown,
    run_ids,
    stage_sums,
)
from dynpipe.predictor.synthetic import synthetic_profiles
from dynpipe.profiler.schema import COLUMNS

SMALL_XGB = {"n_estimators": 60, "max_depth": 4, "learning_rate": 0.15, "n_jobs": 1}


@pytest.fixture(scope="module")
def df() -> pd.DataFrame:
    return synthetic_profiles(seed=0)


@pytest.fixture(scope="module")
def xy(df):
    X, schema = extract_features(df)
    return X, df["slowdown"].to_numpy(), schema


@pytest.fixture(scope="module")
def predictor(df):
    return fit_predictor(df, estimator="xgb", params=SMALL_XGB)


# ---------------------------------------------------------------- features


def test_synthetic_follows_profile_schema(df):
    assert set(COLUMNS) <= set(df.columns)
    none = df[df["interferer"] == "none"]
    np.testing.assert_allclose(none["slowdown"], 1.0)


def test_features_are_static_plus_telemetry_only(df, xy):
    X, _, schema = xy
    assert list(X.columns) == schema.names
    for label in ("interferer", "intensity", "n_jobs", "condition"):
        assert label not in X.columns and not any(c.startswith(label) for c in X.columns)
    assert schema.telemetry == tuple(c for c in COLUMNS if c.startswith("tel_"))
    # No feature names a model or a layer: the layer-kind label is not one.
    assert not [c for c in X.columns if c.startswith("kind_")] and schema.kinds == ()
    np.testing.assert_array_equal(X[["phase_fwd", "phase_bwd"]].sum(axis=1), 1.0)
    row = df.iloc[5]
    nbytes = row["work_bytes"]
    assert X.iloc[5]["log_flops"] == pytest.approx(np.log10(1 + row["work_flops"]))
    assert X.iloc[5]["log_arith_intensity"] == pytest.approx(np.log10(row["work_flops"] / nbytes))
    assert X.iloc[5]["log_time_alone_ms"] == pytest.approx(np.log10(row["time_alone_ms"]))
    # The rates the layer achieves alone: what tells a launch-bound layer from a busy one.
    rate = row["work_flops"] / row["time_alone_ms"]
    assert X.iloc[5]["log_flops_per_ms"] == pytest.approx(np.log10(1 + rate))
    assert X.iloc[5]["log_bytes_per_ms"] == pytest.approx(
        np.log10(1 + nbytes / row["time_alone_ms"])
    )
    assert X.iloc[5]["log_ms_per_launch"] == pytest.approx(
        np.log10(row["time_alone_ms"] / row["work_launches"])
    )
    assert X.iloc[5]["bytes_share_matmul"] == row["work_bytes_matmul"]


def test_extract_features_is_pure_and_follows_schema_order(df, xy):
    X, _, schema = xy
    before = df.copy()
    shuffled = df[list(reversed(df.columns))].sample(frac=1.0, random_state=1)
    X2, schema2 = extract_features(shuffled, schema=schema)
    pd.testing.assert_frame_equal(df, before)
    assert schema2 is schema
    pd.testing.assert_frame_equal(X2.loc[X.index], X)


def test_telemetry_mismatch_names_missing_and_extra(df, xy):
    _, _, schema = xy
    bad = df.drop(columns=["tel_power_w"]).assign(tel_fan_rpm=1.0)
    with pytest.raises(UserError, match="missing tel_power_w; extra tel_fan_rpm") as info:
        extract_features(bad, schema=schema)
    assert "\n" not in str(info.value)
    # Bookkeeping columns of the profiler are not telemetry readings.
    X, _ = extract_features(df.assign(tel_samples=12), schema=schema)
    assert "tel_samples" not in X.columns


def test_missing_static_column_and_bad_alone_time(df):
    with pytest.raises(UserError, match="flops"):
        extract_features(df.drop(columns=["flops"]))
    with pytest.raises(UserError, match="1 of"):
        extract_features(df.assign(time_alone_ms=np.r_[0.0, df["time_alone_ms"].to_numpy()[1:]]))


def test_kind_label_is_no_feature_and_old_schemas_warn(df, xy):
    X, _, schema = xy
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        X2, _ = extract_features(df.head(4).assign(kind="mamba"), schema=schema)
    pd.testing.assert_frame_equal(X2, X.head(4))
    # Schema-2 files (a one-hot of the label) still read, and warn on a label they lack.
    old = FeatureSchema(kinds=("conv", "linear"), telemetry=schema.telemetry, version=2)
    with pytest.warns(UserWarning, match="mamba"):
        X3, _ = extract_features(df.head(4).assign(kind="mamba"), schema=old)
    assert (X3[["kind_conv", "kind_linear"]].to_numpy() == 0).all()


def test_schema_round_trips_as_dict(xy):
    _, _, schema = xy
    assert FeatureSchema.from_dict(schema.to_dict()) == schema
    assert schema.names[: len(NUMERIC_WORK)] == list(NUMERIC_WORK)
    v2 = FeatureSchema.from_dict({**schema.to_dict(), "kinds": ["conv"], "version": 2})
    assert v2.names[: len(NUMERIC_STATIC) + 1] == [*NUMERIC_STATIC, "kind_conv"]
    # Predictors saved before the achieved rates were features keep their columns.
    old = FeatureSchema.from_dict({**schema.to_dict(), "kinds": ["conv"], "version": 1})
    assert old.names[: len(NUMERIC_STATIC_V1)] == list(NUMERIC_STATIC_V1)
    assert old.names[len(NUMERIC_STATIC_V1)].startswith("kind_")
    with pytest.raises(UserError, match="version 9"):
        FeatureSchema.from_dict({**schema.to_dict(), "version": 9})


# ---------------------------------------------------------------- estimators


ALL = [
    SlowdownRegressor(**SMALL_XGB),
    ForestSlowdown(n_estimators=20, n_jobs=1),
    RidgeSlowdown(alpha=0.5),
    NoInterference(),
]


@pytest.mark.parametrize("est", ALL, ids=lambda e: type(e).__name__)
def test_sklearn_conventions(est, xy):
    X, y, _ = xy
    fresh = clone(est)
    assert fresh.get_params() == est.get_params()
    assert not [k for k in vars(fresh) if k.endswith("_")], "__init__ must only store params"
    with pytest.raises(NotFittedError):
        fresh.predict(X)
    assert fresh.fit(X, y) is fresh
    assert list(fresh.feature_names_in_) == list(X.columns)
    pred = fresh.predict(X)
    assert pred.shape == (len(X),) and (pred > 0).all()
    if fresh.min_slowdown is not None:
        assert (pred >= fresh.min_slowdown).all()
    # clone of a fitted estimator is unfitted with the same hyper-parameters
    with pytest.raises(NotFittedError):
        clone(fresh).predict(X)


def test_learned_models_fit_the_data_better_than_no_interference(xy):
    X, y, _ = xy
    err = {type(e).__name__: np.mean(np.abs(clone(e).fit(X, y).predict(X) - y) / y) for e in ALL}
    assert err["SlowdownRegressor"] < 0.5 * err["NoInterference"]
    assert err["ForestSlowdown"] < 0.5 * err["NoInterference"]


def test_grid_search_with_grouped_folds(df, xy):
    X, y, _ = xy
    groups = df["condition"].to_numpy()
    search = GridSearchCV(
        SlowdownRegressor(**SMALL_XGB),
        {"max_depth": [2, 4], "learning_rate": [0.1, 0.3]},
        cv=GroupKFold(n_splits=3),
        scoring="neg_mean_absolute_percentage_error",
    )
    search.fit(X, y, groups=groups)
    assert search.best_params_["max_depth"] in (2, 4)
    assert isinstance(search.best_estimator_, SlowdownRegressor)
    assert search.predict(X).shape == (len(X),)


def test_monotone_in_other_process_utilisation(xy):
    X, y, _ = xy
    est = SlowdownRegressor(**SMALL_XGB).fit(X, y)
    assert est.monotone_constraints_["tel_other_util"] == 1
    rng = np.random.default_rng(0)
    base = X.iloc[rng.choice(len(X), 40, replace=False)]
    grid = np.linspace(0, 100, 21)
    for col, sign in (("tel_other_util", 1), ("tel_other_mem_util", 1), ("tel_clock_mhz", -1)):
        values = grid if col != "tel_clock_mhz" else np.linspace(1500, 2100, 21)
        sweep = pd.concat([base.assign(**{col: v}) for v in values])
        pred = est.predict(sweep).reshape(len(values), len(base))
        steps = sign * np.diff(pred, axis=0)
        assert (steps >= -1e-9).all(), f"prediction not monotone in {col}"
    # Unconstrained, the same model goes the wrong way somewhere: the constraint does work.
    free = SlowdownRegressor(**{**SMALL_XGB, "monotone": None}).fit(X, y)
    assert free.monotone_constraints_ == {}
    sweep = pd.concat([base.assign(tel_other_util=v) for v in grid])
    pred = free.predict(sweep).reshape(len(grid), len(base))
    assert (np.diff(pred, axis=0) < -1e-9).any()


def test_shape_target_learns_one_level_per_window(df, xy):
    """The level comes from a window's telemetry and batch size only, so it is one number
    for all layers of a window, and scaling a device's predictions to what its held layers
    measure removes it exactly: what is left is the shape booster's per-layer part."""
    X, y, schema = xy
    runs = run_ids(df)
    est = SlowdownRegressor(**SMALL_XGB).fit(X, y, runs=runs)
    assert est.target == "shape"
    used = {X.columns[i] for i in est.level_columns_}
    assert used == {*schema.telemetry, "log_batch_size"}
    level = np.log(est.predict(X)) - est.booster_.inplace_predict(X.to_numpy())
    spread = pd.Series(level).groupby(runs).agg(lambda v: v.max() - v.min())
    assert spread.max() < 1e-5
    assert pd.Series(level).groupby(runs).first().std() > 0.05  # it does vary by window
    # Without runs=, the windows are found from equal telemetry: the same fit.
    derived = SlowdownRegressor(**SMALL_XGB).fit(X, y)
    np.testing.assert_allclose(derived.predict(X), est.predict(X), rtol=1e-12)
    with pytest.raises(UserError, match="runs has"):
        SlowdownRegressor(**SMALL_XGB).fit(X, y, runs=np.zeros(3))
    with pytest.raises(UserError, match="target must be one of shape, slowdown"):
        SlowdownRegressor(target="ratio").fit(X, y)
    with pytest.raises(UserError, match="DataFrame"):
        SlowdownRegressor(**SMALL_XGB).fit(X.to_numpy(), y)
    single = SlowdownRegressor(**SMALL_XGB, target="slowdown").fit(X.to_numpy(), y)
    assert not hasattr(single, "level_booster_")


def test_slowdowns_below_one_are_predicted_unless_clipped(xy):
    """Small launch-bound layers measure faster beside a busy job (H200: VGG's fc7/fc8 at
    0.6-0.7 beside a full-duty GEMM): the default does not floor predictions at 1."""
    X, y, _ = xy
    fast = y.copy()
    small = X["log_flops"].to_numpy() < np.percentile(X["log_flops"], 20)
    busy = X["tel_other_util"].to_numpy() > 50
    fast[small & busy] *= 0.6
    free = SlowdownRegressor(**SMALL_XGB).fit(X, fast)
    assert np.median(free.predict(X[small & busy])) < 1.0
    floored = SlowdownRegressor(**SMALL_XGB, min_slowdown=1.0).fit(X, fast)
    assert (floored.predict(X) >= 1.0).all()


def test_wrong_feature_matrix_is_refused_with_names(xy):
    X, y, _ = xy
    est = SlowdownRegressor(**SMALL_XGB).fit(X, y)
    with pytest.raises(UserError, match="missing tel_util; extra tel_gpu_util"):
        est.predict(X.rename(columns={"tel_util": "tel_gpu_util"}))
    with pytest.raises(UserError, match="different order"):
        est.predict(X[list(reversed(X.columns))])
    with pytest.raises(UserError, match="<= 0"):
        clone(est).fit(X, np.r_[-1.0, y[1:]])


def test_stage_mean_reads_measured_column():
    X = pd.DataFrame({"measured_stage_slowdown": [1.5, 2.0]})
    assert StageMean().fit(X).predict(X).tolist() == [1.5, 2.0]
    with pytest.raises(UserError, match="measured_stage_slowdown"):
        StageMean().fit(pd.DataFrame({"a": [1.0]}))


def test_booster_pickles_as_xgboost_json_not_a_pickled_object(xy):
    X, y, _ = xy
    est = SlowdownRegressor(**SMALL_XGB).fit(X, y)
    blob = pickle.dumps(est)
    # Module names of pickled globals appear as string arguments (GLOBAL / STACK_GLOBAL).
    strings = [arg for _op, arg, _pos in pickletools.genops(blob) if isinstance(arg, str)]
    assert any(s.startswith("dynpipe.predictor") for s in strings)
    assert not any(s.startswith("xgboost") for s in strings)
    state = est.__getstate__()
    assert state["booster_json_"].lstrip().startswith(b"{")
    back = pickle.loads(blob)
    np.testing.assert_array_equal(back.predict(X), est.predict(X))


# ---------------------------------------------------------------- persistence


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
@pytest.mark.parametrize("kind", ["xgb", "rf", "ridge"])
def test_save_load_round_trip_gives_identical_predictions(kind, suffix, df, tmp_path):
    params = {"xgb": SMALL_XGB, "rf": {"n_estimators": 15, "n_jobs": 1}, "ridge": {}}[kind]
    pred = fit_predictor(df, estimator=kind, params=params)
    path = save_predictor(pred, tmp_path / f"{kind}{suffix}")
    back = load_predictor(path)
    # Plain JSON: the estimator comes back from numbers, not from pickled objects.
    assert b"\x80" not in (path.read_bytes() if suffix == ".json" else b"")
    np.testing.assert_array_equal(back.predict_slowdown(df), pred.predict_slowdown(df))
    again = load_predictor(save_predictor(back, tmp_path / f"again{suffix}"))
    np.testing.assert_array_equal(again.predict_slowdown(df), pred.predict_slowdown(df))
    assert back.schema == pred.schema
    assert back.data_fingerprint == dataset_fingerprint(df)
    assert {"xgboost", "scikit-learn", "numpy", "pandas"} <= set(back.versions)
    assert back.training["rows"] == len(df)


def test_predictor_saved_before_shape_target_and_rates_loads_and_predicts(df, tmp_path):
    """A file from before schema 2 and the shape target (no ``target`` parameter, no rate
    features) loads as what it was, and the run-time path fills only its alone column."""
    _, v2 = extract_features(df)
    v1 = FeatureSchema(kinds=v2.kinds, telemetry=v2.telemetry, version=1)
    X1, _ = extract_features(df, schema=v1)
    assert list(X1.columns[: len(NUMERIC_STATIC_V1)]) == list(NUMERIC_STATIC_V1)
    est = SlowdownRegressor(**SMALL_XGB, target="slowdown", min_slowdown=1.0)
    est.fit(X1, df["slowdown"].to_numpy())
    old = Predictor(
        estimator=est, schema=v1, estimator_name="xgb", data_fingerprint="f", versions={}
    )
    path = save_predictor(old, tmp_path / "old.json")
    doc = json.loads(path.read_text())
    del doc["estimator"]["params"]["target"]
    path.write_text(json.dumps(doc))
    back = load_predictor(path)
    assert back.estimator.target == "slowdown" and back.schema.version == 1
    np.testing.assert_array_equal(back.predict_slowdown(df), old.predict_slowdown(df))
    rows = df[(df["model"] == "cnn_a") & (df["condition"] == "gemm@1x2")]
    tel = {k: rows[k].iloc[0] for k in v1.telemetry}
    fwd = rows[rows["phase"] == "fwd"].sort_values("layer_index")
    bwd = rows[rows["phase"] == "bwd"].sort_values("layer_index")
    got_f, got_b = predict_layer_times(
        back,
        layers=prepare_layers(back, rows),
        alone_fwd_ms=fwd["time_alone_ms"].to_numpy(),
        alone_bwd_ms=bwd["time_alone_ms"].to_numpy(),
        telemetry=[tel],
    )
    np.testing.assert_allclose(got_f[0], back.predict_time_ms(fwd), rtol=1e-6)
    np.testing.assert_allclose(got_b[0], back.predict_time_ms(bwd), rtol=1e-6)


def test_load_refuses_mismatched_features_by_name(predictor, tmp_path):
    path = save_predictor(predictor, tmp_path / "p.json")
    names = [n for n in predictor.schema.names if n != "tel_power_w"] + ["tel_fan_rpm"]
    with pytest.raises(UserError, match="missing tel_power_w; extra tel_fan_rpm") as info:
        load_predictor(path, expect_features=names)
    assert "\n" not in str(info.value)
    assert load_predictor(path, expect_features=predictor.schema.names).schema == predictor.schema


def test_load_refuses_non_predictor_files(tmp_path):
    import joblib

    with pytest.raises(UserError, match="does not exist"):
        load_predictor(tmp_path / "nope.json")
    (tmp_path / "other.json").write_text('{"hello": 1}')
    with pytest.raises(UserError, match="not a dynpipe predictor"):
        load_predictor(tmp_path / "other.json")
    (tmp_path / "junk.json").write_bytes(b"not json at all")
    with pytest.raises(UserError, match="not a dynpipe predictor"):
        load_predictor(tmp_path / "junk.json")
    (tmp_path / "bad.json").write_text('{"format": "dynpipe-predictor", "format_version": 2')
    with pytest.raises(UserError, match="not valid JSON"):
        load_predictor(tmp_path / "bad.json")
    with pytest.raises(UserError, match=r"name it p\.json"):
        save_predictor(None, tmp_path / "p.joblib")  # type: ignore[arg-type]
    joblib.dump({"hello": 1}, tmp_path / "other.joblib")
    with pytest.raises(UserError, match="not a dynpipe predictor"):
        load_predictor(tmp_path / "other.joblib", allow_pickle=True)


class _RunsCode:
    """Unpickling this calls ``Path.touch``: the proof that a pickle runs code when loaded."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        from pathlib import Path

        return (Path.touch, (Path(self.marker),))


def test_a_pickled_predictor_is_refused_without_running_it(tmp_path, predictor, df, capsys):
    """A crafted .joblib runs code when unpickled: without --allow-pickle nothing reads it
    (show, eval, train --predictor all go through load_predictor)."""
    import joblib

    from dynpipe.cli import main

    marker = tmp_path / "ran"
    joblib.dump({"format": "dynpipe-predictor", "x": _RunsCode(str(marker))}, tmp_path / "p.joblib")
    for argv in (
        ["predictor", "show", str(tmp_path / "p.joblib")],
        ["train", "--adapt", "adaptive", "--predictor", str(tmp_path / "p.joblib")],
        ["predictor", "convert", str(tmp_path / "p.joblib"), "-o", str(tmp_path / "n.json")],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "runs any code" in err, err
        assert not marker.exists()
    # An old predictor you trust converts once, explicitly; the JSON file then loads as is.
    old = {
        "format": "dynpipe-predictor",
        "format_version": 1,
        "estimator_name": "xgb",
        "estimator": predictor.estimator,
        "schema": predictor.schema.to_dict(),
        "data_fingerprint": predictor.data_fingerprint,
        "versions": predictor.versions,
    }
    joblib.dump(old, tmp_path / "old.joblib")
    argv = ["predictor", "convert", str(tmp_path / "old.joblib"), "-o", str(tmp_path / "n.json")]
    assert main([*argv, "--allow-pickle"]) == 0
    back = load_predictor(tmp_path / "n.json")
    X = predictor.features(df)
    np.testing.assert_array_equal(back.estimator.predict(X), predictor.estimator.predict(X))


def test_fingerprint_is_content_hash(df):
    fp = dataset_fingerprint(df)
    assert dataset_fingerprint(df.sample(frac=1.0, random_state=3)) == fp
    changed = df.copy()
    changed.loc[changed.index[7], "time_ms"] *= 1.0001
    assert dataset_fingerprint(changed) != fp


# ---------------------------------------------------------------- stages


def test_balanced_ranges_are_contiguous_non_empty_and_balanced():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 40))
        w = rng.uniform(0.1, 5.0, n)
        for s in range(1, min(n, 6) + 1):
            r = balanced_ranges(w, n_stages=s)
            assert r[0][0] == 0 and r[-1][1] == n and len(r) == s
            assert all(a < b for a, b in r) and all(r[i][1] == r[i + 1][0] for i in range(s - 1))
    r = balanced_ranges([1.0] * 8, n_stages=4)
    assert r == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="cannot split 3 layers into 4"):
        balanced_ranges([1, 1, 1], n_stages=4)


def test_stage_sums_and_measured_stage_slowdown(df):
    sid = assign_stages(df, n_stages=2)
    assert (sid >= 0).all()
    exact = stage_sums(df, stage=sid, predicted_ms=df["time_ms"].to_numpy())
    np.testing.assert_allclose(exact["measured_ms"], exact["predicted_ms"])
    # every run: 2 stages, both phases of each layer summed
    runs = df.groupby(["model", "condition"]).ngroups
    assert len(exact) == 2 * runs
    run = (df["model"] == "gpt_a") & (df["condition"] == "gemm@1x2")
    got = measured_stage_slowdown(df, stage=sid, current=1)[run.to_numpy()]
    part = df[run & (sid == 1)]
    assert np.allclose(got, part["time_ms"].sum() / part["time_alone_ms"].sum())


def test_sibling_floor_predicts_each_layer_from_its_identical_siblings():
    # Layers 0-3 are one computation (a class of 4), 4-5 another (2: too few), 6 is unique.
    shapes = [(10.0, 5, 1, 1)] * 4 + [(20.0, 5, 1, 1)] * 2 + [(30.0, 9, 1, 1)]
    times = [1.0, 1.1, 0.9, 1.2, 2.0, 2.2, 3.0]
    rows = [
        {
            "device_name": "gpu",
            "model": "m",
            "batch_size": 8,
            "dtype": "bfloat16",
            "condition": cond,
            "interferer": cond.split("@")[0],
            "layer_index": i,
            "kind": "block",
            "phase": phase,
            "flops": f,
            "param_bytes": p,
            "in_bytes": a,
            "out_bytes": b,
            "time_ms": t * (2.0 if cond != "none" else 1.0),
        }
        for cond in ("none", "gemm@1x1")
        for phase in ("fwd", "bwd")
        for i, ((f, p, a, b), t) in enumerate(zip(shapes, times, strict=True))
    ]
    floor = sibling_floor(pd.DataFrame(rows))
    assert sorted(floor["layer_index"].unique()) == [0, 1, 2, 3]
    assert set(floor["interferer"]) == {"gemm"} and len(floor) == 8
    first = floor[(floor["layer_index"] == 0) & (floor["phase"] == "fwd")].iloc[0]
    assert first["measured_ms"] == pytest.approx(2.0)
    assert first["predicted_ms"] == pytest.approx(2.0 * np.exp(np.mean(np.log([1.1, 0.9, 1.2]))))
    assert len(sibling_floor(pd.DataFrame(rows), min_class=2)) == 12


# ---------------------------------------------------------------- run time


def test_runtime_matches_frame_path(df, predictor):
    model_rows = df[df["model"] == "cnn_a"]
    conds = ["none", "gemm@1x2", "copy@0.5x1"]
    alone = model_rows[model_rows["condition"] == "none"].set_index(["phase", "layer_index"])
    a_f = alone.loc["fwd"].sort_index()["time_alone_ms"].to_numpy()
    a_b = alone.loc["bwd"].sort_index()["time_alone_ms"].to_numpy()
    tel_cols = list(predictor.schema.telemetry)
    # one telemetry window per device: that of layer 0 fwd under each condition
    windows, expect_f = [], []
    for c in conds:
        rows = model_rows[model_rows["condition"] == c]
        first = rows[(rows["layer_index"] == 0) & (rows["phase"] == "fwd")].iloc[0]
        windows.append({k: first[k] for k in tel_cols})
        same_tel = rows.assign(**{k: first[k] for k in tel_cols}).sort_values(
            ["phase", "layer_index"]
        )
        expect_f.append(predictor.predict_time_ms(same_tel[same_tel["phase"] == "fwd"]))
    prepared = prepare_layers(predictor, model_rows)
    fwd, bwd = predict_layer_times(
        predictor, layers=prepared, alone_fwd_ms=a_f, alone_bwd_ms=a_b, telemetry=windows
    )
    assert fwd.shape == bwd.shape == (3, len(a_f))
    np.testing.assert_allclose(fwd, np.vstack(expect_f), rtol=1e-6)
    assert (fwd > 0).all() and (bwd > 0).all()
    # Heavier interference is never predicted faster than no interference.
    assert fwd[1].sum() > fwd[0].sum()


def test_runtime_refills_alone_dependent_features_per_device(df, predictor):
    """Each device's alone times give its own alone-time and achieved-rate features."""
    rows = df[(df["model"] == "cnn_a") & (df["condition"] == "gemm@1x2")]
    fwd = rows[rows["phase"] == "fwd"].sort_values("layer_index")
    bwd = rows[rows["phase"] == "bwd"].sort_values("layer_index")
    tel = {k: rows[k].iloc[0] for k in predictor.schema.telemetry}
    scale = (1.0, 2.5)
    got_f, got_b = predict_layer_times(
        predictor,
        layers=prepare_layers(predictor, rows),
        alone_fwd_ms=np.outer(scale, fwd["time_alone_ms"]),
        alone_bwd_ms=np.outer(scale, bwd["time_alone_ms"]),
        telemetry=[tel, tel],
    )
    for d, k in enumerate(scale):
        want_f = predictor.predict_time_ms(fwd.assign(time_alone_ms=k * fwd["time_alone_ms"]))
        want_b = predictor.predict_time_ms(bwd.assign(time_alone_ms=k * bwd["time_alone_ms"]))
        np.testing.assert_allclose(got_f[d], want_f, rtol=1e-6)
        np.testing.assert_allclose(got_b[d], want_b, rtol=1e-6)
    # Slower alone means lower achieved rates: the predicted slowdowns differ, not only the
    # times (the rate features moved with the alone times).
    assert not np.allclose(got_f[1] / got_f[0], scale[1])


def test_runtime_from_the_model(predictor):
    from dynpipe.models import get_model

    model = get_model("mlp", depth=4, width=64)
    n = len(model)
    quiet = dict.fromkeys(predictor.schema.telemetry, 0.0)
    busy = {**quiet, "tel_other_util": 95.0, "tel_other_procs": 2.0, "tel_other_mem_util": 40.0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning expected
        fwd, bwd = predict_layer_times(
            predictor,
            layers=model,  # its work counts are taken on the meta device
            batch_size=32,
            alone_fwd_ms=np.full(n, 0.05),
            alone_bwd_ms=np.full((2, n), 0.1),
            telemetry=[quiet, busy],
        )
    assert fwd.shape == (2, n) and (bwd >= 0.1 - 1e-12).all()
    assert (fwd[1] >= fwd[0] - 1e-12).all()


def test_runtime_refuses_bad_telemetry_and_shapes(df, predictor):
    prepared = prepare_layers(predictor, df[df["model"] == "mlp_a"])
    n = prepared.n_layers
    good = dict.fromkeys(predictor.schema.telemetry, 1.0)
    kw = {"layers": prepared, "alone_fwd_ms": np.ones(n), "alone_bwd_ms": np.ones(n)}
    bad = {k: v for k, v in good.items() if k != "tel_util"} | {"tel_gpu_util": 3.0}
    with pytest.raises(
        UserError, match=r"telemetry of device 1 .*missing tel_util; extra tel_gpu_util"
    ):
        predict_layer_times(predictor, telemetry=[good, bad], **kw)
    # None means "no such reading on this platform"; non-tel keys are ignored.
    ok = {**good, "tel_mem_util": None, "tel_samples": 20, "timestamp": 1.0}
    predict_layer_times(predictor, telemetry=[ok], **kw)
    with pytest.raises(UserError, match="alone_fwd_ms has shape"):
        predict_layer_times(predictor, telemetry=[good], **{**kw, "alone_fwd_ms": np.ones(n + 1)})
    with pytest.raises(UserError, match="batch_size"):
        prepare_layers(
            predictor,
            [
                {
                    "kind": "linear",
                    "param_bytes": 1,
                    "in_bytes": 1,
                    "out_bytes": 1,
                    "fwd_flops": 1,
                    "bwd_flops": 2,
                }
            ],
        )


def test_rescale_to_measured_matches_current_stage_and_keeps_ratios():
    fwd = np.array([[1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]])
    bwd = 2 * fwd
    f2, b2 = rescale_to_measured(fwd, bwd, ranges=[(0, 2), None], measured_ms=[18.0, 5.0])
    assert f2[0, :2].sum() + b2[0, :2].sum() == pytest.approx(18.0)
    np.testing.assert_allclose(f2[0] / fwd[0], 2.0)  # 18 / (3 + 6)
    np.testing.assert_array_equal(f2[1], fwd[1])  # no range: left as predicted
    f3, _ = rescale_to_measured(fwd, bwd, ranges=[(1, 3), (0, 4)], measured_ms=[float("nan"), 6.0])
    np.testing.assert_array_equal(f3[0], fwd[0])
    np.testing.assert_allclose(f3[1], 0.5)
    with pytest.raises(UserError, match=r"range \[3, 9\)"):
        rescale_to_measured(fwd, bwd, ranges=[(3, 9), None], measured_ms=[1.0, 1.0])


def test_fit_with_tuning_picks_from_the_grid(df, monkeypatch):
    from dynpipe.predictor import train

    monkeypatch.setattr(train, "TUNE_GRID", {"max_depth": [2, 5]})
    pred = fit_predictor(df, estimator="xgb", params={**SMALL_XGB, "n_estimators": 20}, tune=True)
    assert pred.estimator.max_depth in (2, 5)
    assert pred.estimator.n_estimators == 20
    with pytest.raises(UserError, match="xgb estimator only"):
        fit_predictor(df, estimator="ridge", tune=True)


def test_fingerprint_hashes_array_valued_cells(df):
    rng = np.random.default_rng(0)
    samples = [rng.uniform(1, 2, 5) for _ in range(len(df))]
    with_samples = df.assign(samples_ms=samples)
    fp = dataset_fingerprint(with_samples)
    assert fp != dataset_fingerprint(df)
    changed = [s.copy() for s in samples]
    changed[3][0] += 1e-6
    assert dataset_fingerprint(df.assign(samples_ms=changed)) != fp
