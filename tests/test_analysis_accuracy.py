"""Time-to-accuracy and scaling figures, drawn from the logs of small CPU runs made here:
the mlp on digits with held-out evaluations, static on one and two processes and adaptive
(``measured``) on two under an emulated slowdown of stage 1."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math

import numpy as np
import pytest
from distutil import run_ranks
from script_loader import load_script

from dynpipe.analysis.convergence import plot_time_to_accuracy, time_to_accuracy_table
from dynpipe.analysis.logs import load_runs
from dynpipe.analysis.metrics import choose_eval_target, time_to_eval_target
from dynpipe.analysis.scaling import plot_scaling, scaling_table
from dynpipe.cli import main
from dynpipe.errors import UserError

pytestmark = pytest.mark.slow

STEPS = 60
SCENARIO = """
name = "emulate-2x-stage1"
[[events]]
step = 20
action = "start"
kind = "emulate"
factor = 2.0
stage = 1
[[events]]
step = 45
action = "stop"
stage = 1
"""


def _train(rank: int, world: int, log: str, adapt: str, scenario: str | None) -> None:
    from dynpipe.runtime.adapt.config import AdaptConfig
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.optim import OptimConfig
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    cfg = TrainConfig(
        model="mlp",
        model_args={"depth": 2, "width": 64},
        data="digits",
        steps=STEPS,
        batch_size=32,
        microbatches=2,
        optim=OptimConfig(name="adamw", lr=3e-3),
        progress=False,
        log=log,
        eval_every=10,
        adapt=AdaptConfig(mode=adapt),
        scenario=scenario,
    )
    train(cfg, topo=Topology.from_env(device="cpu"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    scenario = root / "scenario.toml"
    scenario.write_text(SCENARIO)
    paths = {
        "static_1": (1, "static", None),
        "static_2": (2, "static", str(scenario)),
        "measured_2": (2, "measured", str(scenario)),
    }
    for name, (world, adapt, scen) in paths.items():
        run_ranks(_train, world, str(root / f"{name}.jsonl"), adapt, scen)
    return root


def test_eval_records_become_a_frame_and_a_target_every_run_reaches(logs) -> None:
    runs = load_runs([logs / "static_2.jsonl", logs / "measured_2.jsonl"])
    for r in runs:
        assert list(r.evals["step"]) == [10, 20, 30, 40, 50, 60]
        assert r.evals["accuracy"].between(0, 1).all() and r.evals["perplexity"].isna().all()
        assert (np.diff(r.evals["elapsed_s"]) > 0).all()
    target = choose_eval_target(runs)
    assert target.metric == "accuracy" and "every run reaches" in target.how
    assert target.value == min(r.evals["accuracy"].max() for r in runs)
    for r in runs:
        secs, step = time_to_eval_target(r, target)
        first = r.evals[r.evals["accuracy"] >= target.value].iloc[0]
        assert (secs, step) == (first["elapsed_s"], first["step"])
    # Both runs did the same math on the same data: the same accuracy at every evaluation.
    assert list(runs[0].evals["accuracy"]) == list(runs[1].evals["accuracy"])
    given = choose_eval_target(runs, target_loss=5.0)
    assert given.metric == "loss" and given.how == "given"
    assert time_to_eval_target(runs[0], given)[1] == 10  # every eval loss is under 5
    with pytest.raises(UserError, match="fraction in"):
        choose_eval_target(runs, target_accuracy=90)


def test_time_to_accuracy_table_and_figure(logs, tmp_path) -> None:
    runs = load_runs([logs / "static_2.jsonl", logs / "measured_2.jsonl"])
    table, target = time_to_accuracy_table(runs, target_accuracy=0.5)
    assert str(target) == "eval accuracy 50.0% (given)"
    static = table[table["system"] == "static"].iloc[0]
    other = table[table["system"] == "measured"].iloc[0]
    assert static.vs_static == 1.0
    assert math.isclose(other.vs_static, static.time_s / other.time_s)
    fig = plot_time_to_accuracy(runs, out=tmp_path, target_accuracy=0.5)
    assert (tmp_path / "time_to_accuracy.png").stat().st_size > 10_000
    curve, bars = fig.axes
    assert "accuracy" in curve.get_ylabel() and "wall time" in curve.get_xlabel()
    assert "mlp" in fig.get_suptitle() and "cpu" in fig.get_suptitle()
    assert [t.get_text() for t in bars.get_yticklabels()] == list(table["run"])


def test_a_run_is_compared_with_the_static_run_on_as_many_devices(logs) -> None:
    # The one-process static run given the two-process runs' interference: the same model
    # and condition, but not the baseline of a two-process run (the scaling figure's set).
    static_1, static_2, measured = load_runs(
        [logs / "static_1.jsonl", logs / "static_2.jsonl", logs / "measured_2.jsonl"]
    )
    static_1 = dataclasses.replace(static_1, windows=static_2.windows)
    assert static_1.condition == measured.condition and static_1.world_size == 1
    table, _ = time_to_accuracy_table([static_1, static_2, measured], target_accuracy=0.5)
    by = table.set_index("run")
    assert by.loc[static_1.name, "vs_static"] == 1.0 == by.loc[static_2.name, "vs_static"]
    assert math.isclose(
        by.loc[measured.name, "vs_static"],
        by.loc[static_2.name, "time_s"] / by.loc[measured.name, "time_s"],
    )


def test_scaling_reads_world_sizes_and_per_step_throughput(logs, tmp_path) -> None:
    runs = load_runs(list(logs.glob("*.jsonl")))
    table = scaling_table(runs)
    one = table[(table["world_size"] == 1)]
    assert set(one["phase"]) == {"clean"} and set(one["system"]) == {"static"}
    two = table[table["world_size"] == 2]
    assert set(two["phase"]) == {"clean", "interference"}
    for r in runs:
        for row in table[table["run"] == r.name].itertuples():
            steps = r.steps[(r.steps["phase"] == row.phase) & (r.steps["step"] >= 2)]
            assert row.samples_per_s == float(np.median(steps["samples_per_s"]))
    fig = plot_scaling(runs, out=tmp_path)
    assert len(fig.axes) == 2 and (tmp_path / "scaling.pdf").stat().st_size > 5_000
    assert all("world size" in ax.get_xlabel() for ax in fig.axes)
    with pytest.raises(UserError, match="two or more world sizes; these logs have 2"):
        plot_scaling([r for r in runs if r.world_size == 2])


def test_runs_of_one_mode_on_other_device_counts_are_one_system(logs, tmp_path) -> None:
    """The scaling figure's line per system needs a static run on 2 devices and one on 4
    (same model and interference) to be one system, not two static variants."""
    import json

    lines = (logs / "static_2.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    header["world_size"] = 4
    (tmp_path / "four").mkdir()
    (tmp_path / "four" / "static_2.jsonl").write_text(
        "\n".join([json.dumps(header), *lines[1:]]) + "\n"
    )
    runs = load_runs([logs / "static_2.jsonl", tmp_path / "four" / "static_2.jsonl"])
    assert [r.system for r in runs] == ["static", "static"]
    assert sorted(r.world_size for r in runs) == [2, 4] and len({r.name for r in runs}) == 2
    table = scaling_table(runs)
    assert set(table["system"]) == {"static"} and set(table["world_size"]) == {2, 4}


def test_figures_cli_draws_both_and_summary_gives_ratios(logs, tmp_path) -> None:
    out = tmp_path / "figs"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["figures", str(logs), "-o", str(out), "--target-accuracy", "0.5"])
    assert rc == 0, buf.getvalue()
    for name in ("time_to_accuracy", "scaling"):
        assert (out / f"{name}.png").stat().st_size > 10_000, buf.getvalue()
    summary = (out / "summary.md").read_text()
    section = summary.split("## Time to accuracy")[1].split("##")[0]
    assert "eval accuracy 50.0% (given)" in section
    table = [ln.split("|") for ln in section.splitlines() if ln.startswith("| ")][1:]
    rows = {cells[1].strip(): cells[6].strip() for cells in table}
    # Each static run is its own baseline; the adaptive run is compared with the static run
    # under the same interference.
    assert rows.keys() == {"static (static_1)", "static (static_2)", "measured"}, rows
    assert rows["static (static_1)"] == rows["static (static_2)"] == "1.00"
    assert float(rows["measured"]) > 0


def test_analysis_scripts_redraw_both_from_a_logs_folder(logs, tmp_path, capsys) -> None:
    def script(name: str):
        return load_script(f"analysis/{name}.py")

    args = ["--logs", str(logs), "--out", str(tmp_path)]
    assert script("fig_accuracy").main([*args, "--target-accuracy", "0.5"]) == 0
    assert script("fig_scaling").main(args) == 0
    printed = capsys.readouterr().out
    for png in (tmp_path / logs.name / "time_to_accuracy.png", tmp_path / "scaling_mlp.png"):
        assert png.stat().st_size > 10_000 and str(png) in printed
