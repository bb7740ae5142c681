"""``dynpipe profile`` (sweeps, ``summary``, ``telemetry``) and ``dynpipe interfere``.

    dynpipe profile --model mlp,gpt --batch-size 32 --set gpt.depth=4 \\
        --sweep recipes/sweeps/cpu.toml --cores 0 -o profiles/cpu.parquet
    dynpipe profile summary profiles/cpu.parquet
    dynpipe profile telemetry --device cuda:0 --seconds 5
    dynpipe interfere --kind gemm --intensity 0.5 --device cuda:0 --timeout 600

Heavy libraries (torch, pandas, pynvml) are imported inside the handlers.
"""

from __future__ import annotations

import argparse
import signal
import time
from typing import Any

from dynpipe.errors import UserError
from dynpipe.profiler.settings import model_configs

__all__ = ["parse_cores", "register", "run_interfere", "run_profile"]


def parse_cores(text: str | None) -> list[int] | None:
    """``"0"``, ``"0,2"``, ``"0-3"`` -> sorted core list; ``None`` stays ``None``."""
    if text is None or text == "":
        return None
    cores: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise UserError(f"--cores {text!r}: write core numbers like 0 or 0,1 or 0-3") from None
    return sorted(cores)


def _term_as_interrupt() -> None:
    # A SIGTERM (job scheduler, timeout) unwinds like Ctrl-C, so interferers are stopped and
    # the partial dataset stays consistent.
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def run_profile(args: argparse.Namespace) -> int:
    if args.profile_cmd == "summary":
        return _run_summary(args)
    if args.profile_cmd == "telemetry":
        return _run_telemetry(args)
    if args.profile_cmd == "corpus":
        from dynpipe.profiler.corpus import run_corpus

        return run_corpus(args)
    missing = [
        f
        for f, v in (
            ("--model", args.model),
            ("--batch-size", args.batch_size),
            ("--sweep", args.sweep),
            ("-o", args.out),
        )
        if not v
    ]
    if missing:
        raise UserError(
            f"dynpipe profile needs {', '.join(missing)}; e.g. dynpipe profile --model mlp "
            "--batch-size 32 --sweep recipes/sweeps/smoke.toml -o profiles/smoke.parquet"
        )
    from dataclasses import replace

    from dynpipe.profiler.conditions import load_sweep
    from dynpipe.profiler.sweep import run_sweep

    names = [n for item in args.model for n in item.split(",") if n]
    sizes = []
    for item in args.batch_size:
        for b in item.split(","):
            try:
                sizes.append(int(b))
            except ValueError:
                raise UserError(f"--batch-size {item!r}: give integers like 32 or 32,64") from None
    bad = [b for b in sizes if b < 1]
    if bad:
        # Checked before the sweep starts interferers; the layer statistics would raise later.
        raise UserError(
            f"--batch-size {bad[0]}: batch sizes must be >= 1; give e.g. --batch-size 32 or 32,64"
        )
    cores = parse_cores(args.cores)
    if args.device == "cuda":
        args.device = "cuda:0"  # one name per device in the dataset and its interferers
    sweep = load_sweep(args.sweep, device=args.device, cores=cores)
    overrides = {
        k: getattr(args, k)
        for k in ("repeats", "warmup", "sample_ms")
        if getattr(args, k) is not None
    }
    if overrides:
        sweep = replace(sweep, **overrides)
    _term_as_interrupt()
    df = run_sweep(
        model_configs(names, overrides=args.overrides),
        batch_sizes=sizes,
        sweep=sweep,
        out=args.out,
        device=args.device,
        dtype=args.dtype,
        cores=cores,
        progress=not args.quiet,
        ready_timeout_s=args.ready_timeout,
    )
    print(
        f"{args.out}: {len(df)} rows, {df['condition'].nunique()} conditions, "
        f"models {', '.join(sorted(df['model'].unique()))}"
    )
    return 0


def _run_summary(args: argparse.Namespace) -> int:
    from dynpipe.profiler.schema import load_profiles
    from dynpipe.profiler.summary import summarize

    text = summarize(load_profiles(args.profiles))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


def _run_telemetry(args: argparse.Namespace) -> int:
    from dynpipe.devices.telemetry import TelemetrySampler

    cores = parse_cores(args.cores)
    with TelemetrySampler(
        args.device, cores=cores, interval_s=args.interval, self_on_device=False
    ) as sampler:
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))
            w = sampler.window()
            print("  ".join(f"{k.removeprefix('tel_')}={v:.3g}" for k, v in w.items()), flush=True)
        print(
            f"sampler cost: {sampler.tick_cost_ms:.3f} ms CPU per tick "
            f"at {1 / args.interval:.0f} Hz"
        )
    return 0


def run_interfere(args: argparse.Namespace) -> int:
    from dynpipe.devices.interfere import InterfererSpec, start_interferer

    fields = {
        "kind": args.kind,
        "intensity": args.intensity,
        "count": args.count,
        "device": args.device,
        "cores": parse_cores(args.cores),
        "period_ms": args.period_ms,
    }
    for name in ("size", "buffer_mb", "dtype", "model", "batch_size"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    spec = InterfererSpec(**fields)
    _term_as_interrupt()
    itf = start_interferer(spec, timeout_s=args.timeout, ready_timeout_s=args.ready_timeout)
    try:
        print(
            f"ready: {spec.condition_id} on {spec.device} pids {' '.join(map(str, itf.pids))}",
            flush=True,
        )
        while itf.alive:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        stats = itf.stop()
    for s in stats:
        print(f"stopped: {s['iters']} units, duty {s['duty']:.2f} over {s['wall_s']:.1f} s")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "profile",
        help="time every layer alone and beside interfering jobs; summarise datasets",
        description="Time each layer's forward and backward under each condition of a sweep "
        "file and write one row per (layer, phase, condition) to a parquet dataset.",
    )
    p.add_argument("--model", action="append", help="zoo model(s), comma-separated or repeated")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="[MODEL.]KEY=VALUE",
        help="model config, e.g. --set image_size=224 --set gpt.seq_len=512",
    )
    p.add_argument("--batch-size", action="append", help="batch size(s), e.g. 32,64")
    p.add_argument("--sweep", help="sweep file (TOML), e.g. recipes/sweeps/cpu.toml")
    p.add_argument("-o", "--out", help="output parquet; an existing one is resumed")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    p.add_argument("--cores", help="pin the profiler to these cores, e.g. 0 or 0-3")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--repeats", type=int, help="override the sweep's timing samples")
    p.add_argument("--warmup", type=int, help="override the sweep's warm-up iterations")
    p.add_argument("--sample-ms", type=float, help="override the sweep's sample length")
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=180.0,
        help="seconds to wait for interferers to start (default 180)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_profile, profile_cmd=None)
    sub = p.add_subparsers(dest="profile_cmd", metavar="{summary,telemetry,corpus}")
    s = sub.add_parser("summary", help="markdown summary of profile datasets")
    s.add_argument("profiles", nargs="+", help="parquet files or directories")
    s.add_argument("-o", "--out", help="write the markdown here instead of stdout")
    c = sub.add_parser(
        "corpus",
        help="profile the predictor's corpus of architectures, one file each",
        description="Profile every architecture of the predictor's corpus (zoo, Hugging Face, "
        "torchvision, MobileNet, EfficientNet, MLP-Mixer) under a sweep, one parquet per "
        "architecture in OUT, each in its own process. --seconds splits a time budget over "
        "them (below 1800 s: the reduced sweep and two batch sizes).",
    )
    c.add_argument("out", metavar="OUT", help="folder for <card>-<arch>.parquet and corpus.json")
    c.add_argument("--device", default="cuda:0", help="cuda:N (default cuda:0) or cpu")
    c.add_argument(
        "--size", default="gpu", help="gpu: full-size models (default); tiny: CPU-sized ones"
    )
    c.add_argument("--seconds", type=float, help="total time budget (default: none)")
    c.add_argument("--only", help="comma-separated corpus architectures, e.g. mlp,mixer")
    c.add_argument("--batch-sizes", help="override the batch sizes, e.g. 16,32")
    c.add_argument("--sweep", help="override the sweep file")
    c.add_argument("--dtype", help="default bfloat16 on GPU, float32 on CPU")
    c.add_argument("--cores", help="pin the profiler to these cores (CPU), e.g. 0")
    c.add_argument("--repeats", type=int, help="override the sweep's timing samples")
    c.add_argument("--sample-ms", type=float, help="override the sweep's sample length")
    t = sub.add_parser("telemetry", help="print telemetry windows of a device")
    t.add_argument("--device", default="cpu")
    t.add_argument("--cores")
    t.add_argument("--seconds", type=float, default=5.0)
    t.add_argument("--interval", type=float, default=0.05)

    i = subparsers.add_parser(
        "interfere",
        help="run an interfering job beside your own (GEMM, copy, training, spin, membw)",
        description="Start COUNT interferer processes and keep them running until Ctrl-C, "
        "SIGTERM or --timeout. They never outlive this command.",
    )
    i.add_argument(
        "--kind", required=True, help="gemm | copy | train (GPU); spin | membw | train (CPU)"
    )
    i.add_argument("--intensity", type=float, default=1.0, help="duty cycle 0-1 (default 1)")
    i.add_argument("--count", type=int, default=1)
    i.add_argument("--device", default="cpu", help="cpu or cuda:N")
    i.add_argument("--cores", help="CPU affinity, e.g. 0 or 0-3")
    i.add_argument("--timeout", type=float, help="stop by themselves after this many seconds")
    i.add_argument("--period-ms", type=float, default=25.0)
    i.add_argument("--size", type=int, help="gemm matrix side / spin loop length")
    i.add_argument("--buffer-mb", type=float, help="copy / membw buffer size")
    i.add_argument("--dtype", help="gemm dtype (default bfloat16)")
    i.add_argument("--model", help="train: zoo model (default mlp)")
    i.add_argument("--batch-size", type=int, help="train: batch size")
    i.add_argument("--ready-timeout", type=float, default=180.0)
    i.set_defaults(func=run_interfere)
