"""GPU check: what a pipeline boundary transfer really costs, against ``measure_bandwidth``.

    torchrun --nproc-per-node 2 bench/links_check.py [--mbytes 51]

Prints, for one message of the given size between ranks 0 and 1: the bandwidth
``runtime/links.py`` measures before training (host-timed ping-pong, one message each
way), one transfer timed with CUDA events on the receiving stream, and eight messages sent
back to back (as a pipeline's forwards send them) timed the same way; and whether the two
GPUs can reach each other's memory directly.
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


def _p2p(buf: torch.Tensor, peer: int, send: bool) -> None:
    op = dist.isend if send else dist.irecv
    for w in dist.batch_isend_irecv([dist.P2POp(op, buf, peer)]):
        w.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mbytes", type=float, default=51.0)
    ap.add_argument("--rounds", type=int, default=10)
    a = ap.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    topo = Topology.from_env(device="cuda")
    n = int(a.mbytes * 1e6) // 2
    bw = measure_bandwidth(topo, nbytes=n * 2)
    buf = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    peer = 1 - rank
    one, burst = [], []
    for i in range(a.rounds + 1):
        torch.cuda.synchronize()
        dist.barrier()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # Receiver posts first, then the sender sends: the transfer itself, not the
        # rendezvous, is what the events see.
        if rank == 1:
            e0.record()
            _p2p(buf, peer, send=False)
            e1.record()
        else:
            time.sleep(0.01)
            _p2p(buf, peer, send=True)
        torch.cuda.synchronize()
        if i and rank == 1:
            one.append(e0.elapsed_time(e1))
        dist.barrier()
        t0 = time.perf_counter()
        bufs = [buf.clone() for _ in range(8)]
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for b in bufs:
            _p2p(b, peer, send=rank == 0)
        torch.cuda.synchronize()
        if i and rank == 1:
            burst.append((time.perf_counter() - t0) * 1e3 / 8)
    if rank == 1:
        size = n * 2
        print(f"message {size / 1e6:.1f} MB; peer access {torch.cuda.can_device_access_peer(0, 1)}")
        print(f"measure_bandwidth: {bw / 1e9:.1f} GB/s -> {size / bw * 1e3:.2f} ms a message")
        m1, mb = statistics.median(one), statistics.median(burst)
        print(
            f"one transfer (events, receiver posted first): {m1:.2f} ms, {size / m1 / 1e6:.1f} GB/s"
        )
        print(f"eight back to back (host, per message): {mb:.2f} ms, {size / mb / 1e6:.1f} GB/s")
        print(f"NCCL {torch.cuda.nccl.version()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
