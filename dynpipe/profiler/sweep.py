"""Run a sweep: every layer of every model, timed under every interference condition.

    dynpipe profile --model vgg16 --batch-size 32 --sweep recipes/sweeps/gpu.toml \\
        --device cuda:0 -o profiles/h100-vgg16.parquet

For each condition (``none`` first) the interferers are started once and kept running while
every (model, batch size) is timed layer by layer; consecutive conditions that differ only in
intensity reuse the same processes. Telemetry is sampled throughout and its means over each
(condition, model, batch size) window go into every row of that window. The output file is
rewritten atomically after each window, so an interrupted sweep resumes where it stopped:
windows already in the file are skipped.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import platform
import shlex
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynpipe.devices.columns import TELEMETRY_COLUMNS
from dynpipe.devices.interfere import Interferer, InterfererError, llc_bytes, start_interferer
from dynpipe.errors import UserError
from dynpipe.profiler.conditions import NONE, Condition, Sweep
from dynpipe.profiler.schema import (
    COLUMNS,
    EXTRA_COLUMNS,
    read_metadata,
    validate_frame,
    write_profiles,
)

__all__ = ["device_info", "finalize", "run_sweep"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _command_line() -> str:
    """How this process was started, as the user would type it."""
    prog = Path(sys.argv[0]).name
    if prog in ("dynpipe", "__main__.py"):  # the entry point or ``python -m dynpipe``
        return shlex.join(["dynpipe", *sys.argv[1:]])
    return shlex.join([prog, *sys.argv[1:]])


def _autogroup() -> str | None:
    try:
        with open("/proc/self/autogroup") as f:
            return f.read().strip()
    except OSError:
        return None


def device_info(device: str) -> dict[str, Any]:
    """Name, driver and hardware details of ``device`` for the dataset metadata."""
    import torch

    info: dict[str, Any] = {"torch_version": torch.__version__, "host": platform.node()}
    if device.startswith("cuda"):
        idx = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(idx)
        info.update(
            device_type="cuda",
            device_name=torch.cuda.get_device_name(idx),
            cuda_version=torch.version.cuda,
            cudnn_version=torch.backends.cudnn.version(),
            gpu_memory_gb=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
            tf32_matmul=bool(torch.backends.cuda.matmul.allow_tf32),
        )
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
            info["driver"] = driver.decode() if isinstance(driver, bytes) else str(driver)
        except Exception:  # NVML missing: the CUDA runtime version is the best we have
            info["driver"] = f"cuda {torch.version.cuda}"
    else:
        info.update(
            device_type="cpu",
            device_name=_cpu_model(),
            driver=f"{platform.system().lower()} {platform.release()}",
            logical_cpus=os.cpu_count(),
            llc_bytes=llc_bytes(),
            torch_threads=torch.get_num_threads(),
            # Scheduling priority of the profiler (its interferers inherit it): on a shared
            # machine a raised one keeps other tenants' load out of the measurement.
            nice=os.getpriority(os.PRIO_PROCESS, 0),
            autogroup=_autogroup(),
        )
    return info


def finalize(df: Any) -> Any:
    """Fill ``time_alone_ms`` and ``slowdown`` from the ``none`` rows of the same layer."""
    import numpy as np

    key = ["model", "layer", "phase", "batch_size", "dtype", "device_name"]
    alone = df[df["condition"] == NONE].groupby(key, sort=False)["time_ms"].median()
    idx = df.set_index(key).index
    df = df.copy()
    df["time_alone_ms"] = alone.reindex(idx).to_numpy(dtype=float)
    df["slowdown"] = df["time_ms"].to_numpy(dtype=float) / df["time_alone_ms"].to_numpy()
    df.loc[~np.isfinite(df["slowdown"]), "slowdown"] = np.nan
    return df


def _load_existing(out: Path, setup: dict[str, Any]) -> tuple[list[dict], dict[str, Any]]:
    import pandas as pd

    if not out.exists():
        return [], {}
    meta = read_metadata(out)
    df = pd.read_parquet(out)
    validate_frame(df, source=str(out))
    old = meta.get("setup", {})
    for key in ("device_name", "dtype", "cores", "timing"):
        if old.get(key) != setup.get(key):
            raise UserError(
                f"{out} was measured with {key}={old.get(key)!r}, this run has "
                f"{setup.get(key)!r}; use another -o, or delete the file to start over"
            )
    for name, cfg in setup["models"].items():
        if name in old.get("models", {}) and old["models"][name] != cfg:
            raise UserError(
                f"{out} holds {name} with config {old['models'][name]}, this run asks for {cfg}; "
                "use another -o for a different configuration"
            )
    return df.to_dict("records"), meta


class _Interferers:
    """The processes of the current condition, reused when only the intensity changes."""

    def __init__(self, ready_timeout_s: float) -> None:
        self.cond: Condition | None = None
        self.running: list[Interferer] = []
        self.ready_timeout_s = ready_timeout_s
        self.runs: list[dict[str, Any]] = []
        self._served: list[str] = []

    def switch(self, cond: Condition) -> float:
        """Make ``cond`` run; returns the seconds it took."""
        t0 = time.perf_counter()
        if self.cond is not None and cond.reusable_from(self.cond) and self.alive():
            for itf, spec in zip(self.running, cond.specs, strict=True):
                itf.set_intensity(spec.intensity)
        else:
            self.stop()
            self.running = [start_interferer(s, wait=False) for s in cond.specs]
            for itf in self.running:
                itf.wait_ready(self.ready_timeout_s)
        self.cond = cond
        self._served.append(cond.id)
        return time.perf_counter() - t0

    def alive(self) -> bool:
        return all(itf.ready for itf in self.running)

    def stop(self) -> None:
        if self.running:
            stats = [s for itf in self.running for s in itf.stop()]
            self.runs.append({"conditions": self._served, "processes": stats})
        self.running, self.cond, self._served = [], None, []


def _parse_models(models: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    from dynpipe.models import get_model

    built = {}
    for name, cfg in models:
        try:
            model = get_model(name, **cfg)
        except (ValueError, TypeError) as exc:
            raise UserError(str(exc).splitlines()[0]) from None
        if model.name in built:
            raise UserError(
                f"model {model.name!r} given twice; profile one configuration per output file"
            )
        built[model.name] = model
    return built


def run_sweep(
    models: Sequence[tuple[str, dict[str, Any]]],
    *,
    batch_sizes: Sequence[int],
    sweep: Sweep,
    out: str | os.PathLike[str],
    device: str = "cpu",
    dtype: str = "float32",
    cores: Sequence[int] | None = None,
    command: str | None = None,
    progress: bool = True,
    ready_timeout_s: float = 180.0,
) -> Any:
    """Measure every (condition, model, batch size) not yet in ``out``; return the frame."""
    import pandas as pd
    import torch
    from tqdm import tqdm

    from dynpipe.devices.telemetry import TelemetrySampler
    from dynpipe.profiler.layers import LayerBench, TimingConfig, static_features

    out = Path(out)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device} but torch sees no CUDA device; use --device cpu")
    if cores:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    built = _parse_models(models)
    cfg = TimingConfig(
        warmup=sweep.warmup,
        repeats=sweep.repeats,
        sample_ms=sweep.sample_ms,
        max_iters=sweep.max_iters,
    )
    info = device_info(device)
    setup = {
        "models": {n: m.config for n, m in built.items()},
        "batch_sizes": list(batch_sizes),
        "device_name": info["device_name"],
        "dtype": dtype,
        "cores": sorted(cores) if cores else None,
        "timing": {
            "warmup": cfg.warmup,
            "repeats": cfg.repeats,
            "sample_ms": cfg.sample_ms,
            "max_iters": cfg.max_iters,
            "period_ms": sweep.period_ms,
            "settle_s": sweep.settle_s,
        },
    }
    rows, old_meta = _load_existing(out, setup)
    done = {(r["condition"], r["model"], int(r["batch_size"])) for r in rows}
    pairs = [(n, int(bs)) for n in built for bs in batch_sizes]
    todo = [(c, n, bs) for c in sweep.conditions for n, bs in pairs if (c.id, n, bs) not in done]
    measured = bool([c for c, _, _ in todo if c.specs])
    need_recheck = sweep.recheck_baseline and (measured or "baseline_drift" not in old_meta)

    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    command = command or _command_line()
    meta: dict[str, Any] = {
        **{k: v for k, v in old_meta.items() if k not in ("command",)},
        **info,
        "date": old_meta.get("date", now),
        "updated": now,
        "command": command,
        "commands": [*old_meta.get("commands", []), command],
        "setup": {
            **setup,
            "models": {**old_meta.get("setup", {}).get("models", {}), **setup["models"]},
            "batch_sizes": sorted(
                {*old_meta.get("setup", {}).get("batch_sizes", []), *setup["batch_sizes"]}
            ),
        },
        "sweep": {"name": sweep.name, "path": sweep.path, "sha1": sweep.sha1},
        "interferer_runs": old_meta.get("interferer_runs", []),
        "baseline_runs": old_meta.get("baseline_runs", []),
    }
    if todo:
        meta.pop("baseline_drift", None)
    if not todo and not need_recheck:
        print(f"{out}: all {len(sweep.conditions)} conditions already measured", file=sys.stderr)
        return finalize(pd.DataFrame.from_records(rows))

    benches: dict[tuple[str, int], tuple[Any, list[dict[str, Any]]]] = {}

    def bench(name: str, bs: int):
        if (name, bs) not in benches:
            model = built[name]
            statics = static_features(model, batch_size=bs, dtype=dtype)
            benches[(name, bs)] = (
                LayerBench(model, batch_size=bs, device=device, dtype=dtype),
                statics,
            )
        return benches[(name, bs)]

    plan = _schedule(sweep, todo, need_recheck)
    n_phases = {n: 2 * len(m) for n, m in built.items()}
    total = sum(n_phases[n] for cond, units in plan for n, _ in (units or pairs))
    sampler = TelemetrySampler(device, cores=cores).start()
    itfs = _Interferers(ready_timeout_s)
    bar = tqdm(
        total=total,
        unit="layer",
        disable=not progress,
        file=sys.stderr,
        mininterval=0.5 if sys.stderr.isatty() else 15.0,
        dynamic_ncols=True,
    )

    def measure(cond: Condition, name: str, bs: int) -> list[dict[str, Any]]:
        b, statics = bench(name, bs)
        static = {(s["layer_index"], s["phase"]): s for s in statics}
        sampler.reset()
        timings = []
        for t in b.time_all(cfg):
            timings.append(t)
            bar.update(1)
        tel = sampler.window()
        if cond.specs and not itfs.alive():
            raise InterfererError(
                f"an interferer of {cond.id} died while {name} (batch {bs}) was timed; "
                "its rows were not written — check the device and re-run to resume"
            )
        bar.update(n_phases[name] - len(timings))  # phases without a backward
        base = {
            "model": name,
            "batch_size": bs,
            "dtype": dtype,
            "device_type": info["device_type"],
            "device_name": info["device_name"],
            "condition": cond.id,
            "interferer": cond.interferer,
            "intensity": float(cond.intensity),
            "n_jobs": cond.n_jobs,
        }
        out_rows = []
        for t in timings:
            row = {**base, **static[(t.index, t.phase)]}
            row.update({k: float(tel[k]) for k in tel if k != "tel_samples"})
            row.update(
                time_ms=t.time_ms,
                time_p10_ms=t.time_p10_ms,
                time_p90_ms=t.time_p90_ms,
                repeats=t.repeats,
                iters_per_sample=t.iters_per_sample,
                tel_samples=int(tel["tel_samples"]),
                samples_ms=list(t.samples_ms),
                time_alone_ms=math.nan,
                slowdown=math.nan,
            )
            out_rows.append(row)
        return out_rows

    def save() -> Any:
        df = pd.DataFrame.from_records(rows)
        df = finalize(df)
        order = [c for c in (*COLUMNS, *EXTRA_COLUMNS) if c in df.columns]
        df = df[order]
        meta["telemetry_tick_cost_ms"] = round(sampler.tick_cost_ms, 4)
        write_profiles(df, out, meta=meta)
        return df

    t_start = time.perf_counter()
    df = None
    try:
        for cond, units in plan:
            if units is None:  # another baseline, pooled into the ``none`` rows
                itfs.stop()
                after = _last_id(plan, cond)
                bar.set_postfix_str("none (again)", refresh=False)
                run = {
                    "after": after,
                    **_pool_baseline(rows, [r for n, bs in pairs for r in measure(cond, n, bs)]),
                }
                meta["baseline_runs"].append(run)
                if abs(run["median_ratio"] - 1.0) > 0.1:
                    warnings.warn(
                        f"the 'none' baseline re-measured after {after} differs by "
                        f"{100 * (run['median_ratio'] - 1):+.0f}% from the earlier one: the "
                        "device's own speed changed (thermal, other tenants); every slowdown "
                        "carries that error, see baseline_runs in the metadata",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                if need_recheck and cond is plan[-1][0]:
                    meta["baseline_drift"] = run
                df = save()
                continue
            bar.set_postfix_str(cond.id, refresh=False)
            if cond.specs:
                took = itfs.switch(cond)
                time.sleep(sweep.settle_s)
                if progress:
                    bar.write(f"  {cond.id}: interferers ready in {took:.1f} s")
            else:
                itfs.stop()
            for name, bs in units:
                rows.extend(measure(cond, name, bs))
                df = save()
        itfs.stop()
        meta["interferer_runs"] = meta["interferer_runs"] + itfs.runs
        meta["wall_s"] = round(time.perf_counter() - t_start, 1)
        df = save()
    finally:
        itfs.stop()
        sampler.close()
        bar.close()
    return df


def _schedule(
    sweep: Sweep, todo: list[tuple[Condition, str, int]], recheck: bool
) -> list[tuple[Condition, list[tuple[str, int]] | None]]:
    """Conditions in sweep order with their (model, batch) units; ``None`` units mark an
    extra ``none`` measurement (every ``baseline_every`` interference conditions, and at
    the end when ``recheck``) that is pooled into the baseline."""
    plan: list[tuple[Condition, list[tuple[str, int]] | None]] = []
    since = 0
    for cond in sweep.conditions:
        units = [(n, bs) for c, n, bs in todo if c.id == cond.id]
        if not units:
            continue
        plan.append((cond, units))
        if cond.specs:
            since += 1
            if sweep.baseline_every and since >= sweep.baseline_every:
                plan.append((Condition(), None))
                since = 0
    if recheck:
        if plan and plan[-1][1] is None:
            plan.pop()  # the periodic baseline after the last condition is the recheck
        plan.append((Condition(), None))
    return plan


def _last_id(plan: list[tuple[Condition, Any]], marker: Condition) -> str:
    """Id of the last interference condition before the baseline ``marker`` in ``plan``."""
    last = NONE
    for cond, units in plan:
        if cond is marker:
            return last
        if units is not None:
            last = cond.id
    return last


def _pool_baseline(rows: list[dict[str, Any]], new: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge a repeated ``none`` measurement into the existing ``none`` rows.

    Samples are pooled (median, p10, p90 over all of them) and telemetry is averaged by
    tick count, so ``time_alone_ms`` rests on every baseline measured, not on whichever
    moment the first one happened to catch. Returns how the new measurement compares with
    the baseline before it (per-row ratio of medians).
    """
    import numpy as np

    index = {
        (r["model"], int(r["batch_size"]), r["layer"], r["phase"]): r
        for r in rows
        if r["condition"] == NONE
    }
    ratios = []
    for r in new:
        key = (r["model"], int(r["batch_size"]), r["layer"], r["phase"])
        old = index.get(key)
        if old is None:
            rows.append(r)
            index[key] = r
            continue
        ratios.append(r["time_ms"] / old["time_ms"])
        pooled = np.array([*old.get("samples_ms", []), *r["samples_ms"]], dtype=float)
        if pooled.size == 0:
            continue
        w_old, w_new = int(old.get("tel_samples", 0)), int(r["tel_samples"])
        for col in TELEMETRY_COLUMNS:
            a, b = float(old[col]), float(r[col])
            if math.isnan(a) or w_old == 0:
                old[col] = b
            elif not math.isnan(b) and w_new:
                old[col] = (a * w_old + b * w_new) / (w_old + w_new)
        old.update(
            samples_ms=pooled.tolist(),
            time_ms=float(np.median(pooled)),
            time_p10_ms=float(np.percentile(pooled, 10)),
            time_p90_ms=float(np.percentile(pooled, 90)),
            repeats=int(pooled.size),
            tel_samples=w_old + w_new,
        )
    arr = np.array(ratios) if ratios else np.array([math.nan])
    return {
        "median_ratio": round(float(np.median(arr)), 4),
        "p10_ratio": round(float(np.percentile(arr, 10)), 4),
        "p90_ratio": round(float(np.percentile(arr, 90)), 4),
        "n": len(ratios),
    }
