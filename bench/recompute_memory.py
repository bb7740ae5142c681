"""Activation recomputation on one GPU: a gpt that does not fit without it, and the memory
model against the allocator's peak.

Three cases, each a one-stage dynpipe pipeline (``PipelineEngine``, bf16 autocast, AdamW) in
its own process, so an out-of-memory case leaves nothing behind for the next:

- ``none``: gpt width 2048, seq 1024, at a batch the memory model says needs ``--over``
  (1.3) times the 90% of the card's free memory a stage plans to fill (picked at run time,
  more than the whole card): expected to run out of memory, reported in one line;
- ``auto``: the same run with ``--recompute auto``: the planner's layers recompute, and the
  step time and the predicted against measured peak are reported;
- ``fits``: gpt width 1024, depth 12, seq 1024, batch 32 without recomputation: the memory
  model's prediction against ``torch.cuda.max_memory_allocated``.

Run (one GPU, about 2 minutes on an H100):

    python bench/recompute_memory.py -o $OUT/recompute_memory.json

Tiny sizes on CPU (the fields, not the numbers; peaks are not measured there):

    python bench/recompute_memory.py --device cpu --width 32 --depth 2 --seq 16 \
        --fits-width 32 --fits-depth 2 --fits-batch 4 --memory-gb 0.001 --in-process -o x.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_GIB = 1024**3


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", help="auto, cuda or cpu")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument(
        "--batch", type=int, default=None, help="the big case's batch (default: from the model)"
    )
    ap.add_argument(
        "--over",
        type=float,
        default=1.3,
        help="the big case's predicted need without recomputation over the memory it has",
    )
    ap.add_argument("--fits-width", type=int, default=1024)
    ap.add_argument("--fits-depth", type=int, default=12)
    ap.add_argument("--fits-batch", type=int, default=32)
    ap.add_argument(
        "--memory-gb", type=float, default=None, help="the stage's memory (default: 90%% free)"
    )
    ap.add_argument("--steps", type=int, default=4, help="timed steps after 2 warm-up steps")
    ap.add_argument("--in-process", action="store_true", help="run the cases in this process")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, JSON on stdout
    ap.add_argument("--case-args", default=None, help=argparse.SUPPRESS)
    ap.add_argument("-o", "--out", default="recompute_memory.json")
    return ap.parse_args(argv)


def _model(width: int, depth: int, heads: int, seq: int):
    from dynpipe.models import get_model

    return get_model("gpt", width=width, depth=depth, heads=min(heads, width), seq_len=seq)


def _pick_batch(args: argparse.Namespace, limit: float | None, device: Any) -> int:
    """The batch whose predicted peak without recomputation is ``over`` x ``limit``, at
    least 1. A microbatch's activations are a part per sample plus a part it keeps once
    whatever its size (bf16 autocast's weight copies): both from the memory model at one
    and two samples, as ``PipelineEngine`` prices its one stage."""
    import numpy as np

    from dynpipe.planner.recompute import kept_bytes, stage_peak
    from dynpipe.runtime.memory import memory_costs

    if args.batch is not None:
        return args.batch
    if limit is None:
        return 2
    model = _model(args.width, args.depth, args.heads, args.seq)
    half = device.type == "cuda"  # the cases run under bf16 autocast on a GPU

    def peak(b: int) -> float:
        cm = memory_costs(
            model, microbatch_size=b, optimizer="adamw", half=half, recompute="none", device=device
        )
        none = np.zeros(len(model), dtype=bool)
        return stage_peak(float(cm.static_bytes.sum()), cm.act_bytes, kept_bytes(cm), none, 1)

    one, two = peak(1), peak(2)
    per = two - one
    return max(1, int((args.over * limit - (one - per)) / per))


def run_case(name: str, spec: dict[str, Any], *, device: str) -> dict[str, Any]:
    """One case: build a one-stage engine, run warm-up and timed steps, report memory."""
    import torch

    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.optim import OptimConfig
    from dynpipe.runtime.topology import Topology, init_distributed

    topo = Topology.from_env(device=device, timeout_s=300)
    init_distributed(topo)
    torch.manual_seed(0)
    model = _model(spec["width"], spec["depth"], spec["heads"], spec["seq"])
    plan = Plan.even(model, 1, microbatches=1)
    if spec["limit"] is None:
        from dynpipe.runtime.memory import device_memory_bytes

        # As ``dynpipe train`` does: 90% of what this process finds free.
        spec = {**spec, "limit": device_memory_bytes(topo.device, memory_gb=None)}
    cfg = EngineConfig(
        batch_size=spec["batch"],
        optim=OptimConfig(name="adamw", lr=1e-4),
        bf16=topo.is_cuda,
        recompute=spec["recompute"],
        memory_bytes=spec["limit"],
    )
    out: dict[str, Any] = {"case": name, **spec, "device": _device_name(topo)}
    out["limit_gib"] = _gib(spec["limit"])
    cuda = topo.is_cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats(topo.device)
    engine = None
    try:
        engine = PipelineEngine(model, plan, topo=topo, config=cfg)
        out["recomputed"] = list(engine.recomputed)
        # The memory model measured on this device (the engine measures only under auto).
        out["predicted_peak_gib"] = _gib(engine.predict_peak_bytes(measure=True))
        x, y = model.input_spec.example(spec["batch"], device=topo.device)
        times = []
        for s in range(2 + spec["steps"]):
            t0 = time.perf_counter()
            engine.step(s, (x, y))
            if cuda:
                torch.cuda.synchronize(topo.device)
            if s >= 2:
                times.append((time.perf_counter() - t0) * 1e3)
        out["step_ms"] = round(sorted(times)[len(times) // 2], 2) if times else None
        out["oom"] = None
    except Exception as exc:  # torch pipelining wraps a stage's error in a RuntimeError
        oom = _oom(exc)
        if oom is None:
            raise
        out["oom"] = str(oom).split(".")[0]
        out["step_ms"] = None
        exc = oom = None  # their frames hold the failed step's tensors
    finally:
        del engine
        gc.collect()
    if cuda:
        out["measured_peak_gib"] = _gib(torch.cuda.max_memory_allocated(topo.device))
        out["total_gib"] = _gib(torch.cuda.get_device_properties(topo.device).total_memory)
        torch.cuda.empty_cache()
    else:
        out["measured_peak_gib"] = None
    p, m = out.get("predicted_peak_gib"), out.get("measured_peak_gib")
    out["predicted_over_measured"] = round(p / m, 4) if p and m and not out["oom"] else None
    return out


def _oom(exc: BaseException | None) -> BaseException | None:
    """The CUDA out-of-memory error in ``exc``'s chain, if any."""
    import torch

    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _device_name(topo: Any) -> str:
    import torch

    return torch.cuda.get_device_name(topo.device) if topo.is_cuda else "cpu"


def _gib(x: float | None) -> float | None:
    return None if x is None else round(float(x) / _GIB, 6)


def _probe_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--width", str(args.width), "--depth", str(args.depth), "--heads", str(args.heads)]
    flags += ["--seq", str(args.seq), "--over", str(args.over)]
    if args.batch is not None:
        flags += ["--batch", str(args.batch)]
    if args.memory_gb is not None:
        flags += ["--memory-gb", str(args.memory_gb)]
    return flags


def _in_child(
    name: str, spec: dict[str, Any], device: str, *, extra: list[str] | None = None
) -> dict[str, Any]:
    env = dict(os.environ)
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env["MASTER_PORT"] = str(_free_port())
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, __file__, "--device", device, "--case", name]
    cmd += ["--case-args", json.dumps(spec)]
    if name == "probe":
        cmd = [sys.executable, __file__, "--device", device, "--case", "probe", *(extra or [])]
    got = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    lines = [ln for ln in got.stdout.splitlines() if ln.startswith("{")]
    if got.returncode or not lines:
        tail = (got.stderr.strip().splitlines() or ["no output"])[-1]
        return {"case": name, **spec, "error": tail}
    return json.loads(lines[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    from dynpipe.runtime.topology import resolve_device

    device = resolve_device(args.device)
    if args.case == "probe":
        import torch

        from dynpipe.runtime.memory import device_memory_bytes

        dev = torch.device("cuda", 0) if device.startswith("cuda") else torch.device("cpu")
        limit = device_memory_bytes(dev, memory_gb=args.memory_gb)
        print(json.dumps({"limit": limit, "batch": _pick_batch(args, limit, dev)}))
        return 0
    if args.case:
        res = run_case(args.case, json.loads(args.case_args), device=device)
        print(json.dumps(res))
        return 0
    import torch

    if args.in_process or not device.startswith("cuda"):
        limit = None if args.memory_gb is None else args.memory_gb * _GIB
        batch = _pick_batch(args, limit, torch.device("cpu"))
    else:
        # In a process of its own, as each case: a CUDA context here would hold memory the
        # cases then lack.
        probe = _in_child("probe", {}, device, extra=_probe_flags(args))
        if "error" in probe:
            print(f"probe failed: {probe['error']}")
            return 1
        limit, batch = probe["limit"], probe["batch"]
    big = {"width": args.width, "depth": args.depth, "heads": args.heads, "seq": args.seq}
    fits = {"width": args.fits_width, "depth": args.fits_depth, "heads": args.heads}
    fits.update(seq=args.seq, batch=args.fits_batch)
    # On a GPU without --memory-gb each case measures its own free memory, as a run does.
    common = {"steps": args.steps, "limit": args.memory_gb * _GIB if args.memory_gb else None}
    cases = {
        "none": {**big, "batch": batch, "recompute": "none", **common},
        "auto": {**big, "batch": batch, "recompute": "auto", **common},
        "fits": {**fits, "recompute": "none", **common},
    }
    results = []
    for name, spec in cases.items():
        res = (
            run_case(name, spec, device=device)
            if args.in_process
            else _in_child(name, spec, device)
        )
        results.append(res)
        _say(res)
    out = {
        "bench": "recompute_memory",
        "planned_limit_gib": _gib(limit),
        "torch": torch.__version__,
        "cases": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def _say(r: dict[str, Any]) -> None:
    what = f"{r['case']:5s} gpt w{r['width']} d{r['depth']} s{r['seq']} b{r['batch']}"
    what += f" recompute={r['recompute']}"
    if r.get("error"):
        print(f"{what}: failed: {r['error']}")
    elif r.get("oom"):
        need = r.get("predicted_peak_gib")
        print(f"{what}: out of memory (predicted {need} GiB of {r.get('limit_gib')}): {r['oom']}")
    else:
        n = len(r.get("recomputed") or [])
        print(
            f"{what}: step {r['step_ms']} ms, peak predicted {r.get('predicted_peak_gib')} GiB "
            f"measured {r['measured_peak_gib']} GiB (x{r['predicted_over_measured']}), "
            f"{n} layers recomputed"
        )


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["main", "run_case"]
