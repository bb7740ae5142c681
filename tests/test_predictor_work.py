"""Work counts as features, the spread of predictions, and the profile corpus."""

from __future__ import annotations

import importlib.util

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from dynpipe.errors import UserError
from dynpipe.models import InputSpec, LayeredModel, LayerSpec, get_model
from dynpipe.models.stats import layer_stats
from dynpipe.predictor import (
    extract_features,
    fit_predictor,
    load_predictor,
    predict_layer_distribution,
    predict_layer_times,
    prepare_layers,
    save_predictor,
)
from dynpipe.predictor.crossval import evaluate
from dynpipe.predictor.estimator import make_estimator
from dynpipe.predictor.spread import calibrated_errors, z_of
from dynpipe.predictor.synthetic import synthetic_profiles
from dynpipe.profiler.work import OP_KINDS, WORK_COLUMNS, add_work, classify, layer_work

_MODELS = ("mlp_a", "mlp_b", "cnn_a", "cnn_b", "gpt_a", "gpt_b")
_CONDS = (
    ("none", 0.0, 0),
    ("gemm", 0.5, 1),
    ("gemm", 1.0, 1),
    ("copy", 1.0, 1),
    ("train", 1.0, 1),
    ("spin", 1.0, 1),
)


def _two_layer_model(make, shape: tuple[int, ...], name: str = "one") -> LayeredModel:
    return LayeredModel(
        name=name,
        layers=(LayerSpec("l0", "x", make), LayerSpec("l1", "x", make)),
        loss_fn=nn.functional.mse_loss,
        input_spec=InputSpec(shape=shape),
    )


class _Attn(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)


def test_work_counts_match_flop_counter_and_sum_to_one():
    model = get_model("gpt", depth=1, width=64, heads=4, seq_len=16)
    work = pd.DataFrame(layer_work(model, batch_size=2))
    stats = layer_stats(model, batch_size=2)
    fwd = work[work["phase"] == "fwd"].set_index("layer_index")
    # Forward FLOPs agree with FlopCounterMode (attention and matmuls alike).
    assert [fwd.loc[s.index, "work_flops"] for s in stats] == [float(s.fwd_flops) for s in stats]
    shares = work[[f"work_bytes_{k}" for k in OP_KINDS]].sum(axis=1)
    assert np.allclose(shares[work["work_bytes"] > 0], 1.0)
    assert (work["work_launches"] > 0).all()
    block = work[(work["layer_index"] == 1) & (work["phase"] == "fwd")].iloc[0]
    assert block["work_flops_attention"] > 0 and block["work_bytes_norm"] > 0


def test_attention_is_one_fused_kernel_per_phase():
    work = layer_work(_two_layer_model(_Attn, (4, 8, 16)), batch_size=2)
    fwd, bwd = (w for w in work if w["layer_index"] == 1)  # its input needs a gradient
    assert fwd["work_launches"] == 1 and fwd["work_bytes_attention"] == 1.0
    # One attention backward; q, k and v are one tensor here, so autograd adds their
    # gradients (two elementwise adds) - but no matmul of a decomposed attention appears.
    assert bwd["work_flops_attention"] == 1.0 and bwd["work_bytes_matmul"] == 0.0
    assert bwd["work_launches"] == 3 and bwd["work_flops"] > 2 * fwd["work_flops"]


def test_depthwise_convolution_backward_counts_groups():
    def conv() -> nn.Module:
        return nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False)

    rows = layer_work(_two_layer_model(conv, (16, 8, 8)), batch_size=2)
    work = {(w["layer_index"], w["phase"]): w for w in rows}
    fwd, bwd = work[(1, "fwd")], work[(1, "bwd")]
    assert fwd["work_flops_conv_grouped"] == 1.0
    # Input and weight gradients: two forwards' worth, not a dense convolution's.
    assert bwd["work_flops"] == pytest.approx(2 * fwd["work_flops"])
    assert classify("convolution", args=[None] * 8 + [1]) == "conv"


def test_features_name_no_model_or_layer():
    df = synthetic_profiles(models=("mlp_a", "cnn_a"), conditions=_CONDS)
    X, schema = extract_features(df)
    assert schema.version == 3 and schema.kinds == ()
    assert not [n for n in X.columns if n.startswith("kind_")]
    renamed = df.assign(model="other", layer="x", kind="renamed")
    X2, _ = extract_features(renamed, schema=schema)
    pd.testing.assert_frame_equal(X, X2)


def test_add_work_rebuilds_models_from_the_profile_command():
    model = get_model("mlp", depth=2, width=32)
    rows = [
        {"model": "mlp", "batch_size": 4, "dtype": "float32", **w}
        for w in layer_work(model, batch_size=4)
    ]
    expected = pd.DataFrame(rows)
    df = expected.drop(columns=list(WORK_COLUMNS))
    df.attrs["dynpipe"] = [
        {"command": "dynpipe profile --model mlp --set depth=2 --set width=32 --batch-size 4"}
    ]
    got = add_work(df)
    pd.testing.assert_frame_equal(got[list(expected.columns)], expected)
    df.attrs["dynpipe"] = [{"command": "dynpipe profile --model gpt --batch-size 4"}]
    with pytest.raises(UserError, match="carry no work counts"):
        add_work(df)


def test_calibrated_errors_remove_the_other_half_mean():
    err = np.array([1.0, 1.0, 3.0, 3.0, 0.0, 2.0])
    runs = np.array([0, 0, 0, 0, 1, 1])
    cal, level = calibrated_errors(err, runs=runs)
    assert cal.tolist() == [-2.0, -2.0, 2.0, 2.0, -2.0, 2.0]
    assert level.tolist() == [2.0, 1.0]
    assert z_of(0.8) == pytest.approx(1.2816, abs=1e-4)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    df = synthetic_profiles(models=_MODELS, conditions=_CONDS, noise=0.05, seed=1)
    pred = fit_predictor(df, params={"n_estimators": 40, "n_jobs": 1})
    path = save_predictor(pred, tmp_path_factory.mktemp("pred") / "p.json.gz")
    return df, pred, path


def test_spread_holds_its_coverage_on_held_out_architectures():
    df = synthetic_profiles(models=_MODELS, conditions=_CONDS, noise=0.05, seed=2)
    est = make_estimator("xgb", n_estimators=40, n_jobs=1)
    ev = evaluate(df, estimators={"xgb": est}, splits=("model",), calibrate=("xgb",))
    cal = ev.summary["results"]["model"]["xgb+measured"]["layer"]["all"]
    # The interval is learned on other architectures, then scored on the held-out one.
    assert 0.65 <= cal["coverage"] <= 0.95, cal
    per_model = ev.summary["results"]["model"]["xgb+measured"]["layer"]["by_model"]
    assert set(per_model) == set(_MODELS)


def test_distribution_matches_times_and_survives_json(fitted):
    df, pred, path = fitted
    loaded = load_predictor(path)
    assert b"pickle" not in path.read_bytes()
    one = df[(df["model"] == "gpt_a") & (df["condition"] == "gemm@1x1")]
    prep = prepare_layers(loaded, one)
    n = prep.n_layers
    tel = [{k: one[k].iloc[0] for k in loaded.schema.telemetry}] * 3
    a_f = np.linspace(0.1, 2.0, n)
    kw = {"layers": prep, "alone_fwd_ms": a_f, "alone_bwd_ms": 2 * a_f, "telemetry": tel}
    fwd, bwd = predict_layer_times(loaded, **kw)
    dist = predict_layer_distribution(loaded, **kw)
    np.testing.assert_array_equal(dist.fwd_ms, fwd)
    np.testing.assert_array_equal(dist.bwd_ms, bwd)
    assert dist.fwd_log_sd.shape == (3, n) and (dist.fwd_log_sd > 0).all()
    lo, hi, blo, bhi = dist.interval(0.8)
    assert (lo < fwd).all() and (fwd < hi).all() and (blo < bwd).all() and (bwd < bhi).all()
    var_f, _ = dist.variance_ms2()
    assert (var_f > 0).all()
    absolute = predict_layer_distribution(loaded, calibrated=False, **kw)
    assert (absolute.fwd_log_sd >= dist.fwd_log_sd).all()
    # The file round-trips the spread exactly.
    ref = predict_layer_distribution(pred, **kw)
    np.testing.assert_array_equal(ref.fwd_log_sd, dist.fwd_log_sd)


def test_prepare_layers_counts_a_model_and_refuses_bare_stats(fitted):
    _, pred, _ = fitted
    model = get_model("mlp", depth=3, width=32)
    prep = prepare_layers(pred, model, batch_size=4)
    assert prep.n_layers == len(model) and prep.launches is not None
    with pytest.raises(UserError, match="pass the model itself"):
        prepare_layers(pred, layer_stats(model, batch_size=4), batch_size=4)


def test_show_names_architectures_cards_and_conditions(fitted, capsys):
    from dynpipe.cli import main

    _, _, path = fitted
    assert main(["predictor", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "architectures (6): cnn_a, cnn_b, gpt_a, gpt_b, mlp_a, mlp_b" in out
    assert "card: Synthetic GPU" in out
    assert "conditions (6):" in out and "gemm@1x1" in out
    assert "spread: 80% interval" in out


def test_corpus_plan_and_budget():
    from dynpipe.profiler.corpus import CORPUS, QUICK_BELOW_S, plan_corpus

    assert len(CORPUS) >= 10
    archs, sizes, sweep, per_arch = plan_corpus(size="gpu", seconds=480)
    assert len(archs) == len(CORPUS) and len(sizes) == 2 and "quick" in sweep
    assert per_arch == pytest.approx(max(30.0, 480 / len(CORPUS)))
    archs, sizes, sweep, per_arch = plan_corpus(size="gpu", seconds=None)
    assert len(sizes) == 3 and sweep.endswith("gpu.toml") and per_arch is None
    assert plan_corpus(size="tiny", seconds=QUICK_BELOW_S)[2].endswith("cpu.toml")
    with pytest.raises(UserError, match="not a corpus architecture"):
        plan_corpus(size="gpu", seconds=None, only=["nope"])


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="needs torchvision")
@pytest.mark.parametrize("name", ["mixer", "mobilenet", "efficientnet"])
def test_corpus_factories_train_one_step(name):
    from dynpipe.profiler.corpus import CORPUS

    arch = next(a for a in CORPUS if a.name == name)
    model = get_model(arch.model, **arch.tiny)
    x, y = model.input_spec.example(2)
    layers = [model.build_layer(i) for i in range(len(model))]
    for layer in layers:
        x = layer(x)
    loss = model.loss_fn(x, y)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in layers[-1].parameters())


def test_corpus_runs_end_to_end_on_cpu(tmp_path):
    """One architecture through ``dynpipe profile corpus`` at a tiny size, then the predictor
    fitted on what it wrote (the work counts come with the rows)."""
    from dynpipe.cli import main
    from dynpipe.profiler.schema import load_profiles

    out = tmp_path / "corpus"
    rc = main(
        ["profile", "corpus", str(out), "--device", "cpu", "--size", "tiny", "--only", "mlp",
         "--batch-sizes", "2", "--sweep", "recipes/sweeps/smoke.toml", "--cores", "0",
         "--seconds", "120"]
    )  # fmt: skip
    assert rc == 0
    df = load_profiles(out / "cpu-mlp.parquet")
    assert set(WORK_COLUMNS) <= set(df.columns) and not df[list(WORK_COLUMNS)].isna().any().any()
    assert set(df["condition"]) == {"none", "spin@0.5x1", "spin@1x1"}
    assert (out / "corpus.json").exists()


def test_a_work_predictor_feeds_the_adaptation_core(tmp_path) -> None:
    """A predictor fitted now (feature schema 3) is accepted where adaptation loads one."""
    from dynpipe.models import get_model
    from dynpipe.predictor import fit_predictor, save_predictor
    from dynpipe.predictor.synthetic import synthetic_profiles
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.adapt.make import make_policy

    pred = fit_predictor(synthetic_profiles(models=("mlp_a",), seed=0), estimator="ridge")
    assert pred.schema.uses_work
    path = save_predictor(pred, tmp_path / "p.json")
    model = get_model("mlp", depth=4, width=16, in_features=16)
    policy = make_policy(
        AdaptConfig(mode="adaptive"),
        model=model,
        microbatch_size=4,
        num_ranks=2,
        predictor=str(path),
    )
    assert policy is not None
