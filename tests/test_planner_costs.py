"""CostModel: construction from stats, profiles and slowdowns; validation."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest

from dynpipe.errors import UserError
from dynpipe.models import get_model
from dynpipe.planner.costs import CostModel, parse_slowdown
from dynpipe.planner.make import make_plan


@dataclass
class FakeStats:
    name: str
    index: int
    kind: str
    fwd_flops: int
    bwd_flops: int
    param_bytes: int
    param_count: int
    in_bytes: int
    out_bytes: int
    buffer_bytes: int = 0
    saved_bytes: int = 0


def _stats(n: int = 4) -> list[FakeStats]:
    return [
        FakeStats(
            f"l{i}",
            i,
            "linear",
            fwd_flops=(i + 1) * 10**9,
            bwd_flops=2 * (i + 1) * 10**9,
            param_bytes=4000 * (i + 1),
            param_count=1000 * (i + 1),
            in_bytes=800,
            out_bytes=400,
            saved_bytes=1200,
        )
        for i in range(n)
    ]


def test_analytic_roofline_from_layer_stats() -> None:
    cm = CostModel.from_layer_stats(
        _stats(),
        model="toy",
        num_devices=3,
        flops_per_s=1e12,
        mem_bytes_per_s=None,
        overhead_ms=0.0,
        bandwidth=1e9,
        latency_ms=0.1,
        optimizer="sgd",
    )
    assert cm.fwd_ms.shape == (3, 4) and cm.num_devices == 3
    np.testing.assert_allclose(cm.fwd_ms[0], [1.0, 2.0, 3.0, 4.0])  # 1 GFLOP at 1 TFLOP/s
    np.testing.assert_allclose(cm.bwd_ms[2], [2.0, 4.0, 6.0, 8.0])
    np.testing.assert_allclose(cm.act_bytes, 1200)  # autograd's saved bytes, not in+out
    np.testing.assert_allclose(cm.static_bytes, np.array([4000, 8000, 12000, 16000]) * 3)
    np.testing.assert_allclose(cm.state_bytes, np.array([4000, 8000, 12000, 16000]) * 2)
    assert cm.meta["source"] == "analytic" and cm.bandwidth.tolist() == [1e9, 1e9]
    # A memory-bound layer (no FLOPs) still costs its bytes at the memory bandwidth.
    st = _stats(1)
    st[0].fwd_flops = 0
    mem = CostModel.from_layer_stats(
        st, model="toy", flops_per_s=1e12, mem_bytes_per_s=1e6, overhead_ms=0.0
    )
    assert mem.fwd_ms[0, 0] == pytest.approx((4000 + 800 + 400) / 1e6 * 1e3)


def test_from_model_uses_layer_stats_of_a_zoo_model() -> None:
    model = get_model("mlp", depth=3, width=32)
    cm = CostModel.from_model(model, microbatch_size=4, num_devices=2)
    assert cm.layer_names == tuple(model.layer_names)
    assert cm.fingerprint == model.fingerprint() and cm.microbatch_size == 4
    assert np.all(cm.fwd_ms > 0) and np.all(cm.param_bytes > 0)
    plan = make_plan(cm, num_stages=2, microbatches=4)
    plan.validate(model, world_size=2)
    assert plan.meta["costs"]["source"] == "analytic"


def test_slowdown_vector_and_matrix() -> None:
    cm = CostModel.from_layer_stats(
        _stats(),
        model="toy",
        num_devices=2,
        flops_per_s=1e12,
        mem_bytes_per_s=None,
        overhead_ms=0.0,
    )
    slow = cm.with_slowdown([1.0, 2.4])
    np.testing.assert_allclose(slow.fwd_ms[1], cm.fwd_ms[1] * 2.4)
    np.testing.assert_allclose(slow.fwd_ms[0], cm.fwd_ms[0])
    mat = np.ones((2, 4))
    mat[0, 3] = 3.0
    per_layer = cm.with_slowdown(mat, bwd=np.full((2, 4), 0.5))
    assert per_layer.fwd_ms[0, 3] == pytest.approx(3 * cm.fwd_ms[0, 3])
    np.testing.assert_allclose(per_layer.bwd_ms, cm.bwd_ms * 0.5)
    with pytest.raises(UserError, match="one factor per device"):
        cm.with_slowdown([1.0, 2.0, 3.0])
    with pytest.raises(UserError, match="> 0"):
        cm.with_slowdown([1.0, 0.0])


def test_parse_slowdown() -> None:
    assert parse_slowdown("1,2.4", 2) == [1.0, 2.4]
    assert parse_slowdown("1:2.4", 4) == [1.0, 2.4, 1.0, 1.0]
    assert parse_slowdown("0:2, 3:1.5", 4) == [2.0, 1.0, 1.0, 1.5]
    with pytest.raises(UserError, match="2 factors for 4 stages"):
        parse_slowdown("1,2.4", 4)
    with pytest.raises(UserError, match="device 5"):
        parse_slowdown("5:2", 4)
    with pytest.raises(UserError, match="cannot parse"):
        parse_slowdown("fast", 2)


def test_validation_names_the_bad_field() -> None:
    kw = dict(
        model="x",
        layer_names=("a", "b"),
        param_bytes=[0, 0],
        out_bytes=[1, 1],
        act_bytes=[0, 0],
        opt_mult=[0, 0],
        buffer_bytes=[0, 0],
        bandwidth=[1e9],
        latency_ms=[0.0],
    )
    CostModel(fwd_ms=np.ones((2, 2)), bwd_ms=np.ones((2, 2)), **kw)
    with pytest.raises(UserError, match="bwd_ms"):
        CostModel(fwd_ms=np.ones((2, 2)), bwd_ms=np.ones((2, 3)), **kw)
    with pytest.raises(UserError, match="negative"):
        CostModel(fwd_ms=-np.ones((2, 2)), bwd_ms=np.ones((2, 2)), **kw)
    with pytest.raises(UserError, match="3 layers but 2 layer names"):
        CostModel(fwd_ms=np.ones((2, 3)), bwd_ms=np.ones((2, 3)), **kw)
    with pytest.raises(UserError, match="bandwidth"):
        CostModel(fwd_ms=np.ones((2, 2)), bwd_ms=np.ones((2, 2)), **{**kw, "bandwidth": [0.0]})
    one = CostModel(
        fwd_ms=np.ones((1, 2)), bwd_ms=np.ones((1, 2)), **{**kw, "bandwidth": [], "latency_ms": []}
    )
    assert one.for_devices(3).fwd_ms.shape == (3, 2)
    assert CostModel.from_dict(one.to_dict()).fwd_ms.tolist() == one.fwd_ms.tolist()
    assert "D=1" in repr(one)


def profile_frame(model: str = "toy", layers: int = 3) -> pd.DataFrame:
    """Rows in the profile schema: two batch sizes, clean and one interfered condition."""
    from dynpipe.profiler.schema import COLUMNS

    rows = []
    for bs in (8, 16):
        for cond, slow in (("none", 1.0), ("gemm@0.5x2", 2.0)):
            for i in range(layers):
                for phase, base in (("fwd", 1.0), ("bwd", 2.0)):
                    alone = base * (i + 1) * bs / 8
                    row = {c: np.nan for c in COLUMNS}
                    row.update(
                        model=model,
                        layer=f"l{i}",
                        layer_index=i,
                        kind="linear",
                        phase=phase,
                        batch_size=bs,
                        dtype="float32",
                        device_type="cuda",
                        device_name="Test GPU",
                        flops=1e9,
                        param_bytes=1000 * (i + 1),
                        in_bytes=100 * bs,
                        out_bytes=50 * bs,
                        arith_intensity=1.0,
                        condition=cond,
                        interferer=cond.split("@")[0],
                        intensity=0.0 if cond == "none" else 0.5,
                        n_jobs=0 if cond == "none" else 2,
                        time_ms=alone * slow,
                        time_p10_ms=alone * slow,
                        time_p90_ms=alone * slow,
                        repeats=5,
                        time_alone_ms=alone,
                        slowdown=slow,
                    )
                    rows.append(row)
    df = pd.DataFrame(rows)
    for c, fam in COLUMNS.items():
        if fam == "int":
            df[c] = df[c].astype("int64")
    return df


def test_from_profile_picks_conditions_per_device(tmp_path) -> None:
    from dynpipe.profiler.schema import write_profiles

    path = tmp_path / "p.parquet"
    write_profiles(
        profile_frame(),
        path,
        meta={
            "device_name": "Test GPU",
            "device_type": "cuda",
            "driver": "x",
            "torch_version": "x",
            "date": "2025-01-01",
            "command": "test",
        },
    )
    cm = CostModel.from_profile(
        str(path), model="toy", microbatch_size=8, conditions=["none", "gemm@0.5x2"]
    )
    np.testing.assert_allclose(cm.fwd_ms[0], [1.0, 2.0, 3.0])
    np.testing.assert_allclose(cm.fwd_ms[1], [2.0, 4.0, 6.0])  # measured under interference
    np.testing.assert_allclose(cm.bwd_ms[0], [2.0, 4.0, 6.0])
    np.testing.assert_allclose(cm.out_bytes, [400.0] * 3)
    assert cm.meta["source"] == "profile" and cm.meta["device_name"] == "Test GPU"
    assert cm.meta["profile_files"] == [str(path)]
    # An unprofiled batch size is scaled from the nearest profiled one, and says so.
    big = CostModel.from_profile(profile_frame(), model="toy", microbatch_size=32)
    np.testing.assert_allclose(big.fwd_ms[0], [4.0, 8.0, 12.0])
    assert big.meta["scaled_from_batch"] == 16
    clean = CostModel.from_profile(profile_frame(), model="toy", microbatch_size=16)
    assert "scaled_from_batch" not in clean.meta and clean.num_devices == 1


def test_from_profile_errors_are_one_line_with_the_fix() -> None:
    df = profile_frame()
    with pytest.raises(UserError, match=r"no rows for model 'gpt'.*toy"):
        CostModel.from_profile(df, model="gpt", microbatch_size=8)
    with pytest.raises(UserError, match=r"no condition 'copy@1x1'.*gemm@0\.5x2, none"):
        CostModel.from_profile(df, model="toy", microbatch_size=8, conditions=["copy@1x1"])
    holey = df[~((df["layer_index"] == 1) & (df["phase"] == "bwd") & (df["condition"] == "none"))]
    with pytest.raises(UserError, match=r"lacks bwd times for layer\(s\) \[1\]"):
        CostModel.from_profile(holey, model="toy", microbatch_size=8)
    mixed = df.copy()
    mixed.loc[mixed.index[:3], "device_name"] = "Other GPU"
    with pytest.raises(UserError, match="mixes devices"):
        CostModel.from_profile(mixed, model="toy", microbatch_size=8)
    with pytest.raises(UserError, match="lacks column"):
        CostModel.from_profile(df.drop(columns=["time_ms"]), model="toy", microbatch_size=8)
