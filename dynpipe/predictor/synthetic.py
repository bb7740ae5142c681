"""A physically plausible synthetic profile dataset, for tests, benchmarks and demos.

It follows the profile schema (one row per layer, phase and interference condition) and the
physics the predictor relies on: a layer's slowdown under interference depends on how much of
its alone time is compute-bound, memory-bound or launch overhead (its arithmetic intensity and
size), and on how hard each kind of interferer presses on those resources. Telemetry is a
noisy function of the interferer's pressure, so slowdown is learnable from telemetry alone;
as in a profile, one window's telemetry means (one model, batch size and condition) are in
every row measured in it.

It is no substitute for measured data: real accuracy numbers come only from ``profiles/``.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np
import pandas as pd

__all__ = ["CONDITIONS", "SyntheticDevice", "synthetic_profiles"]

# (interferer, intensity, n_jobs); the condition id is "kind@intensity x n_jobs".
CONDITIONS: tuple[tuple[str, float, int], ...] = (
    ("none", 0.0, 0),
    ("gemm", 0.25, 1),
    ("gemm", 0.5, 1),
    ("gemm", 1.0, 1),
    ("gemm", 1.0, 2),
    ("copy", 0.5, 1),
    ("copy", 1.0, 1),
    ("membw", 0.5, 1),
    ("membw", 0.75, 2),
    ("train", 0.5, 1),
    ("train", 1.0, 1),
    ("spin", 0.5, 1),
    ("spin", 1.0, 1),
    ("mix", 0.5, 1),
    ("mix", 0.5, 2),
)

# Per unit of intensity x jobs: pressure on compute, memory bandwidth and the launch path.
_PRESSURE = {
    "none": (0.0, 0.0, 0.0),
    "gemm": (1.0, 0.15, 0.1),
    "copy": (0.1, 1.0, 0.1),
    "membw": (0.05, 0.8, 0.05),
    "train": (0.6, 0.5, 0.3),
    "spin": (0.05, 0.0, 1.0),
    "mix": (0.5, 0.5, 0.3),
}


@dataclass(frozen=True)
class SyntheticDevice:
    """Roofline of the simulated device."""

    device_type: str = "cuda"
    device_name: str = "Synthetic GPU"
    peak_tflops: float = 50.0
    mem_gbps: float = 1500.0
    launch_ms: float = 0.01
    clock_mhz: float = 1980.0


def _model_layers(name: str, rng: np.random.Generator, batch: int) -> list[dict]:
    """Static features of a small model of a given family (FLOPs are per forward)."""
    layers: list[dict] = []

    def add(kind: str, flops: float, params: float, act_in: float, act_out: float) -> None:
        layers.append(
            {
                "kind": kind,
                "flops": float(flops),
                "param_bytes": int(params),
                "in_bytes": int(act_in),
                "out_bytes": int(act_out),
            }
        )

    if name.startswith("cnn"):
        ch, hw = 3, 64
        for i in range(6):
            out = int(32 * 2 ** (i // 2) * rng.uniform(0.8, 1.25))
            act_in, act_out = 4 * batch * ch * hw * hw, 4 * batch * out * hw * hw
            add("conv", 2 * batch * ch * out * 9 * hw * hw, 4 * ch * out * 9, act_in, act_out)
            add("norm", 8 * batch * out * hw * hw, 8 * out, act_out, act_out)
            if i % 2 == 1:
                add("pool", batch * out * hw * hw, 0, act_out, act_out / 4)
                hw //= 2
            ch = out
        feat = ch * hw * hw
        add("head", 2 * batch * feat * 10, 4 * feat * 10, 4 * batch * feat, 40 * batch)
    elif name.startswith("gpt"):
        d, seq, vocab = int(256 * rng.uniform(0.75, 1.5)), 128, 8000
        tok = batch * seq
        add("embedding", tok * d, 4 * vocab * d, 8 * tok, 4 * tok * d)
        for _ in range(4):
            add(
                "attention",
                8 * tok * d * d + 4 * tok * seq * d,
                16 * d * d,
                4 * tok * d,
                4 * tok * d,
            )
            add("block", 16 * tok * d * d, 32 * d * d, 4 * tok * d, 4 * tok * d)
        add("norm", 8 * tok * d, 8 * d, 4 * tok * d, 4 * tok * d)
        add("head", 2 * tok * d * vocab, 4 * d * vocab, 4 * tok * d, 4 * tok * vocab)
    else:
        width = int(512 * rng.uniform(0.5, 2.0))
        for i in range(8):
            w_in = 64 if i == 0 else width
            add(
                "linear",
                2 * batch * w_in * width,
                4 * w_in * width,
                4 * batch * w_in,
                4 * batch * width,
            )
        add("head", 2 * batch * width * 10, 4 * width * 10, 4 * batch * width, 40 * batch)
    return layers


def synthetic_profiles(
    *,
    models: tuple[str, ...] = ("mlp_a", "cnn_a", "gpt_a"),
    conditions: tuple[tuple[str, float, int], ...] = CONDITIONS,
    batch_sizes: tuple[int, ...] = (32,),
    device: SyntheticDevice | None = None,
    noise: float = 0.02,
    seed: int = 0,
) -> pd.DataFrame:
    """A profile dataset (schema version 1) for ``models`` under ``conditions``.

    ``noise`` is the log-normal sigma of a timing; short, launch-bound layers get more.
    Model names pick the family by prefix (``mlp``, ``cnn``, ``gpt``); different names give
    different widths, so held-out-model splits are meaningful.
    """
    dev = device or SyntheticDevice()
    rng = np.random.default_rng(seed)
    on_gpu = dev.device_type == "cuda"
    rows: list[dict] = []
    for model in models:
        model_rng = np.random.default_rng(_stable_seed(model))
        for batch in batch_sizes:
            layers = _model_layers(model, model_rng, batch)
            for phase, mult in (("fwd", 1.0), ("bwd", 2.0)):
                for idx, lay in enumerate(layers):
                    flops = lay["flops"] * mult
                    nbytes = lay["param_bytes"] + lay["in_bytes"] + lay["out_bytes"]
                    nbytes = nbytes * (1.5 if phase == "bwd" else 1.0)
                    t_c = flops / (dev.peak_tflops * 1e9)
                    t_m = nbytes / (dev.mem_gbps * 1e6)
                    t_l = dev.launch_ms * (2 if phase == "bwd" else 1)
                    alone = max(t_c, t_m) + t_l
                    busy = max(t_c, t_m)
                    f_c = t_c / (t_c + t_m) * busy / alone
                    f_m = t_m / (t_c + t_m) * busy / alone
                    f_l = t_l / alone
                    for kind, intensity, jobs in conditions:
                        rows.append(
                            _row(
                                rng=rng,
                                dev=dev,
                                on_gpu=on_gpu,
                                model=model,
                                layer=f"{lay['kind']}{idx:02d}",
                                idx=idx,
                                lay=lay,
                                phase=phase,
                                batch=batch,
                                flops=flops,
                                alone=alone,
                                fractions=(f_c, f_m, f_l),
                                cond=(kind, intensity, jobs),
                                noise=noise,
                            )
                        )
    df = pd.DataFrame(rows)
    # The profiler samples telemetry through a whole (model, batch size, condition) window
    # and writes the window's means into every row measured in it: do the same.
    tel = [c for c in df.columns if c.startswith("tel_")]
    window = df.groupby(["model", "batch_size", "condition"], sort=False)[tel]
    df[tel] = window.transform("mean")
    # time_alone_ms is the measured median under "none", as the profiler records it.
    keys = ["model", "batch_size", "layer_index", "phase"]
    alone = df[df["interferer"] == "none"].set_index(keys)["time_ms"]
    df["time_alone_ms"] = alone.reindex(pd.MultiIndex.from_frame(df[keys])).to_numpy()
    df["slowdown"] = df["time_ms"] / df["time_alone_ms"]
    return _with_work(df)


# Per layer kind: kernels launched (forward; the backward launches twice as many), and the
# share of bytes moved by each operator kind (the rest elementwise) and of FLOPs.
_WORK_MIX: dict[str, tuple[int, dict[str, float], dict[str, float]]] = {
    "conv": (2, {"conv": 0.7}, {"conv": 1.0}),
    "norm": (1, {"norm": 1.0}, {}),
    "pool": (1, {"other": 1.0}, {}),
    "linear": (2, {"matmul": 0.8}, {"matmul": 1.0}),
    "head": (2, {"matmul": 0.9}, {"matmul": 1.0}),
    "embedding": (2, {"other": 0.8}, {}),
    "attention": (6, {"matmul": 0.5, "attention": 0.3, "norm": 0.1}, {"matmul": 0.9, "attention": 0.1}),
    "block": (8, {"matmul": 0.6, "norm": 0.1}, {"matmul": 1.0}),
}  # fmt: skip


def _with_work(df: pd.DataFrame) -> pd.DataFrame:
    """The work counts a profile records (``dynpipe.profiler.work``), made up per layer kind."""
    from dynpipe.profiler.work import FLOP_KINDS, OP_KINDS

    kind = df["kind"].astype(str).to_numpy()
    bwd = (df["phase"] == "bwd").to_numpy()
    nbytes = (df["param_bytes"] + df["in_bytes"] + df["out_bytes"]).to_numpy(dtype=np.float64)
    nbytes = np.where(bwd, 1.5 * nbytes, nbytes)
    launches = np.array([_WORK_MIX.get(k, (1, {}, {}))[0] for k in kind], dtype=np.float64)
    launches = np.where(bwd, 2 * launches, launches)
    out = {
        "work_flops": df["flops"].to_numpy(dtype=np.float64),
        "work_bytes": nbytes,
        "work_launches": launches,
        "work_max_op_bytes": np.minimum(nbytes, 1.5 * nbytes / launches),
    }
    for op in OP_KINDS:
        share = [_WORK_MIX.get(k, (1, {}, {}))[1].get(op, 0.0) for k in kind]
        if op == "elementwise":
            share = [1.0 - sum(_WORK_MIX.get(k, (1, {}, {}))[1].values()) for k in kind]
        out[f"work_bytes_{op}"] = np.asarray(share, dtype=np.float64)
    for op in FLOP_KINDS:
        out[f"work_flops_{op}"] = np.array(
            [_WORK_MIX.get(k, (1, {}, {}))[2].get(op, 0.0) for k in kind], dtype=np.float64
        )
    return df.assign(**out)


def _stable_seed(name: str) -> int:
    # str hash is salted per process; widths must not change between runs.
    return zlib.crc32(name.encode())


def _row(
    *,
    rng: np.random.Generator,
    dev: SyntheticDevice,
    on_gpu: bool,
    model: str,
    layer: str,
    idx: int,
    lay: dict,
    phase: str,
    batch: int,
    flops: float,
    alone: float,
    fractions: tuple[float, float, float],
    cond: tuple[str, float, int],
    noise: float,
) -> dict:
    kind, intensity, jobs = cond
    load = intensity * jobs
    p_c, p_m, p_l = (load * p for p in _PRESSURE[kind])
    f_c, f_m, f_l = fractions
    # Time-sliced compute: k units of competing work stretch compute-bound time by 1+k;
    # bandwidth contention saturates; launch-path contention hurts short layers most.
    true_slow = 1.0 + f_c * p_c + f_m * 0.8 * p_m / (0.3 + p_m) * (p_m > 0) + f_l * 1.5 * p_l
    sigma = noise * (1.0 + 2.0 * f_l)
    t = alone * true_slow * float(np.exp(rng.normal(0.0, sigma)))
    spread = 1.0 + 4 * sigma
    other_util = min(100.0, 100.0 * (p_c + 0.3 * p_m + 0.2 * p_l)) if load else 0.0
    other_mem = min(100.0, 100.0 * (p_m + 0.1 * p_c)) if load else 0.0
    own_util = 100.0 * (1.0 - f_l) / (1.0 + p_c)
    tel_noise = rng.normal(0.0, 2.0, size=4)
    clock = dev.clock_mhz * (1.0 - 0.08 * min(1.0, p_c + 0.5 * p_m)) + 10 * tel_noise[2]
    return {
        "model": model,
        "layer": layer,
        "layer_index": idx,
        "kind": lay["kind"],
        "phase": phase,
        "batch_size": batch,
        "dtype": "float32",
        "device_type": dev.device_type,
        "device_name": dev.device_name,
        "flops": flops,
        "param_bytes": lay["param_bytes"],
        "in_bytes": lay["in_bytes"],
        "out_bytes": lay["out_bytes"],
        "arith_intensity": flops / max(1, lay["param_bytes"] + lay["in_bytes"] + lay["out_bytes"]),
        "condition": "none" if kind == "none" else f"{kind}@{intensity:g}x{jobs}",
        "interferer": kind,
        "intensity": float(intensity),
        "n_jobs": int(jobs),
        "tel_util": float(np.clip(own_util + tel_noise[0], 0, 100)),
        "tel_mem_util": float(np.clip(other_mem + 20 * f_m + tel_noise[1], 0, 100))
        if on_gpu
        else math.nan,
        "tel_clock_mhz": float(clock),
        "tel_mem_used_mb": float(1500 + 2500 * jobs + 50 * tel_noise[3]),
        "tel_power_w": float(80 + 250 * min(1.0, own_util / 100 + p_c + 0.5 * p_m) + tel_noise[3]),
        "tel_other_procs": float(jobs),
        "tel_other_util": float(np.clip(other_util + tel_noise[0], 0, 100)),
        "tel_other_mem_util": float(np.clip(other_mem + tel_noise[1], 0, 100))
        if on_gpu
        else math.nan,
        "tel_throttle": float(p_c + p_m > 1.5),
        "time_ms": t,
        "time_p10_ms": t / spread,
        "time_p90_ms": t * spread,
        "repeats": 20,
    }
