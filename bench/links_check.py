"""GPU check: what a pipeline boundary transfer costs, one at a time and back to back.

    torchrun --nproc-per-node 2 bench/links_check.py [--mbytes 51]

For a message of the given size between ranks 0 and 1 it prints the bandwidth of a
ping-pong (one message each way, the host waiting for the device after each: what
``runtime/links.py`` timed before it timed bursts), of eight messages sent back to back
each way (as a running pipeline queues its transfers), and what ``measure_bandwidth``
returns now; and whether the two GPUs reach each other's memory directly.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from dynpipe.runtime.links import measure_bandwidth
from dynpipe.runtime.topology import Topology


def _send_or_recv(bufs: list[torch.Tensor], peer: int, send: bool) -> None:
    op = dist.isend if send else dist.irecv
    works = [w for b in bufs for w in dist.batch_isend_irecv([dist.P2POp(op, b, peer)])]
    for w in works:
        w.wait()
    torch.cuda.synchronize()


def _timed(bufs: list[torch.Tensor], rank: int, rounds: int) -> float:
    """Median seconds per message of ``bufs`` sent 0 -> 1 then 1 -> 0."""
    out = []
    for i in range(rounds + 1):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for sender in (0, 1):
            _send_or_recv(bufs, 1 - rank, send=rank == sender)
        if i:
            out.append((time.perf_counter() - t0) / (2 * len(bufs)))
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mbytes", type=float, default=51.0)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    topo = Topology.from_env(device="cuda")
    n = int(a.mbytes * 1e6) // 2
    buf = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    size = n * 2
    one = _timed([buf], rank, a.rounds)
    burst = _timed([buf] * 8, rank, a.rounds)
    bw = measure_bandwidth(topo, nbytes=size)
    if rank == 0:
        print(f"message {size / 1e6:.1f} MB; peer access {torch.cuda.can_device_access_peer(0, 1)}")
        print(f"ping-pong: {one * 1e3:.2f} ms a message, {size / one / 1e9:.1f} GB/s")
        print(f"eight back to back: {burst * 1e3:.2f} ms a message, {size / burst / 1e9:.1f} GB/s")
        print(f"measure_bandwidth: {bw / 1e9:.1f} GB/s; NCCL {torch.cuda.nccl.version()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
