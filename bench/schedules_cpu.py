"""Measure each pipeline schedule's step time on CPU: 4 gloo ranks, clean and with one
rank slowed (emulated interference), raw per-rank per-step records to JSONL.

    PYTHONPATH=$PWD:$PWD/bench python bench/schedules_cpu.py \
        --out bench/results/schedules-cpu.jsonl
    python bench/schedules_table.py bench/results/schedules-cpu.jsonl

The model is ``bench/sleepy.py`` (layer time is sleep: the machine this was recorded on has
2 cores for 4 ranks, pinned ``rank % cores``). gpipe and 1f1b run 4 stages of 4 layers;
the multi-stage schedules run 2 virtual stages of 2 layers per rank. Each schedule runs
``--steps`` steps with sleepless layers (``bare``: what the schedule runtime itself costs
around each action, which the simulator takes as its ``action_ms``), then clean, then with
rank ``--slow-rank`` dilated ``--factor`` x (the runtime's emulated interference stretches
every layer's forward and backward on it). Every
rank writes one record per step: its step time, its schedule time, each forward and backward
interval (in the order its schedule ran them), the zero-bubble weight parts, its optimizer
update, and on the sampled step the per-layer times of the layers it holds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb", "zbv", "dualpipev")


def _rank(rank: int, world: int, store_path: str, args: argparse.Namespace, out: str) -> None:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    from dynpipe.models import get_model
    from dynpipe.planner.plan import MULTI_SCHEDULES, Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.optim import OptimConfig
    from dynpipe.runtime.topology import Topology

    ms = args.fwd_ms  # each layer: this forward, and as long an input and a weight gradient
    model = get_model("sleepy:sleepy", depth=args.layers, fwd_ms=ms, bwd_i_ms=ms, bwd_w_ms=ms)
    # The same layers with no sleep: what the schedule runtime costs around them.
    bare = get_model("sleepy:sleepy", depth=args.layers, fwd_ms=0.0, bwd_i_ms=0.0, bwd_w_ms=0.0)
    topo = Topology.from_env(device="cpu")
    cfg = EngineConfig(batch_size=args.batch, optim=OptimConfig(name="sgd", lr=0.01))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 16, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    p2p_ms = _p2p_ms(rank, world, shape=(args.batch // args.microbatches, 16))
    rows = []
    for schedule in SCHEDULES:
        chunks = 2 if schedule in MULTI_SCHEDULES else 1
        runs = (("bare", 1.0, bare), ("clean", 1.0, model), ("slowed", args.factor, model))
        eng = None
        for condition, factor, net in runs:
            if eng is None or eng.model is not net:
                plan = Plan.even(
                    net, world, schedule=schedule, microbatches=args.microbatches, chunks=chunks
                )
                eng = PipelineEngine(net, plan, topo=topo, config=cfg)
            eng.timer.dilation = factor if rank == args.slow_rank else 1.0
            for step in range(args.steps):
                sampled = step == args.steps - 1
                r = eng.step(step, (x, y), sample_layers=sampled)
                t = r.timing
                rows.append(
                    {
                        "schedule": schedule,
                        "chunks": chunks,
                        "condition": condition,
                        "factor": factor,
                        "slow_rank": args.slow_rank,
                        "rank": rank,
                        "world": world,
                        "microbatches": args.microbatches,
                        "bounds": plan.bounds,
                        "stages": plan.stages_of_rank(rank),
                        "step": step,
                        "step_ms": r.step_ms,
                        "schedule_ms": t.schedule_ms,
                        "fwd_ms": t.fwd_ms,
                        "bwd_ms": t.bwd_ms,
                        "bwd_w_ms": t.bwd_w_ms,
                        "update_ms": t.update_ms,
                        "layer_fwd_ms": t.layers.fwd_ms if t.layers else None,
                        "layer_bwd_ms": t.layers.bwd_ms if t.layers else None,
                        "p2p_ms": p2p_ms,
                        "torch": torch.__version__,
                        "cores": len(cores),
                    }
                )
        dist.barrier()
    with open(out, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


def _p2p_ms(rank: int, world: int, *, shape: tuple[int, ...], rounds: int = 30) -> list[float]:
    """One-way time of a microbatch's activation from rank ``r`` to ``r + 1``, per link, as
    the schedule sees it: the receiver is already blocked in its receive (the sender sleeps
    first), so the time includes waking it. Clocks agree (one host's monotonic clock): the
    sender's send time travels in the message. Median of ``rounds``."""
    import time

    buf = torch.zeros(shape, dtype=torch.float64)
    out = []
    for link in range(world - 1):
        ms = []
        for _ in range(rounds):
            if rank == link:
                time.sleep(0.002)
                buf[0, 0] = time.perf_counter()
                dist.send(buf, link + 1)
            elif rank == link + 1:
                dist.recv(buf, link)
                ms.append((time.perf_counter() - float(buf[0, 0])) * 1e3)
        t = torch.tensor([float(np.median(ms)) if ms else 0.0])
        dist.all_reduce(t)
        out.append(float(t))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/schedules-cpu.jsonl")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--fwd-ms", type=float, default=3.0)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--factor", type=float, default=2.0)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        parts = [str(Path(tmp) / f"rank{r}.jsonl") for r in range(args.ranks)]
        store = str(Path(tmp) / "store")
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_rank, args=(r, args.ranks, store, args, parts[r]))
            for r in range(args.ranks)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=900)
        bad = [r for r, proc in enumerate(procs) if proc.exitcode != 0]
        if bad:
            print(f"ranks {bad} failed", file=sys.stderr)
            return 1
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w") as fh:
            for part in parts:
                fh.write(Path(part).read_text())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
