"""Data-loading benchmark: does prefetching keep a GPU stage fed?

    python bench/bench_loader.py                          # vgg16 224x224, batch 64
    python bench/bench_loader.py --workers 0 2 4 --compute-ms 35 --steps 40
    # the digits as augmented 224x224 images for resnet50 at batch 256 (bench/gpu_tta.sh):
    python bench/bench_loader.py --data digits --model resnet50 --batch-size 256 \
        --compute-ms 110 --workers 0 1 2 4

A loop that sleeps ``--compute-ms`` per step stands in for the GPU step (vgg16 at 224x224,
batch 64: about 35 ms on an H100) and takes each step's batch (``--data``: synthetic, or
digits, which an image model gets as images) either straight from ``source.batch`` (what
``workers=0`` does) or from a ``BatchStream`` with N workers. Prints the batch's cost
in-process, on one thread as a loader worker makes it and on this process's threads, then
the mean wall time per step after the first few (worker start-up is reported apart). With
enough cores it should fall to ``max(compute, batch cost / workers)``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dynpipe.data import get_data  # noqa: E402
from dynpipe.data.loader import BatchStream  # noqa: E402
from dynpipe.models import get_model  # noqa: E402


def run(source, *, workers: int, batch_size: int, steps: int, compute_s: float) -> dict:
    t0 = time.perf_counter()
    walls = []
    with BatchStream(source, batch_size=batch_size, start=0, stop=steps, workers=workers) as s:
        first = None
        for step in range(steps):
            t = time.perf_counter()
            s.batch(step)
            first = first if first is not None else time.perf_counter() - t0
            time.sleep(compute_s)  # the GPU step this batch would feed
            walls.append(time.perf_counter() - t)
    # Mean, not median: workers deliver in bursts, so most steps wait for nothing and a few
    # wait for a lot. The first steps drain the queue filled at start-up: not steady state.
    skip = min(5, steps // 4)
    return {"first_s": first, "step_ms": 1e3 * statistics.mean(walls[skip:])}


def _batch_ms(source, batch_size: int, *, threads: int) -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        source.batch(0, batch_size)  # warm: caches, first-touch allocations
        t = time.perf_counter()
        for step in range(1, 4):
            source.batch(step, batch_size)
        return 1e3 * (time.perf_counter() - t) / 3
    finally:
        torch.set_num_threads(before)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="synthetic", choices=["synthetic", "digits"])
    p.add_argument("--model", default="vgg16")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--compute-ms", type=float, default=35.0)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = p.parse_args()
    model = get_model(args.model, image_size=args.image_size)
    source = get_data(args.data, model=model)
    one = _batch_ms(source, args.batch_size, threads=1)  # as a loader worker makes it
    many = _batch_ms(source, args.batch_size, threads=torch.get_num_threads())
    print(
        f"{args.data} for {args.model} {args.image_size}px, batch {args.batch_size}: "
        f"{one:.0f} ms per batch on 1 thread, {many:.0f} ms on {torch.get_num_threads()}; "
        f"{os.cpu_count()} cores; compute stand-in {args.compute_ms:g} ms, so "
        f"{math.ceil(one / args.compute_ms)} worker(s) of one thread keep up"
    )
    for w in args.workers:
        r = run(
            source,
            workers=w,
            batch_size=args.batch_size,
            steps=args.steps,
            compute_s=args.compute_ms / 1e3,
        )
        print(f"  workers={w}: {r['step_ms']:.1f} ms/step (first batch after {r['first_s']:.2f}s)")


if __name__ == "__main__":
    main()
