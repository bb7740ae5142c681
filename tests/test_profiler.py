"""Profiler: layer timing under a real neighbour, sweep files, datasets, resumable sweeps."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from dynpipe.cli import main
from dynpipe.devices.interfere import start_interferer
from dynpipe.devices.telemetry import TelemetrySampler
from dynpipe.errors import UserError
from dynpipe.models import get_model
from dynpipe.profiler.conditions import NONE, load_sweep, parse_condition
from dynpipe.profiler.layers import LayerBench, TimingConfig, static_features
from dynpipe.profiler.schema import COLUMNS, load_profiles, read_metadata, write_profiles

ROOT = Path(__file__).resolve().parents[1]
CORE = 0


def _autogroup_nice(value: int | None) -> int | None:
    """Set this session's autogroup nice (Linux autogroup scheduling); return the old one."""
    path = Path("/proc/self/autogroup")
    try:
        old = int(path.read_text().split("nice")[1])
        if value is not None:
            path.write_text(str(value))
        return old
    except (OSError, IndexError, ValueError):
        return None


@pytest.fixture
def pinned():
    """One core, one torch thread and, where allowed, raised priority for this test's process
    and the interferers it starts (they inherit it and share its session): the experiment
    then competes with its own spinner on equal terms, while the other tenants of a shared
    machine weigh ~10x less. With autogroup scheduling the CPU is split between sessions
    first, so the session's priority is raised too. All restored afterwards."""
    old_aff = os.sched_getaffinity(0)
    old_threads = torch.get_num_threads()
    old_nice = os.getpriority(os.PRIO_PROCESS, 0)
    os.sched_setaffinity(0, {CORE})
    torch.set_num_threads(1)
    with contextlib.suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    old_group = _autogroup_nice(None)
    if old_group is not None:
        _autogroup_nice(-10)
    yield
    if old_group is not None:
        _autogroup_nice(old_group)
    with contextlib.suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, 0, old_nice)
    os.sched_setaffinity(0, old_aff)
    torch.set_num_threads(old_threads)


def _spin_trial(bench: LayerBench, cfg: TimingConfig, sampler: TelemetrySampler, rounds: int):
    """Alternate short measurements alone and beside a spinner on our core, so both see the
    same background load of this shared machine; the spinner stays up and is switched by its
    duty cycle. Returns the raw samples of every measurement and the telemetry windows."""
    alone, loaded, tel_alone, tel_loaded = [], [], [], []
    with start_interferer(kind="spin", intensity=0.0, cores=(CORE,), period_ms=20) as spin:
        for _ in range(rounds):
            for intensity, times, tels in ((0.0, alone, tel_alone), (1.0, loaded, tel_loaded)):
                spin.set_intensity(intensity)
                time.sleep(0.05)  # the spinner finishes its current burst or pause
                sampler.reset()
                times.append(np.array(bench.time(1, "fwd", cfg).samples_ms))
                tels.append(sampler.window())
    return alone, loaded, tel_alone, tel_loaded


def _mean(tels: list[dict], key: str) -> float:
    return float(np.nanmean([t[key] for t in tels]))


@pytest.mark.timing
def test_spin_on_our_core_slows_a_layer_and_telemetry_sees_it(pinned):
    # fc00 of a 512-wide mlp at batch 256: a ~1-3 ms matmul on one core.
    model = get_model("mlp", depth=1, width=512, in_features=512)
    bench = LayerBench(model, batch_size=256)
    # Samples of 30 ms span several scheduler slices, so each one sees the average CPU share
    # left by the spinner rather than whether it happened to fit inside one of our slices.
    # Measurements alone and beside the spinner alternate, so the bursts of load from other
    # tenants of this machine fall on both sets alike; the medians drop the spoilt samples.
    cfg = TimingConfig(warmup=1, repeats=3, sample_ms=30)
    bench.time(1, "fwd", cfg)  # first-call costs (allocator, oneDNN primitives) out of the way
    with TelemetrySampler("cpu", cores=[CORE]) as sampler:
        for _attempt in range(4):  # the machine is shared: retry a noisy trial (a few s each)
            alone, loaded, tel_alone, tel_loaded = _spin_trial(bench, cfg, sampler, rounds=10)
            # Two baselines pooled from alternate rounds: their ratio is the slowdown the
            # profiler reports with no interferer.
            noise = float(
                np.median(np.concatenate(alone[1::2])) / np.median(np.concatenate(alone[0::2]))
            )
            t_alone = float(np.median(np.concatenate(alone)))
            slowdown = float(np.median(np.concatenate(loaded))) / t_alone
            other_alone = _mean(tel_alone, "tel_other_util")
            other_loaded = _mean(tel_loaded, "tel_other_util")
            procs_loaded = _mean(tel_loaded, "tel_other_procs")
            if (
                0.9 <= noise <= 1.1
                and slowdown >= 1.3
                and other_loaded >= other_alone + 10
                and procs_loaded >= 0.5
            ):
                break
    assert 0.3 <= t_alone <= 20, f"layer took {t_alone:.2f} ms; the test wants ~1-5 ms"
    assert 0.9 <= noise <= 1.1, [np.median(a) for a in alone]
    assert slowdown >= 1.3, (t_alone, [np.median(s) for s in loaded])
    assert other_loaded >= other_alone + 10, (tel_alone, tel_loaded)
    assert procs_loaded >= 0.5, tel_loaded


def test_backward_and_static_features():
    model = get_model("mlp", depth=1, width=32, in_features=16)
    bench = LayerBench(model, batch_size=8)
    cfg = TimingConfig(warmup=1, repeats=2, sample_ms=1)
    timings = list(bench.time_all(cfg))
    assert [(t.index, t.phase) for t in timings] == [
        (i, p) for i in range(len(model)) for p in ("fwd", "bwd")
    ]
    assert all(t.time_p10_ms <= t.time_ms <= t.time_p90_ms for t in timings)
    # Repeated backward passes must not leave gradients behind.
    assert all(p.grad is None for layer in bench.layers for p in layer.parameters())
    rows = static_features(model, batch_size=8)
    fc = [r for r in rows if r["layer"] == "fc00"]
    assert fc[0]["flops"] == 2 * 8 * 32 * 32  # one 32x32 matmul over a batch of 8
    assert fc[1]["flops"] == 2 * fc[0]["flops"]  # input and weight gradients
    moved = fc[0]["param_bytes"] + fc[0]["in_bytes"] + fc[0]["out_bytes"]
    assert fc[0]["arith_intensity"] == pytest.approx(fc[0]["flops"] / moved)


# ----------------------------------------------------------------------------- sweeps


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "sweep.toml"
    p.write_text(text)
    return p


def test_sweep_grid_and_condition_ids(tmp_path):
    p = _write(
        tmp_path,
        """
[sweep]
name = "t"
sample_ms = 30
[defaults.membw]
buffer_mb = 32
[[conditions]]
kind = "spin"
intensity = [0.25, 1.0]
count = [1, 2]
[[conditions]]
kind = "membw"
intensity = 0.5
cores = "other"
[[conditions]]
mix = [{kind = "spin", intensity = 0.5}, {kind = "membw", intensity = 1.0}]
""",
    )
    sw = load_sweep(p, device="cpu", cores=[0])
    ids = [c.id for c in sw.conditions]
    assert ids[0] == NONE
    assert ids[1:5] == ["spin@0.25x1", "spin@1x1", "spin@0.25x2", "spin@1x2"]
    assert ids[5].startswith("membw@0.5x1:c")  # placed on the other cores: named so
    assert ids[6] == "spin@0.5x1+membw@1x1"
    mix = sw.conditions[6]
    assert mix.interferer == "mix" and mix.n_jobs == 2 and mix.intensity == 0.75
    assert mix.specs[1].buffer_mb == 32  # per-kind defaults applied
    # Intensity varies fastest, so neighbours differ in duty cycle only: processes are reused.
    assert sw.conditions[2].reusable_from(sw.conditions[1])
    assert not sw.conditions[3].reusable_from(sw.conditions[2])  # counts differ
    assert not sw.conditions[6].reusable_from(sw.conditions[5])
    assert parse_condition("spin@0.5x2", cores=[0]).id == "spin@0.5x2"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ('[[conditions]]\nkind = "gpu_burn"\n', "'gpu_burn'"),
        ('[[conditions]]\nmix = [{kind = "spin"}, {kind = "hog"}]\n', "'hog'"),
        ("[defaults.hog]\nsize = 3\n", "'hog'"),
    ],
)
def test_sweep_unknown_kind_is_one_clear_line(tmp_path, body, needle):
    p = _write(tmp_path, body)
    with pytest.raises(UserError) as err:
        load_sweep(p)
    msg = str(err.value)
    assert "\n" not in msg and needle in msg
    assert "gemm, copy, train, spin, membw" in msg


def test_sweep_other_errors_are_one_line(tmp_path):
    cases = [
        ('[[conditions]]\nkind = "gemm"\n', "needs a GPU"),
        ('[[conditions]]\nkind = "spin"\nintensity = 2\n', "outside [0, 1]"),
        ('[[conditions]]\nkind = "spin"\nwidth = 2\n', "unknown interferer field"),
        ("[sweep]\nrepeat = 3\n", "unknown [sweep] key"),
        ("[sweep]\nsample_ms = 5\nperiod_ms = 25\n", "sample_ms"),
        ("[[conditions]\n", "not valid TOML"),
    ]
    for body, needle in cases:
        with pytest.raises(UserError, match=None) as err:
            load_sweep(_write(tmp_path, body), device="cpu")
        assert needle in str(err.value), (body, str(err.value))
        assert "\n" not in str(err.value).strip()


def test_cli_unknown_kind_exits_2_with_one_line(tmp_path, capsys):
    p = _write(tmp_path, '[[conditions]]\nkind = "stress"\nintensity = 0.5\n')
    rc = main(
        [
            "profile",
            "--model",
            "mlp",
            "--batch-size",
            "4",
            "--sweep",
            str(p),
            "-o",
            str(tmp_path / "x.parquet"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1
    assert "'stress'" in err and "spin" in err and "membw" in err
    assert not (tmp_path / "x.parquet").exists()


@pytest.mark.parametrize(("sizes", "bad"), [("-3", "-3"), ("0", "0"), ("8,0", "0")])
def test_cli_batch_size_below_one_exits_2_with_one_line(tmp_path, capsys, sizes, bad):
    smoke = ROOT / "recipes" / "sweeps" / "smoke.toml"
    out = tmp_path / "y.parquet"
    argv = ["profile", "--model", "mlp", "--batch-size", sizes, "--sweep", str(smoke)]
    rc = main([*argv, "-o", str(out), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.splitlines() == [
        f"dynpipe profile: error: --batch-size {bad}: batch sizes must be >= 1; "
        "give e.g. --batch-size 32 or 32,64"
    ]
    assert not out.exists()


def test_shipped_sweeps_parse():
    for name in ("cpu", "smoke"):
        sw = load_sweep(ROOT / "recipes" / "sweeps" / f"{name}.toml", device="cpu", cores=[0])
        assert sw.conditions[0].id == NONE and len(sw.conditions) > 1
    gpu = load_sweep(ROOT / "recipes" / "sweeps" / "gpu.toml", device="cuda:0")
    kinds = {c.interferer for c in gpu.conditions}
    assert {"gemm", "copy", "train"} <= kinds
    for kind in ("gemm", "copy", "train"):
        levels = {c.intensity for c in gpu.conditions if c.interferer == kind and c.n_jobs == 1}
        assert len(levels) >= 3, (kind, levels)


def test_sweep_end_to_end_resume_and_summary(tmp_path, capsys):
    out = tmp_path / "p.parquet"
    sweep = _write(
        tmp_path,
        """
[sweep]
warmup = 1
repeats = 2
sample_ms = 10
period_ms = 10
settle_s = 0.05
recheck_baseline = false
[[conditions]]
kind = "spin"
intensity = [0.5, 1.0]
""",
    )
    args = [
        "profile",
        "--model",
        "mlp",
        "--set",
        "depth=1",
        "--set",
        "width=32",
        "--batch-size",
        "8,16",
        "--sweep",
        str(sweep),
        "--cores",
        str(CORE),
        "--quiet",
        "-o",
        str(out),
    ]
    old_aff, old_threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        assert main(args) == 0
        df = load_profiles(out)
        layers = len(get_model("mlp", depth=1, width=32))
        assert len(df) == layers * 2 * 2 * 3  # layers x phases x batch sizes x conditions
        assert list(df.columns[: len(COLUMNS)]) == list(COLUMNS)
        base = df[df["condition"] == NONE]
        assert (base["slowdown"] == 1.0).all()
        assert df["slowdown"].notna().all() and (df["time_ms"] > 0).all()
        assert set(df["interferer"]) == {"none", "spin"}
        assert (df.loc[df["condition"] == "spin@1x1", "n_jobs"] == 1).all()
        meta = read_metadata(out)
        assert meta["device_type"] == "cpu" and meta["schema_version"] == 1
        assert meta["interferer_runs"][0]["conditions"] == ["spin@0.5x1", "spin@1x1"]
        mtime = out.stat().st_mtime_ns
        # Everything is measured already: a second run measures nothing and keeps the file.
        assert main(args) == 0
        assert out.stat().st_mtime_ns == mtime
        # A different timing setup must not be mixed into the same file.
        assert main([*args, "--repeats", "3"]) == 2
        assert "repeats" in capsys.readouterr().err
    finally:
        os.sched_setaffinity(0, old_aff)
        torch.set_num_threads(old_threads)
    assert main(["profile", "summary", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Slowdown per condition" in text and "spin@1x1" in text


def test_summary_into_a_closed_pipe_exits_quietly():
    # `dynpipe profile summary X | head -1`: the reader is gone once it has its line. Closing
    # the read end before the command starts makes that race certain.
    read, write = os.pipe()
    os.close(read)
    profile = ROOT / "profiles" / "cpu-xeon-2c.parquet"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "dynpipe", "profile", "summary", str(profile)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    finally:
        os.close(write)
    assert proc.stderr == ""
    assert proc.returncode == 141  # 128 + SIGPIPE, as for `cat FILE | head -1`


def test_resume_measures_only_missing_windows(tmp_path):
    from dynpipe.profiler.conditions import Sweep
    from dynpipe.profiler.sweep import run_sweep

    out = tmp_path / "r.parquet"
    full = load_sweep(
        _write(
            tmp_path,
            "[sweep]\nsample_ms = 5\nperiod_ms = 5\nwarmup = 1\n"
            "repeats = 1\nsettle_s = 0\nrecheck_baseline = false\n"
            '[[conditions]]\nkind = "spin"\nintensity = 0.5\n',
        )
    )
    first = Sweep(**{**full.__dict__, "conditions": full.conditions[:1]})
    models = [("mlp", {"depth": 1, "width": 16})]
    run_sweep(models, batch_sizes=[4], sweep=first, out=out, progress=False)
    df1 = load_profiles(out)
    assert set(df1["condition"]) == {NONE}
    df2 = run_sweep(models, batch_sizes=[4], sweep=full, out=out, progress=False)
    assert set(df2["condition"]) == {NONE, "spin@0.5x1"}
    # The baseline rows were kept, not re-measured.
    kept = df2[df2["condition"] == NONE].reset_index(drop=True)
    pd.testing.assert_series_equal(kept["time_ms"], df1["time_ms"], check_names=False)


@pytest.mark.filterwarnings("ignore:the 'none' baseline:RuntimeWarning")  # µs layers: noisy
def test_repeated_baselines_are_pooled(tmp_path):
    from dynpipe.profiler.sweep import run_sweep

    sweep = load_sweep(
        _write(
            tmp_path,
            """
[sweep]
sample_ms = 5
period_ms = 5
warmup = 1
repeats = 2
settle_s = 0
baseline_every = 1
recheck_baseline = true
[[conditions]]
kind = "spin"
intensity = [0.5, 1.0]
""",
        )
    )
    out = tmp_path / "b.parquet"
    df = run_sweep(
        [("mlp", {"depth": 1, "width": 16})], batch_sizes=[4], sweep=sweep, out=out, progress=False
    )
    runs = read_metadata(out)["baseline_runs"]
    # After every interference condition; the one after the last is the final recheck.
    assert [r["after"] for r in runs] == ["spin@0.5x1", "spin@1x1"]
    assert all(r["n"] == len(df[df["condition"] == NONE]) for r in runs)
    base = df[df["condition"] == NONE]
    assert (base["repeats"] == 3 * 2).all()  # three baseline measurements of two samples
    assert base["samples_ms"].map(len).eq(6).all()
    assert (base["slowdown"] == 1.0).all()
    assert read_metadata(out)["baseline_drift"] == runs[-1]


# ---------------------------------------------------------------------------- datasets


def _tiny_frame() -> pd.DataFrame:
    row = {c: 0 for c in COLUMNS}
    row.update(
        model="mlp",
        layer="fc00",
        kind="linear",
        phase="fwd",
        dtype="float32",
        device_type="cpu",
        device_name="x",
        condition="none",
        interferer="none",
    )
    for c, fam in COLUMNS.items():
        if fam == "float":
            row[c] = 1.0
    return pd.DataFrame([row])


def _meta():
    return {
        "device_name": "x",
        "device_type": "cpu",
        "driver": "d",
        "torch_version": "t",
        "date": "now",
        "command": "test",
    }


def test_dataset_missing_or_renamed_column_is_one_line(tmp_path):
    good = tmp_path / "good.parquet"
    write_profiles(_tiny_frame(), good, meta=_meta())
    assert len(load_profiles(good)) == 1
    assert load_profiles([good, good]).attrs["dynpipe"][1]["path"] == str(good)

    renamed = tmp_path / "renamed.parquet"
    df = pd.read_parquet(good).rename(columns={"tel_util": "gpu_util"})
    _write_raw(df, renamed, good)
    with pytest.raises(UserError) as err:
        load_profiles(renamed)
    msg = str(err.value)
    assert "\n" not in msg and "tel_util" in msg and "gpu_util" in msg and "renamed" in msg

    missing = tmp_path / "missing.parquet"
    _write_raw(pd.read_parquet(good).drop(columns=["slowdown", "flops"]), missing, good)
    with pytest.raises(UserError) as err:
        load_profiles(missing)
    assert "\n" not in str(err.value) and "flops, slowdown" in str(err.value)


def _write_raw(df: pd.DataFrame, path: Path, like: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    meta = pq.read_schema(like).metadata
    table = pa.Table.from_pandas(df, preserve_index=False)
    pq.write_table(table.replace_schema_metadata(meta), path)


def test_dataset_corrupt_inputs_are_one_line(tmp_path):
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    bare = tmp_path / "bare.parquet"
    _tiny_frame().to_parquet(bare)
    wrong_type = tmp_path / "type.parquet"
    write_profiles(_tiny_frame(), tmp_path / "ok.parquet", meta=_meta())
    _write_raw(_tiny_frame().assign(time_ms="fast"), wrong_type, tmp_path / "ok.parquet")
    cases = [
        (tmp_path / "none.parquet", "does not exist"),
        (junk, "not a readable parquet"),
        (bare, "no 'dynpipe' metadata"),
        (wrong_type, "time_ms"),
    ]
    for path, needle in cases:
        with pytest.raises(UserError) as err:
            load_profiles(path)
        assert needle in str(err.value) and "\n" not in str(err.value), path


def test_shipped_datasets_load():
    paths = sorted((ROOT / "profiles").glob("*.parquet"))
    assert paths, "profiles/ ships at least one measured dataset"
    df = load_profiles(paths)
    assert (df.loc[df["condition"] == NONE, "slowdown"] == 1.0).all()
    assert df["slowdown"].notna().all()
