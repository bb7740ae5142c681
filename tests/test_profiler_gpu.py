"""GPU checks of the profiler: real interferers on the device, NVML telemetry, a tiny sweep.

Run on the GPU machine: ``python -m pytest -m gpu tests/test_profiler_gpu.py``.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from torch import nn

from dynpipe.devices.interfere import start_interferer
from dynpipe.devices.telemetry import TelemetrySampler
from dynpipe.models import InputSpec, LayeredModel, LayerSpec, get_model
from dynpipe.profiler.layers import LayerBench, TimingConfig
from dynpipe.profiler.schema import load_profiles, read_metadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda:0"


def _gone(pids: list[int]) -> bool:
    import psutil

    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


@pytest.fixture(scope="module")
def bench() -> LayerBench:
    # fc00 of a 4096-wide mlp at batch 4096: a 137 GFLOP matmul, a few ms in fp32.
    return LayerBench(
        get_model("mlp", depth=1, width=4096, in_features=4096), batch_size=4096, device=DEV
    )


def test_gemm_neighbour_slows_a_layer_and_nvml_sees_it(bench):
    cfg = TimingConfig(warmup=3, repeats=5, sample_ms=25)
    with TelemetrySampler(DEV) as tel:
        alone = bench.time(1, "fwd", cfg).time_ms
        tel.reset()
        quiet = tel.window()
        with start_interferer(kind="gemm", intensity=1.0, device=DEV) as itf:
            time.sleep(0.5)
            tel.reset()
            loaded = bench.time(1, "fwd", cfg).time_ms
            busy = tel.window()
            pids = itf.pids
        again = bench.time(1, "fwd", cfg).time_ms
    assert 0.9 <= again / alone <= 1.1, (alone, again)
    assert loaded / alone >= 1.3, (alone, loaded)  # two contexts time-slice the GPU
    assert busy["tel_other_procs"] >= 1, busy
    assert busy["tel_util"] >= 50, busy
    assert busy["tel_clock_mhz"] > 0 and busy["tel_mem_used_mb"] > 0, busy
    if not math.isnan(busy["tel_other_util"]):  # NaN only when NVML pids are foreign
        assert busy["tel_other_util"] > quiet.get("tel_other_util", 0.0), (quiet, busy)
    assert _gone(pids)
    assert tel.tick_cost_ms < 2.5  # CPU per 50 ms tick: under 5 % of one core


@pytest.mark.parametrize("kind", ["gemm", "copy", "train"])
def test_each_gpu_kind_starts_runs_and_leaves_nothing(kind):
    itf = start_interferer(kind=kind, intensity=0.5, device=DEV, ready_timeout_s=120)
    try:
        time.sleep(1.0)
        assert itf.ready and itf.alive
    finally:
        stats = itf.stop()
    assert _gone(itf.pids)
    assert stats and stats[0]["iters"] > 0
    # Wall-time duty cycle: within a generous band of the asked 0.5 (units can be long).
    assert 0.3 <= stats[0]["duty"] <= 0.75, stats


def test_copy_slows_a_memory_bound_layer():
    # GELU over 1 GiB of activations: no FLOPs to speak of, bound by HBM bandwidth.
    model = LayeredModel(
        name="gelu",
        layers=(LayerSpec("act", "act", nn.GELU),),
        loss_fn=nn.functional.mse_loss,
        input_spec=InputSpec(shape=(16384,), target_shape=(16384,), target_dtype=torch.float32),
    )
    bench = LayerBench(model, batch_size=16384, device=DEV)
    cfg = TimingConfig(warmup=3, repeats=5, sample_ms=25)
    alone = bench.time(0, "fwd", cfg).time_ms
    with start_interferer(kind="copy", intensity=1.0, device=DEV):
        time.sleep(0.5)
        loaded = bench.time(0, "fwd", cfg).time_ms
    assert loaded / alone >= 1.2, (alone, loaded)


def test_tiny_gpu_sweep(tmp_path):
    from dynpipe.profiler.conditions import load_sweep
    from dynpipe.profiler.sweep import run_sweep

    sweep_file = tmp_path / "s.toml"
    sweep_file.write_text(
        "[sweep]\nwarmup = 1\nrepeats = 2\nsample_ms = 20\nperiod_ms = 20\nsettle_s = 0.2\n"
        '[[conditions]]\nkind = "gemm"\nintensity = [0.5, 1.0]\n'
    )
    out = tmp_path / "g.parquet"
    sweep = load_sweep(sweep_file, device=DEV)
    run_sweep(
        [("mlp", {"depth": 2, "width": 2048, "in_features": 2048})],
        batch_sizes=[2048],
        sweep=sweep,
        out=out,
        device=DEV,
        progress=False,
    )
    df = load_profiles(out)
    meta = read_metadata(out)
    assert meta["device_type"] == "cuda" and meta["device_name"] == torch.cuda.get_device_name(0)
    assert set(df["condition"]) == {"none", "gemm@0.5x1", "gemm@1x1"}
    big = df[(df["layer"] == "fc00")]
    s = big.set_index(["condition", "phase"])["slowdown"]
    assert np.all(s.loc["gemm@1x1"] >= s.loc["gemm@0.5x1"] * 0.9)
    assert (s.loc["gemm@1x1"] >= 1.3).all(), s
    assert df["tel_util"].notna().all() and df["tel_clock_mhz"].notna().all()
