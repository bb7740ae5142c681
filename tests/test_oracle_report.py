"""``bench/oracle.py report``: a system's ratio to the oracle split into the splits it held
(``choice``) and how its launch ran them (``execution``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]


def _module():
    return load_script("bench/oracle.py", "oracle_bench")


def _steps(splits: list[tuple[int, int]], step_ms: list[float]) -> list[dict]:
    """Step records as the report reads them: the split held and the step's end time."""
    t, out = 0.0, []
    for i, ((a, b), ms) in enumerate(zip(splits, step_ms, strict=True)):
        t += ms / 1e3
        out.append({"step": i, "t_end": t, "stages": [{"layers": [0, a]}, {"layers": [a, a + b]}]})
    return out


SWEEP = {"5|11": 50.0, "8|8": 60.0}  # the sweep's ms per step of each split


def test_a_run_on_the_oracles_split_all_phase_has_choice_one_and_its_launch_is_the_rest() -> None:
    mod = _module()
    steps = _steps([(5, 11)] * 11, [55.0] * 11)
    held = mod._held_ms(steps, 1, 11, SWEEP)
    assert held == 50.0  # choice 1: only the launch's 10% is left, in execution
    assert abs(mod._phase_ms(steps, 1, 11) / held - 1.1) < 1e-9


def test_the_splits_held_are_weighted_by_steps() -> None:
    mod = _module()
    # Two steps on 8|8 before the move, eight on 5|11, run exactly as fast as the sweep.
    splits = [(8, 8)] * 3 + [(5, 11)] * 8
    steps = _steps(splits, [SWEEP[f"{a}|{b}"] for a, b in splits])
    held = mod._held_ms(steps, 1, 11, SWEEP)
    assert abs(held - (2 * 60.0 + 8 * 50.0) / 10) < 1e-9
    assert abs(mod._phase_ms(steps, 1, 11) - held) < 1e-9  # execution 1


def test_a_split_the_sweep_did_not_measure_or_a_missing_step_gives_no_factors() -> None:
    mod = _module()
    steps = _steps([(5, 11)] * 5 + [(6, 10)] * 5, [50.0] * 10)
    assert mod._held_ms(steps, 1, 10, SWEEP) is None
    assert mod._held_ms(steps, 1, 5, SWEEP) == 50.0
    del steps[3]
    assert mod._held_ms(steps, 1, 5, SWEEP) is None


def test_a_sweep_measures_its_first_split_by_its_later_visit_when_there_is_one() -> None:
    from dynpipe.analysis.metrics import sweep_split_ms

    # 8|8 from the launch (slow while it warms up), then 5|11, then 8|8 again; 2-step windows.
    splits = ["8|8"] * 6 + ["5|11"] * 6 + ["8|8"] * 6
    ms = [90.0] * 6 + [50.0] * 6 + [60.0] * 6
    t = np.cumsum(ms) / 1e3
    steps = list(zip(range(18), t, splits, strict=True))
    got = sweep_split_ms(steps, {6, 12}, onset=100, warmup=1, every=2)["clean"]
    assert got == pytest.approx({"8|8": 60.0, "5|11": 50.0})  # the warm-up visit left out
    # Without the later visit (an older sweep), the launch's visit is all there is.
    got = sweep_split_ms(steps[:12], {6}, onset=100, warmup=1, every=2)["clean"]
    assert got == pytest.approx({"8|8": 90.0, "5|11": 50.0})


@pytest.mark.slow
def _report(run: Path, out: Path) -> dict:
    """``bench/oracle.py report`` of the run folder ``run``, as written to ``out``."""
    subprocess.run(
        [sys.executable, str(ROOT / "bench/oracle.py"), "report", str(run), "-o", str(out)],
        check=True,
        timeout=120,
        cwd=ROOT,
    )
    return json.loads(out.read_text())


def test_a_cpu_run_reports_every_phase_with_its_factors_and_the_repeated_sweep(tmp_path) -> None:
    """The benchmark end to end on CPU (gloo, 2 ranks, a small MLP, an emulated interferer):
    a sweep, static and the sweep again, then the report from their logs."""
    out = tmp_path / "run"
    run = [sys.executable, str(ROOT / "bench/oracle.py"), "run", "--config", "mlp-cpu",
           "--device", "cpu", "--nproc", "2", "--interferer", "emulate", "--stage", "1",
           "--steps", "30", "--onset", "12", "--end", "22", "--warmup", "2",
           "--monitor-every", "2", "--sweep-windows", "2", "--timeout", "240",
           "--systems", "sweep,static,resweep", "-o", str(out)]  # fmt: skip
    subprocess.run(run, check=True, timeout=600, cwd=ROOT)
    doc = _report(out, tmp_path / "report.json")
    assert set(doc["phases"]) == {"clean", "interference", "after"}
    for ph in doc["phases"].values():
        splits = ph["splits"]
        assert len(splits) == 9  # every 2-stage split of the MLP's 10 layers was swept
        static = ph["systems"]["static"]
        # Static holds the even split all run: its held time is the sweep's time of 5|5.
        assert abs(static["held_ms"] - splits["5|5"]) <= 1e-3
        assert abs(static["choice"] * static["execution"] - static["ratio"]) < 2e-3
        again = ph["repeat"]
        assert sum(again["split"]) == 10 and again["oracle_split_ms"] > 0
    # An interferer from the run's start (onset within the warm-up) has no clean phase.
    meta = json.loads((out / "oracle.json").read_text())
    (out / "oracle.json").write_text(json.dumps({**meta, "onset": 1}))
    doc = _report(out, tmp_path / "report.json")
    assert set(doc["phases"]) == {"interference", "after"}
    assert doc["phases"]["interference"]["systems"]["static"]["ms"] > 0


@pytest.mark.slow
def test_plan_profile_starts_every_system_from_the_planned_split(tmp_path) -> None:
    """``--plan-profile``: ``dynpipe plan`` on the profile picks the first split, and the
    systems run from it (static holds it), not from the even split."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_planner_costs import profile_frame

    from dynpipe.models import get_model
    from dynpipe.profiler.schema import write_profiles

    oracle = _module()
    pairs = list(zip(oracle.CONFIGS["mlp-cpu"][::2], oracle.CONFIGS["mlp-cpu"][1::2], strict=True))
    sets = dict(a.split("=") for f, a in pairs if f == "--model-arg")
    model = get_model(dict(pairs)["--model"], **{k: int(v) for k, v in sets.items()})
    # Layer i measured (i + 1) times the first: the planner gives the first stage more layers.
    df = profile_frame(model="mlp", layers=len(model))
    df["layer"] = df["layer_index"].map(dict(enumerate(model.layer_names)))
    prof = tmp_path / "mlp.parquet"
    meta = {k: "test" for k in ("device_name", "driver", "torch_version", "date", "command")}
    write_profiles(df, prof, meta={**meta, "device_type": "cpu"})
    out = tmp_path / "run"
    run = [sys.executable, str(ROOT / "bench/oracle.py"), "run", "--config", "mlp-cpu",
           "--device", "cpu", "--nproc", "2", "--interferer", "emulate", "--stage", "1",
           "--steps", "6", "--onset", "2", "--end", "4", "--warmup", "1",
           "--monitor-every", "2", "--timeout", "240", "--systems", "static",
           "--plan-profile", str(prof), "-o", str(out)]  # fmt: skip
    subprocess.run(run, check=True, timeout=600, cwd=ROOT)
    first = json.loads((out / "oracle.json").read_text())["initial_split"]
    assert sum(first) == len(model) and first[0] > first[1], first
    steps, _ = oracle._read(out / "static.jsonl")
    assert steps and {oracle._split(r) for r in steps} == {f"{first[0]}|{first[1]}"}
