"""One GPU, one process: dynpipe's engine against the plain PyTorch loop a user would write.

For each model, in one run on one device, four ways to train the same zoo model on the
same four device-resident batches (cycled), the same microbatches, the same optimizer:

* ``plain_eager``: the model's layers in an ``nn.Sequential``, bf16 autocast, gradients
  accumulated over the microbatches (each microbatch's loss divided by their count),
  AdamW fused on CUDA (foreach elsewhere), ``zero_grad(set_to_none=True)``;
* ``plain_compiled``: the same with ``torch.compile`` of the whole model (the loss outside
  it, as in dynpipe); ``--plain-compile layer`` compiles each layer instead;
* ``dynpipe_eager`` / ``dynpipe_compiled``: ``PipelineEngine`` on a one-rank process group,
  as ``dynpipe train --nproc 1`` builds it (``--compile``: every layer compiled in place),
  its stage timers on as a run has them.

Every step ends with a device synchronisation in every variant (dynpipe reads the loss
there; the plain loops call ``torch.cuda.synchronize``) and the median step after
``--warmup`` steps is what is compared. MFU is the model's FLOPs per step (forward and
backward, ``dynpipe.models.stats.layer_stats``: matmuls, convolutions and attention)
over the step time and the card's dense bf16 peak (H100 SXM / H200: 989 TFLOP/s;
``--peak-tflops`` for another card). Ratios are speeds, plain's step time over
dynpipe's: 1.0 is parity, below 1 dynpipe is slower.

    # One GPU (about 4-5 minutes, compilation included):
    PYTHONUNBUFFERED=1 python bench/gpu_efficiency.py -o $OUT/eff.json 2>&1 | tee $OUT/eff.log
    # Seconds: small models (tiny ones on CPU, compiled with aot_eager there):
    python bench/gpu_efficiency.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere in the checkout
    sys.path.insert(0, str(ROOT))

from dynpipe.models import get_model  # noqa: E402
from dynpipe.models.base import LayeredModel  # noqa: E402
from dynpipe.models.stats import layer_stats  # noqa: E402
from dynpipe.planner import Plan  # noqa: E402
from dynpipe.runtime.compiled import check_backend, compile_layers  # noqa: E402
from dynpipe.runtime.engine import EngineConfig, PipelineEngine  # noqa: E402
from dynpipe.runtime.optim import OptimConfig, build_optimizer  # noqa: E402
from dynpipe.runtime.runlog import code_revision, environment  # noqa: E402
from dynpipe.runtime.topology import Topology  # noqa: E402

VARIANTS = ("plain_eager", "plain_compiled", "dynpipe_eager", "dynpipe_compiled")
MICROBATCHES = 4
# (model config, batch size, what a sample counts as) per model and size.
FULL = {
    "gpt": ({"depth": 12, "width": 1024, "heads": 16, "seq_len": 1024, "vocab": 32000}, 32),
    "vgg16": ({"image_size": 224, "num_classes": 1000}, 128),
    "resnet50": ({"image_size": 224, "num_classes": 1000}, 128),
}
QUICK_GPU = {
    "gpt": ({"depth": 2, "width": 256, "heads": 4, "seq_len": 256, "vocab": 2048}, 8),
    "vgg16": ({"image_size": 32, "width_mult": 0.25}, 16),
    "resnet50": ({"image_size": 32, "width_mult": 0.25}, 16),
}
QUICK_CPU = {
    "gpt": ({"depth": 2, "width": 32, "heads": 2, "seq_len": 16, "vocab": 64}, 8),
    "vgg16": ({"image_size": 32, "width_mult": 0.0625, "fc_width": 32}, 8),
    "resnet50": ({"image_size": 32, "width_mult": 0.0625}, 8),
}
# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by a substring of the card's name;
# the first match wins.
PEAKS = (
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM (HBM3)
    ("H200", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)


def _peak(name: str, override: float | None) -> tuple[float | None, str]:
    if override:
        return override, "--peak-tflops"
    for key, tflops in PEAKS:
        if key in name:
            return tflops, f"dense bf16 peak of {key} ({tflops:g} TFLOP/s)"
    return None, f"no known peak for {name!r}: MFU not computed (give --peak-tflops)"


def _batches(model: LayeredModel, batch: int, dev: torch.device, n: int = 4) -> list:
    out = []
    for i in range(n):
        torch.manual_seed(1000 + i)
        out.append(model.input_spec.example(batch, device=dev))
    return out


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _plain(
    model: LayeredModel,
    *,
    batch: int,
    dev: torch.device,
    compile_unit: str | None,
    backend: str,
) -> Callable[[int, Any], None]:
    """The loop a PyTorch user writes for this model (``compile_unit``: None, ``model``
    or ``layer``)."""
    layers = model.build_range(0, len(model), device=dev)
    net: nn.Module = nn.Sequential(*layers.values())
    if compile_unit == "layer":
        compile_layers(layers.values(), backend=backend, model_layers=len(model))
    elif compile_unit == "model":
        net = torch.compile(net, backend=backend)
    opt = build_optimizer(list(layers.parameters()), OptimConfig(name="adamw"))
    bf16 = dev.type == "cuda"
    k = MICROBATCHES

    def step(_: int, data: Any) -> None:
        x, y = data
        opt.zero_grad(set_to_none=True)
        for xm, ym in zip(x.chunk(k), y.chunk(k), strict=True):
            ctx = torch.autocast("cuda", torch.bfloat16) if bf16 else contextlib.nullcontext()
            with ctx:
                out = net(xm)
            loss = model.loss_fn(out.float(), ym) / k
            loss.backward()
        opt.step()

    return step


def _dynpipe(
    model: LayeredModel, *, batch: int, dev: torch.device, backend: str | None
) -> Callable[[int, Any], None]:
    topo = Topology(
        rank=0,
        world_size=1,
        local_rank=0,
        device=dev,
        backend="nccl" if dev.type == "cuda" else "gloo",
    )
    engine = PipelineEngine(
        model,
        Plan.even(model, 1, microbatches=MICROBATCHES),
        topo=topo,
        config=EngineConfig(
            batch_size=batch,
            optim=OptimConfig(name="adamw"),
            bf16=dev.type == "cuda",
            compile=backend,
        ),
    )

    def step(s: int, data: Any) -> None:
        engine.step(s, data)

    return step


def _measure(
    step: Callable[[int, Any], None],
    data: list,
    *,
    dev: torch.device,
    warmup: int,
    steps: int,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    for s in range(warmup):
        step(s, data[s % len(data)])
        _sync(dev)
    warm_s = time.perf_counter() - t0
    times = []
    for s in range(warmup, warmup + steps):
        t = time.perf_counter()
        step(s, data[s % len(data)])
        _sync(dev)
        times.append((time.perf_counter() - t) * 1e3)
    return {"step_ms": statistics.median(times), "steps_ms": times, "warmup_s": warm_s}


def _one_model(
    name: str,
    config: dict[str, Any],
    batch: int,
    *,
    dev: torch.device,
    args: argparse.Namespace,
    peak: float | None,
) -> dict[str, Any]:
    model = get_model(name, **config)
    stats = layer_stats(model, batch_size=batch)
    flops = sum(s.fwd_flops + s.bwd_flops for s in stats)
    tokens = name in ("gpt", "bert")
    per_step = batch * (config.get("seq_len", 256) if tokens else 1)
    data = _batches(model, batch, dev)
    out: dict[str, Any] = {
        "config": config,
        "batch_size": batch,
        "microbatches": MICROBATCHES,
        "layers": len(model),
        "flops_per_step": flops,
        "unit": "tokens" if tokens else "images",
        "variants": {},
    }
    for variant in args.variants:
        builder = {
            "plain_eager": lambda: _plain(
                model, batch=batch, dev=dev, compile_unit=None, backend=args.compile_backend
            ),
            "plain_compiled": lambda: _plain(
                model,
                batch=batch,
                dev=dev,
                compile_unit=args.plain_compile,
                backend=args.compile_backend,
            ),
            "dynpipe_eager": lambda: _dynpipe(model, batch=batch, dev=dev, backend=None),
            "dynpipe_compiled": lambda: _dynpipe(
                model, batch=batch, dev=dev, backend=args.compile_backend
            ),
        }[variant]
        print(f"[{name}] {variant} ...", flush=True)
        gc.collect()
        # Each compiled variant compiles afresh (its warm-up says what that cost), and no
        # earlier variant's compiled code holds its model's memory.
        torch._dynamo.reset()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        try:
            torch.manual_seed(0)
            got = _measure(builder(), data, dev=dev, warmup=args.warmup, steps=args.steps)
        except Exception as exc:  # one variant failing (OOM, a compile error) is reported
            traceback.print_exc()
            out["variants"][variant] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            print(f"[{name}] {variant} FAILED: {exc}"[:300], flush=True)
            continue
        finally:
            gc.collect()
        ms = got["step_ms"]
        got["per_s"] = per_step / (ms / 1e3)
        got["tflops"] = flops / (ms / 1e3) / 1e12
        got["mfu"] = got["tflops"] / peak if peak else None
        got["peak_mem_gib"] = (
            torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
        )
        out["variants"][variant] = got
        mfu = f", MFU {got['mfu']:.1%}" if got["mfu"] is not None else ""
        print(
            f"[{name}] {variant}: {ms:.1f} ms/step, {got['per_s']:.0f} {out['unit']}/s{mfu} "
            f"(warm-up {got['warmup_s']:.1f} s)",
            flush=True,
        )
    v = out["variants"]

    def ratio(a: str, b: str) -> float | None:
        if "step_ms" in v.get(a, {}) and "step_ms" in v.get(b, {}):
            return v[b]["step_ms"] / v[a]["step_ms"]
        return None

    out["ratios"] = {
        "dynpipe_eager/plain_eager": ratio("dynpipe_eager", "plain_eager"),
        "dynpipe_compiled/plain_compiled": ratio("dynpipe_compiled", "plain_compiled"),
        "dynpipe_compiled/plain_eager": ratio("dynpipe_compiled", "plain_eager"),
        "plain_compiled/plain_eager": ratio("plain_compiled", "plain_eager"),
    }
    return out


def _table(results: dict[str, Any]) -> str:
    head = f"{'model':9} {'variant':17} {'ms/step':>9} {'per s':>10} {'MFU':>6} {'GiB':>6}"
    lines = [head, "-" * len(head)]
    for name, r in results["models"].items():
        for variant, g in r["variants"].items():
            if "error" in g:
                lines.append(f"{name:9} {variant:17} {'failed':>9}")
                continue
            mfu = f"{g['mfu']:.1%}" if g["mfu"] is not None else "-"
            mem = f"{g['peak_mem_gib']:.1f}" if g["peak_mem_gib"] is not None else "-"
            lines.append(
                f"{name:9} {variant:17} {g['step_ms']:9.1f} {g['per_s']:10.0f} {mfu:>6} {mem:>6}"
            )
        for k, x in r["ratios"].items():
            if x is not None:
                lines.append(f"{name:9}   speed {k}: {x:.3f}x")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--output", default=None, help="JSON path (default: bench/results/)")
    p.add_argument("--models", default="gpt,vgg16,resnet50", help="comma-separated")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=15, help="untimed steps first (compiles)")
    p.add_argument("--quick", action="store_true", help="small models (tiny on CPU)")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu")
    p.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend (default: inductor on CUDA, aot_eager on CPU)",
    )
    p.add_argument(
        "--plain-compile",
        choices=("model", "layer"),
        default="model",
        help="what plain_compiled compiles: the whole model (default) or each layer",
    )
    p.add_argument("--peak-tflops", type=float, default=None, help="the card's dense peak")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if args.compile_backend is None:
        args.compile_backend = "inductor" if cuda else "aot_eager"
    check_backend(args.compile_backend)
    args.variants = [v for v in args.variants.split(",") if v]
    models = [m for m in args.models.split(",") if m]
    sizes = QUICK_CPU if args.quick and not cuda else QUICK_GPU if args.quick else FULL
    bad = [m for m in models if m not in sizes] + [v for v in args.variants if v not in VARIANTS]
    if bad:
        print(
            f"unknown model or variant {', '.join(bad)}; models: {', '.join(sizes)}, "
            f"variants: {', '.join(VARIANTS)}",
            file=sys.stderr,
        )
        return 2
    if args.quick and not cuda:
        torch.set_num_threads(1)
    if cuda:
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # dynpipe's engine runs over a process group, as `dynpipe train --nproc 1` gives it.
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        **({"device_id": dev} if cuda else {}),
    )
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    peak, peak_source = _peak(name, args.peak_tflops) if cuda else (None, "CPU: no MFU")
    results: dict[str, Any] = {
        "bench": "gpu_efficiency",
        "where": {
            **environment(dev),
            "revision": code_revision(),
            "peak_tflops": peak,
            "peak_source": peak_source,
        },
        "settings": {
            "steps": args.steps,
            "warmup": args.warmup,
            "quick": args.quick,
            "bf16": cuda,
            "tf32": cuda,
            "compile_backend": args.compile_backend,
            "plain_compile": args.plain_compile,
            "optimizer": "AdamW, fused on CUDA (foreach on CPU), both sides",
            "timing": "median wall time of a step ending in a device synchronisation",
        },
        "models": {},
    }
    print(f"{name}, torch {torch.__version__}, revision {code_revision()}", flush=True)
    out = Path(args.output) if args.output else _default_path(name, args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        for m in models:
            config, batch = sizes[m]
            results["models"][m] = _one_model(m, config, batch, dev=dev, args=args, peak=peak)
            # Written after every model: a run cut short keeps the models it finished.
            results["wall_s"] = time.perf_counter() - t0
            out.write_text(json.dumps(results, indent=1))
    finally:
        dist.destroy_process_group()
    print(_table(results), flush=True)
    print(f"wrote {out} ({results['wall_s']:.0f} s)", flush=True)
    return 0


def _default_path(device: str, quick: bool) -> Path:
    card = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")
    rev = (code_revision() or "norev").replace("+", "-")
    return (
        ROOT / "bench" / "results" / f"gpu-efficiency{'-quick' if quick else ''}-{card}-{rev}.json"
    )


if __name__ == "__main__":
    sys.exit(main())
