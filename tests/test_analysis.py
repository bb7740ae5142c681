"""Run logs to frames, phases and metrics, on logs recorded by `dynpipe train`.

tests/data/logs/ holds three real CPU runs of the mlp on two gloo ranks:

    dynpipe train --nproc 2 --model mlp --steps 40 --log tests/data/logs/static.jsonl --no-progress
    dynpipe train --nproc 2 --model mlp --steps 80 --adapt measured \
        --scenario recipes/scenarios/emulate-3x-stage1.toml --log tests/data/logs/measured.jsonl
    dynpipe train --nproc 2 --model mlp --steps 80 --adapt restart --cooldown 100 \
        --scenario recipes/scenarios/emulate-3x-stage1.toml --log tests/data/logs/restart.jsonl \
        --save-dir /tmp/restart_ckpt
    dynpipe train --nproc 2 --model mlp --steps 60 --adapt measured \
        --scenario tests/data/logs/emulate-1.5x-stage1.toml --log tests/data/logs/light.jsonl

The heavy scenario switched a 3x emulated slowdown on stage 1's device on before step 30 and
off before step 70; the light one 1.5x from step 20 to 45.
"""

from __future__ import annotations

import dataclasses
import gzip
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dynpipe.analysis.logs import (
    expand_log_paths,
    group_experiments,
    load_run,
    load_runs,
    stages_frame,
    steps_frame,
)
from dynpipe.analysis.metrics import (
    choose_target,
    migration_costs,
    phase_stats,
    throughput,
    time_to_target,
)
from dynpipe.analysis.summary import render_summary, run_table
from dynpipe.errors import UserError
from dynpipe.runtime.records import read_log

LOGS = Path(__file__).parent / "data" / "logs"


@pytest.fixture(scope="module")
def static():
    return load_run(LOGS / "static.jsonl")


@pytest.fixture(scope="module")
def measured():
    return load_run(LOGS / "measured.jsonl")


@pytest.fixture(scope="module")
def restart():
    return load_run(LOGS / "restart.jsonl")


def test_recorded_logs_stay_small() -> None:
    assert sum(p.stat().st_size for p in LOGS.glob("*.jsonl")) < 200_000


def test_static_run_frames(static) -> None:
    raw = read_log(LOGS / "static.jsonl")
    (header,) = raw.headers
    assert static.mode == "static" and static.name == "static"
    assert static.model == "mlp" and static.device == "cpu" and static.num_stages == 2
    assert list(static.steps["step"]) == list(range(header.config["steps"]))
    assert set(static.steps["phase"]) == {"clean"} and static.windows == []
    assert static.condition == "no interference"
    # Every number in the frames is a number of the file.
    steps = raw.steps
    assert static.steps["step_ms"].tolist() == [r.step_ms for r in steps]
    assert static.steps["loss"].tolist() == [r.loss for r in steps]
    assert len(static.stages) == 2 * len(steps)
    row = static.stages.iloc[3]
    rec = steps[1].stages[1]
    assert (row["fwd_ms"], row["bwd_ms"], row["wait_ms"]) == (rec.fwd_ms, rec.bwd_ms, rec.wait_ms)
    assert row["busy"] == pytest.approx((rec.fwd_ms + rec.bwd_ms) / steps[1].step_ms)


def test_step_end_times_follow_step_durations(static) -> None:
    s = static.steps
    gaps_ms = np.diff(s["t_end"].to_numpy()) * 1e3
    durations = s["step_ms"].to_numpy()[1:]
    # Inside a logging window the next step ends exactly one step later; between windows the
    # gather of timings adds a little. Never less than the step itself.
    assert np.all(gaps_ms >= durations - 1e-3)
    within = np.isclose(gaps_ms, durations, atol=1e-3)
    assert within.sum() >= len(durations) - 4  # 40 steps, windows of 10: 3 boundaries
    assert s["elapsed_s"].iloc[0] > 0 and s["t_end"].is_monotonic_increasing


def test_throughput_counts_pauses(static, measured) -> None:
    for run in (static, measured):
        compute_only = run.batch_size * len(run.steps) / (run.steps["step_ms"].sum() / 1e3)
        assert 0 < throughput(run) <= compute_only


def test_phases_come_from_interference_events(measured) -> None:
    (w,) = measured.windows
    assert (w.start, w.stop, w.stage, w.emulated, w.factor) == (30, 70, 1, True, 3.0)
    assert w.label == "emulated ×3 on stage 1"
    ph = measured.steps.set_index("step")["phase"]
    assert set(ph.loc[:29]) == {"clean"}
    assert set(ph.loc[30:69]) == {"interference"}
    assert set(ph.loc[70:]) == {"after"}
    cond = measured.steps.set_index("step")["condition"]
    assert cond.loc[30] == cond.loc[75] == w.label and pd.isna(cond.loc[0])


def test_phase_stats_match_the_steps(measured) -> None:
    stats = phase_stats(measured, warmup=2).set_index("phase")
    assert list(stats.index) == ["clean", "interference", "after"]
    s = measured.steps
    inter = s[(s["step"] >= 30) & (s["step"] < 70)]["step_ms"]
    assert stats.loc["interference", "steps"] == 40
    assert stats.loc["interference", "mean_ms"] == pytest.approx(inter.mean())
    assert stats.loc["clean", "steps"] == 28  # 30 clean steps less the 2 warm-up steps
    moves = migration_costs([measured])
    assert stats["repartitions"].sum() == len(measured.events_of("repartition")) == len(moves)
    assert stats["bytes"].sum() == sum(e["bytes"] for e in measured.events_of("repartition"))


def test_migration_costs_from_events(measured, restart) -> None:
    m = migration_costs([measured])
    assert set(m["kind"]) == {"repartition"} and len(m) >= 1
    parts = m[["decide_ms", "transfer_ms", "rebuild_ms"]].sum(axis=1)
    assert np.allclose(parts, m["pause_ms"], atol=0.01)  # the runtime's own sum, rounded
    # The step records see every logged pause as a gap between two steps.
    both = migration_costs([measured, restart])
    assert (both["gap_ms"] >= 0.99 * both["pause_ms"]).all()
    r = migration_costs([restart])
    (row,) = r.itertuples()
    (resumed,) = restart.events_of("resumed")
    (decided,) = restart.events_of("restart")
    assert row.kind == "restart" and row.step == decided.step == resumed.step
    assert row.relaunch_ms == resumed["pause_ms"]
    assert row.pause_ms == pytest.approx(resumed["pause_ms"] + decided["decide_ms"])


def test_restart_log_spans_two_launches(restart) -> None:
    assert len(restart.headers) == 2 and restart.headers[1].start_step > 0
    s = restart.steps
    assert list(s["step"]) == list(range(restart.headers[0].config["steps"]))
    assert set(s["segment"]) == {0, 1}
    first_after = s[s["segment"] == 1].iloc[0]
    last_before = s[s["segment"] == 0].iloc[-1]
    (resumed,) = restart.events_of("resumed")
    # The wall-clock gap across the relaunch holds the whole relaunch pause.
    gap_s = first_after["t_end"] - first_after["step_ms"] / 1e3 - last_before["t_end"]
    assert gap_s >= resumed["pause_ms"] / 1e3 * 0.99


def test_time_to_target(static, measured) -> None:
    runs = [static, measured]
    target = choose_target(runs, quantile=0.2)
    times = [time_to_target(r, target) for r in runs]
    assert all(t is not None and t > 0 for t in times)
    assert time_to_target(static, float(static.steps["loss"].min()) - 1.0) is None
    first = static.steps["loss"].iloc[0]
    assert time_to_target(static, first, smooth=1) == static.steps["elapsed_s"].iloc[0]
    with pytest.raises(UserError, match="quantile"):
        choose_target(runs, quantile=1.5)


def test_load_runs_labels_and_unique_names(tmp_path) -> None:
    runs = load_runs([LOGS / "static.jsonl"], labels={"dynpipe": LOGS / "measured.jsonl"})
    assert [r.system for r in runs] == ["static", "dynpipe"]
    assert runs[1].mode == "measured"
    copy = tmp_path / "again" / "static.jsonl"
    copy.parent.mkdir()
    copy.write_bytes((LOGS / "static.jsonl").read_bytes())
    runs = load_runs([LOGS / "static.jsonl", copy])
    # Two static runs of one model and condition are two systems, told apart by folder.
    assert sorted(r.system for r in runs) == ["static (again)", "static (logs)"]
    # A folder: every log below it. Two measured runs under different interference are one
    # system, two runs: named after their files.
    runs = load_runs([LOGS])
    assert len(runs) == 4 and sum(r.system == "measured" for r in runs) == 2
    assert {"measured (light)", "measured (measured)"} <= {r.name for r in runs}
    assert set(steps_frame(runs)["run"]) == {r.name for r in runs}
    assert len(steps_frame(runs)) == sum(len(r.steps) for r in runs)
    assert len(stages_frame(runs)) == 2 * len(steps_frame(runs))


def test_bad_logs_are_one_line_errors(tmp_path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        load_run(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(UserError, match="no header record"):
        load_run(empty)
    header_only = tmp_path / "header_only.jsonl"
    header_only.write_text((LOGS / "static.jsonl").read_text().splitlines()[0] + "\n")
    with pytest.raises(UserError, match="no step records"):
        load_run(header_only)
    with pytest.raises(UserError, match="no run log"):
        load_runs([tmp_path / "nothing*.jsonl"])


def test_summary_tables(static, measured, restart) -> None:
    runs = [static, measured, restart]
    table = run_table(runs)
    assert table.set_index("run").loc["static", "speedup"] == pytest.approx(1.0)
    assert table.set_index("run").loc["restart", "restarts"] == 1
    md = render_summary(runs)
    for name in ("static", "measured", "restart", "interference", "after", "emulated ×3"):
        assert name in md
    assert md.count("\n| measured | repartition |") == len(measured.events_of("repartition"))
    both = render_summary(load_runs([LOGS / "light.jsonl", LOGS / "measured.jsonl"]))
    assert "| measured (light) | interference | emulated ×1.5 on stage 1 |" in both


def test_experiments_and_systems_from_file_names(tmp_path) -> None:
    # The flat layout bench/gpu_adapt.sh writes: <model>-<kind>-<mode>.jsonl in one folder.
    flat = tmp_path / "bench"
    flat.mkdir()
    for src, dst in (
        ("static", "mlp-emul-static"),
        ("static", "mlp-emul-static_tuned"),
        ("measured", "mlp-emul-measured"),
        ("restart", "mlp-other-restart"),
    ):
        (flat / f"{dst}.jsonl").write_bytes((LOGS / f"{src}.jsonl").read_bytes())
    groups = group_experiments(tmp_path)
    assert {k: len(v) for k, v in groups.items()} == {"bench/mlp-emul": 3, "bench/mlp-other": 1}
    runs = load_runs(groups["bench/mlp-emul"])
    assert sorted(r.system for r in runs) == ["measured", "static", "static_tuned"]
    assert group_experiments(LOGS) == {"logs": sorted(LOGS.glob("*.jsonl"))}
    with pytest.raises(UserError, match="no run logs under"):
        group_experiments(tmp_path / "none")


def test_compressed_logs_group_and_name_as_the_plain_ones(tmp_path) -> None:
    # Committed logs are X.jsonl.gz: experiments, systems and run names are those of X.jsonl.
    (tmp_path / "plain").mkdir()
    (tmp_path / "packed").mkdir()
    for src, dst in (
        ("static", "mlp-emul-static"),
        ("static", "mlp-emul-static_tuned"),
        ("restart", "mlp-emul-restart"),
        ("light", "mlp-x-static"),
    ):
        data = (LOGS / f"{src}.jsonl").read_bytes()
        (tmp_path / "plain" / f"{dst}.jsonl").write_bytes(data)
        (tmp_path / "packed" / f"{dst}.jsonl.gz").write_bytes(gzip.compress(data, mtime=0))
    plain, packed = group_experiments(tmp_path / "plain"), group_experiments(tmp_path / "packed")
    assert list(packed) == list(plain) == ["mlp-emul", "mlp-x"]
    for key in plain:
        a, b = load_runs(plain[key]), load_runs(packed[key])
        assert [(r.name, r.system) for r in b] == [(r.name, r.system) for r in a]
        if key == "mlp-emul":  # two static runs: named after what their file names add
            assert sorted(r.system for r in b) == ["restart", "static", "static_tuned"]
        assert all(x.steps.equals(y.steps) for x, y in zip(a, b, strict=True))
    # A path or pattern naming plain logs finds them compressed.
    assert expand_log_paths([tmp_path / "packed" / "mlp-x-static.jsonl"]) == packed["mlp-x"]
    assert expand_log_paths([str(tmp_path / "packed" / "*.jsonl")]) == sorted(
        packed["mlp-emul"] + packed["mlp-x"]
    )


def test_throughput_spans_steps_out_of_time_order(static) -> None:
    # A log whose relaunches started over (nothing saved to resume from) holds steps out of
    # time order: the span is from the earliest start to the latest end, never negative.
    shuffled = dataclasses.replace(static, steps=static.steps.iloc[::-1].reset_index(drop=True))
    assert throughput(shuffled) == pytest.approx(throughput(static))
    assert throughput(shuffled) > 0
