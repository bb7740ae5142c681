"""Step throughput of dynpipe's engine against plain ``torch.distributed.pipelining``.

Same model, same split, same microbatches, same optimizer, in one run: a plain
``PipelineStage`` + ``Schedule1F1B`` loop as a PyTorch user would write it, and dynpipe with
its timers off, on as the runtime runs them (stage timers every step, every layer timed on
one step in five: one per monitoring window), and with every layer timed on every step.
Variants alternate block by block (each block a run of steps with one synchronisation at its
end) so drift (clocks, other jobs) hits all of them alike; the ratio of median block times
is printed and written as JSON with the device named.

    # 2 GPUs (bf16), one process per GPU:
    torchrun --nproc-per-node 2 bench/bench_pipeline.py --model vgg16 --bf16 --device cuda
    torchrun --nproc-per-node 2 bench/bench_pipeline.py --model gpt --bf16 --device cuda
    # CPU (gloo):
    torchrun --nproc-per-node 2 bench/bench_pipeline.py --model mlp --device cpu
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from dynpipe.models import get_model
from dynpipe.planner import Plan
from dynpipe.runtime.engine import EngineConfig, PipelineEngine
from dynpipe.runtime.optim import OptimConfig
from dynpipe.runtime.runlog import environment
from dynpipe.runtime.stage import boundary_examples
from dynpipe.runtime.topology import Topology, init_distributed

PRESETS = {
    "vgg16": {"image_size": 224, "num_classes": 1000},
    "gpt": {"depth": 12, "width": 768, "heads": 12, "seq_len": 512, "vocab": 256},
    "gpt2048": {"depth": 12, "width": 2048, "heads": 16, "seq_len": 1024, "vocab": 256},
    "mlp": {"depth": 16, "width": 512, "in_features": 512},
}


class _Plain(nn.Module):
    """What a user hands to PipelineStage: the layers, under autocast when asked."""

    def __init__(self, layers: nn.ModuleDict, bf16: bool, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = layers
        self.bf16 = bf16
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = torch.autocast("cuda", torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        with ctx:
            for layer in self.layers.values():
                x = layer(x)
        return x.to(self.out_dtype) if x.is_floating_point() else x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp", choices=sorted(PRESETS))
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="steps per block")
    ap.add_argument("--rounds", type=int, default=15, help="blocks per variant, interleaved")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()

    topo = Topology.from_env(device=args.device, timeout_s=300)
    init_distributed(topo)
    torch.manual_seed(0)
    name = "gpt" if args.model.startswith("gpt") else args.model
    model = get_model(name, **PRESETS[args.model])
    plan = Plan.even(model, topo.world_size, schedule="1f1b", microbatches=args.microbatches)
    bf16 = args.bf16 and topo.is_cuda
    optim = OptimConfig(name="adamw", lr=1e-4)
    dev = topo.device
    x, y = model.input_spec.example(args.batch_size, device=dev)

    # --- plain torch pipelining ----------------------------------------------------------
    s = plan.stage_of_rank(topo.rank)
    st = plan.stages[s]
    wire = torch.bfloat16 if bf16 else torch.float32
    last = s == plan.num_stages - 1
    plain_mod = _Plain(
        model.build_range(st.start, st.stop, device=dev), bf16, torch.float32 if last else wire
    )
    inp, out = boundary_examples(
        model, plan, s, microbatch_size=args.batch_size // args.microbatches, wire_dtype=wire
    )
    plain_stage = PipelineStage(plain_mod, s, plan.num_stages, dev, input_args=inp, output_args=out)
    plain_sched = Schedule1F1B(plain_stage, n_microbatches=args.microbatches, loss_fn=model.loss_fn)
    plain_opt = torch.optim.AdamW(plain_mod.parameters(), lr=optim.lr)

    def plain_step(_i: int) -> None:
        plain_opt.zero_grad(set_to_none=True)
        if s == 0:
            plain_sched.step(x)
        elif last:
            plain_sched.step(target=y, losses=[])
        else:
            plain_sched.step()
        plain_opt.step()

    # --- dynpipe -------------------------------------------------------------------------
    engines = {
        timing: PipelineEngine(
            model,
            plan,
            topo=topo,
            config=EngineConfig(batch_size=args.batch_size, optim=optim, bf16=bf16, timing=timing),
        )
        for timing in (True, False)
    }
    variants = {
        "torch": plain_step,
        "dynpipe_no_timing": lambda i: engines[False].step(0, (x, y)),
        "dynpipe": lambda i: engines[True].step(0, (x, y), sample_layers=i % 5 == 4),
        "dynpipe_every_layer": lambda i: engines[True].step(0, (x, y), sample_layers=True),
    }

    def timed(fn, n: int) -> list[float]:
        """One block of ``n`` steps: its mean step time (one synchronisation at each end)."""
        dist.barrier()
        if topo.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        if topo.is_cuda:
            torch.cuda.synchronize()
        return [(time.perf_counter() - t0) * 1e3 / n]

    for fn in variants.values():
        timed(fn, args.warmup)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            times[name] += timed(fn, args.steps)

    # Every rank timed the same barrier-aligned steps; report the slowest rank's median.
    med = {k: statistics.median(v) for k, v in times.items()}
    t = torch.tensor([med[k] for k in variants], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    med = dict(zip(variants, t.tolist(), strict=True))
    if topo.rank == 0:
        res = {
            "model": args.model,
            "config": PRESETS[args.model],
            "batch_size": args.batch_size,
            "microbatches": args.microbatches,
            "stages": plan.num_stages,
            "bf16": bf16,
            "median_step_ms": med,
            "throughput_ratio_vs_torch": {k: med["torch"] / med[k] for k in variants},
            "samples": {k: len(v) for k, v in times.items()},
            "env": environment(dev),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        Path(args.out).mkdir(parents=True, exist_ok=True)
        out = f"pipeline-{args.model}-{'gpu' if topo.is_cuda else 'cpu'}-{plan.num_stages}st.json"
        (Path(args.out) / out).write_text(json.dumps(res, indent=1) + "\n")
        print(
            json.dumps(
                {k: res[k] for k in ("model", "median_step_ms", "throughput_ratio_vs_torch")},
                indent=1,
            )
        )
        print(f"device: {res['env']['device_name']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
