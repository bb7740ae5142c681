"""Where a compiled dynpipe step spends its time, on one GPU: host issue time against
device time, and the profiler's top host and device operators.

    PYTHONPATH=$PWD python bench/compile_diag.py --model resnet50 [--eager]

A step whose host issue time is close to its wall time is launch- or guard-bound (the
host cannot keep the device busy); one whose device time is close is compute-bound.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_efficiency import FULL, _batches, _dynpipe

from dynpipe.models import get_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--eager", action="store_true", help="no --compile")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)
    import torch.distributed as dist

    dev = torch.device("cuda")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)
    config, batch = FULL[args.model]
    model = get_model(args.model, **config)
    step = _dynpipe(model, batch=batch, dev=dev, backend=None if args.eager else "inductor")
    data = _batches(model, batch, dev)
    for s in range(15):
        step(s, data[s % len(data)])
    torch.cuda.synchronize()
    host, wall = [], []
    for s in range(15, 15 + args.steps):
        t = time.perf_counter()
        step(s, data[s % len(data)])
        host.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - t)
    host.sort()
    wall.sort()
    print(
        f"{args.model} {'eager' if args.eager else 'compiled'}: wall {wall[len(wall) // 2] * 1e3:.1f} ms, host issue {host[len(host) // 2] * 1e3:.1f} ms"
    )
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for s in range(3):
            step(100 + s, data[s % len(data)])
        torch.cuda.synchronize()
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    print(ka.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
