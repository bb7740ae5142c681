"""Every figure renders from the recorded logs (tests/data/logs, see test_analysis.py), with
labelled axes and titles naming model and device; ``dynpipe figures`` writes them all."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from script_loader import load_script

from dynpipe.analysis.accuracy import (
    plot_predictor,
    predictions_from_predictor,
    predictions_from_report,
)
from dynpipe.analysis.bars import plot_migration, plot_phases, plot_throughput
from dynpipe.analysis.bubbles import partition_bubbles, plot_bubbles, run_bubbles
from dynpipe.analysis.logs import load_runs
from dynpipe.analysis.metrics import throughput
from dynpipe.analysis.timeline import plot_busy_fraction, plot_loss, plot_step_time
from dynpipe.cli import main
from dynpipe.errors import UserError
from dynpipe.models import get_model
from dynpipe.planner.plan import Plan

LOGS = Path(__file__).parent / "data" / "logs"
THREE = ("static", "measured", "restart")  # light.jsonl joins where light vs heavy matters
RUN_FIGURES = (
    "step_time",
    "phases",
    "throughput",
    "loss_time",
    "busy_fraction",
    "migration",
    "bubbles",
)


@pytest.fixture(scope="module")
def runs():
    return load_runs([LOGS / f"{n}.jsonl" for n in THREE])


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """One ``dynpipe figures`` run over the recorded logs (rendering is the slow part)."""
    out = tmp_path_factory.mktemp("figs")
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["figures", *(str(LOGS / f"{n}.jsonl") for n in THREE), "-o", str(out)])
    return rc, out, buf.getvalue()


def _labelled(fig, *, words=("mlp", "cpu")) -> None:
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert axes
    for ax in axes:
        # Stacked panels sharing an x axis label it once, under the bottom one.
        xlabels = [a.get_xlabel().strip() for a in ax.get_shared_x_axes().get_siblings(ax)]
        assert any(xlabels) and ax.get_ylabel().strip(), ax.get_title()
    titles = " ".join([fig.get_suptitle(), *(ax.get_title() for ax in axes)])
    for w in words:
        assert w in titles


@pytest.mark.parametrize("name", RUN_FIGURES)
def test_cli_writes_every_run_figure(drawn, name) -> None:
    rc, out, _ = drawn
    assert rc == 0
    png, pdf = out / f"{name}.png", out / f"{name}.pdf"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 5_000


def test_cli_notes_what_it_skipped_and_writes_summary(drawn) -> None:
    _, out, printed = drawn
    assert "skipped predictor: needs --predictor" in printed
    summary = (out / "summary.md").read_text()
    assert "| restart | restart |" in summary
    assert "| measured | interference | emulated ×3 on stage 1 |" in summary


def test_step_time(runs) -> None:
    fig = plot_step_time(runs)
    _labelled(fig)
    ax = fig.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert {"static", "measured", "restart"} <= set(labels)
    assert any(lab.startswith("interference: emulated ×3") for lab in labels)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(t.startswith("repartition") for t in legend)
    assert any(t.startswith("restart (") for t in legend)


def test_phases_and_throughput(runs) -> None:
    fig = plot_phases(runs)
    _labelled(fig)
    # Bars carry their numbers: the measured run's interference mean is written on the figure.
    texts = {t.get_text() for ax in fig.axes for t in ax.texts}
    inter = runs[1].steps.query("phase == 'interference'")["step_ms"].mean()
    assert f"{inter:.0f}" in texts
    fig = plot_throughput(runs)
    _labelled(fig)
    texts = {t.get_text() for t in fig.axes[0].texts}
    assert {f"{throughput(r):.1f}" for r in runs} <= texts


def test_phases_light_vs_heavy(runs) -> None:
    light = load_runs([LOGS / "light.jsonl"])
    fig = plot_phases([*runs, *light])
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["light: emulated ×1.5 on stage 1", "heavy: emulated ×3 on stage 1"]
    texts = {t.get_text() for t in fig.axes[0].texts}
    inter = light[0].steps.query("phase == 'interference'")["step_ms"].mean()
    clean_static = runs[0].steps["step_ms"].iloc[2:].mean()
    assert {f"{inter:.0f}", f"{clean_static:.0f}"} <= texts


def test_loss_marks_time_to_target(runs) -> None:
    fig = plot_loss(runs, target=float(runs[0].steps["loss"].iloc[0]) + 1.0)
    _labelled(fig)
    marks = [t.get_text() for t in fig.axes[0].texts]
    assert len(marks) == len(runs) and all(m.endswith(" s") for m in marks)


def test_busy_fraction_has_a_panel_per_run(runs) -> None:
    fig = plot_busy_fraction(runs)
    _labelled(fig)
    assert len(fig.axes) == len(runs)
    for ax in fig.axes:
        ys = np.concatenate(
            [line.get_ydata() for line in ax.get_lines() if len(line.get_ydata()) > 2]
        )
        assert np.all((ys >= 0) & (ys <= 1.0 + 1e-9))


def test_migration(runs) -> None:
    fig = plot_migration(runs)
    _labelled(fig)
    with pytest.raises(UserError, match="no repartition or restart"):
        plot_migration(runs[:1])


def test_bubbles_from_runs_and_plan_files(runs, tmp_path) -> None:
    table = run_bubbles(runs)
    assert set(table["source"]) == {r.name for r in runs}
    assert table["simulated_bubble"].between(0, 1).all()
    assert table["measured_bubble"].between(-0.05, 1).all()
    # The measured run repartitioned: it trained under more than one plan.
    assert table[table["source"] == "measured"]["plan"].nunique() > 1
    plan = tmp_path / "mlp-2.json"
    assert main(["plan", "--model", "mlp", "--stages", "2", "-o", str(plan)]) == 0
    even = Plan.even(get_model("mlp"), 2).save(tmp_path / "even.json")
    (tmp_path / "other.json").write_text("{}")
    files, notes = partition_bubbles([tmp_path])
    (row,) = files.itertuples()
    assert len(notes) == 2 and any(str(even) in n and "no predicted" in n for n in notes)
    meta = json.loads(plan.read_text())["meta"]
    assert row.simulated_bubble == pytest.approx(meta["bubble"], abs=1e-4)
    fig = plot_bubbles(pd.concat([table, files], ignore_index=True), runs=runs)
    _labelled(fig)
    with pytest.raises(UserError, match="no plan to simulate"):
        plot_bubbles(table.iloc[:0])


@pytest.fixture(scope="module")
def predictor_files(tmp_path_factory):
    """A small predictor and evaluation report on the predictor package's synthetic profiles."""
    from dynpipe.predictor import evaluate, fit_predictor, save_predictor
    from dynpipe.predictor.estimator import make_estimator
    from dynpipe.predictor.report import write_report
    from dynpipe.predictor.synthetic import CONDITIONS, synthetic_profiles
    from dynpipe.profiler.schema import load_profiles, write_profiles

    d = tmp_path_factory.mktemp("pred")
    conds = tuple(c for c in CONDITIONS if c[0] == "none" or (c[1] == 1.0 and c[2] == 1))
    meta = {
        "device_name": "Synthetic GPU",
        "device_type": "cuda",
        "driver": "synthetic",
        "torch_version": "synthetic",
        "date": "2025-01-01",
        "command": "synthetic_profiles()",
    }
    train = synthetic_profiles(models=("mlp_a", "gpt_a"), conditions=conds, seed=0)
    other = synthetic_profiles(models=("mlp_b",), conditions=conds, seed=1)
    write_profiles(train, d / "train.parquet", meta=meta)
    write_profiles(other, d / "other.parquet", meta=meta)
    small = {"n_estimators": 30, "max_depth": 3, "n_jobs": 1}
    pred = fit_predictor(load_profiles(d / "train.parquet"), estimator="xgb", params=small)
    save_predictor(pred, d / "p.json")
    ev = evaluate(
        train,
        estimators={
            "xgb": make_estimator("xgb", **small),
            "stage-mean": make_estimator("stage-mean"),
        },
        splits=("condition",),
        n_folds=3,
        n_stages=(2,),
    )
    write_report(ev, d / "report", primary="xgb")
    return d


def test_predictor_from_report(predictor_files, tmp_path) -> None:
    preds = predictions_from_report(predictor_files / "report")
    assert preds.primary == "xgb" and "held-out interference conditions" in preds.source
    assert set(preds.frame["estimator"]) == {"xgb", "stage-mean"}
    assert (preds.frame["interferer"] != "none").all()
    fig = plot_predictor(preds)
    _labelled(fig, words=("Synthetic GPU", "xgb"))
    # The figure's error numbers are the report's own, recomputed from the raw pairs.
    report = json.loads((predictor_files / "report" / "report.json").read_text())
    xgb = report["results"]["condition"]["xgb"]["layer"]["all"]
    assert f"MAPE {xgb['mape']:.1f}%, p90 {xgb['p90']:.1f}%" in fig.axes[0].get_title()
    assert xgb["n"] == (preds.frame["estimator"] == "xgb").sum()
    with pytest.raises(UserError, match=r"predictions_layers\.parquet"):
        predictions_from_report(tmp_path)


def test_predictor_from_profiles_says_in_sample(predictor_files) -> None:
    d = predictor_files
    same = predictions_from_predictor(d / "p.json", profiles=[d / "train.parquet"])
    assert "in-sample" in same.source
    new = predictions_from_predictor(d / "p.json", profiles=[d / "other.parquet"])
    assert "not fit on" in new.source
    # A file its training metadata lists, among others: still flagged as in-sample.
    mixed = [d / "other.parquet", d / "train.parquet"]
    part = predictions_from_predictor(d / "p.json", profiles=mixed)
    assert "train.parquet (in-sample" in part.source
    f = new.frame
    assert len(f) > 0 and np.all(f["predicted_ms"] > 0) and np.all(f["measured_ms"] > 0)
    _labelled(plot_predictor(new), words=("Synthetic GPU",))
    with pytest.raises(UserError, match="--profiles"):
        predictions_from_predictor(d / "p.json", profiles=[])


def test_cli_predictor_and_errors(predictor_files, tmp_path, capsys) -> None:
    rc = main(["figures", "-o", str(tmp_path), "--predictor", str(predictor_files / "report")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert (tmp_path / "predictor.pdf").is_file()
    assert "skipped step_time: needs run logs" in printed
    assert main(["figures", "-o", str(tmp_path)]) == 2
    assert "nothing to draw" in capsys.readouterr().err
    assert main(["figures", "-o", str(tmp_path), "--label", "oops"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "NAME=LOG" in err


def _script(name: str):
    return load_script(f"analysis/{name}.py", f"analysis_{name}")


SCRIPTS = {
    "fig_step_time": "cpu/step_time.png",
    "fig_busy": "cpu/busy_fraction.png",
    "fig_loss": "cpu/loss_time.png",
    "fig_migration": "cpu/migration.png",
    "fig_bubbles": "cpu/bubbles.png",
    "fig_phases": "phases_mlp.png",
    "fig_throughput": "throughput.png",
    "summary_tables": "cpu/summary.md",
}


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    logs = tmp_path_factory.mktemp("alogs")
    (logs / "cpu").mkdir()
    for n in ("static", "measured"):  # a repartitioning run and a baseline: every figure
        (logs / "cpu" / f"{n}.jsonl").write_bytes((LOGS / f"{n}.jsonl").read_bytes())
    return logs


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_analysis_scripts(name, experiment, tmp_path, capsys) -> None:
    mod = _script(name)
    assert "python analysis/" in mod.__doc__  # the exact command to run it
    args = ["--logs", str(experiment), "--out", str(tmp_path)]
    if name == "fig_bubbles":
        args += ["--partitions", str(tmp_path / "none")]
    assert mod.main(args) == 0
    out = tmp_path / SCRIPTS[name]
    assert out.stat().st_size > 1_000
    assert str(out) in capsys.readouterr().out
    empty = ["--logs", str(tmp_path / "empty"), "--out", str(tmp_path)]
    if name == "fig_bubbles":
        empty += ["--partitions", str(tmp_path / "none")]
    assert mod.main(empty) == 2
    assert "no run logs" in capsys.readouterr().err


def test_predictor_script(predictor_files, tmp_path) -> None:
    mod = _script("fig_predictor")
    assert mod.main(["--report", str(predictor_files / "report"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "predictor_report.png").stat().st_size > 10_000
    args = ["--predictor", str(predictor_files / "p.json"), "--out", str(tmp_path)]
    assert mod.main(args) == 2  # a predictor alone has nothing to be scored on
