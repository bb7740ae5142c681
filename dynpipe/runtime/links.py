"""Measure the links between ranks before training, so the planner prices activations
at what the hardware moves rather than at an assumed bandwidth.

The speed model charges every boundary of a split its activation bytes over the link's
bandwidth, once per microbatch and direction. With an assumed 25 GB/s, a vgg16 split after
a wide early layer looked 8 ms per step slower than one a layer later on two NVLinked
H100s, where the transfer really costs a fraction of a millisecond; the controller then
never proposed the fastest split. One timed exchange per pair of neighbouring ranks, of
the size the pipeline really sends, replaces the assumption.

What is timed is a burst of messages sent back to back, as a pipeline's forwards (or
backwards) queue theirs, not one message each way: every wait here is bounded
(``topology.wait_all``), and a bounded wait on an NCCL work polls for completion about once a
millisecond, which a single 51 MB message between NVLinked H200s (0.17-0.24 ms) cannot
hide. Timed one message at a time, the links read 39-50 GB/s; the same messages waited for
without a bound (as the pipeline's schedule waits, on the device) moved at 212 GB/s one at a
time and 305 GB/s eight in a row (``bench/links_check.py``, 2 x H200), and this function
read 195 GB/s with bursts of eight (it sends sixteen now, to hide the polling better).
Priced at the ping-pong's rate, vgg16's splits after its wide early layers looked 8 ms a
step slower than they ran, and the controller stayed on a split 18% slower than them.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dynpipe.runtime.topology import Topology, wait_all

__all__ = ["measure_bandwidth"]

_MIN_BYTES = 1 << 20
_MAX_BYTES = 64 << 20


def _sync(device: torch.device) -> None:
    # NCCL's wait() orders the stream, not the host: the clock needs the GPU finished.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(
    topo: Topology, *, nbytes: int, rounds: int = 3, burst: int = 16
) -> float | None:
    """Median bytes/s over the links between ranks ``r`` and ``r + 1``, or None alone.

    Collective: every rank calls it. Each pair in turn sends ``burst`` messages of
    ``nbytes`` (clamped to 1-64 MiB) back to back, one direction then the other, one
    untimed round first (it sets up the channel), then ``rounds`` timed ones; a round's time
    over the messages it moved is one transfer. The lower rank of each pair keeps its
    median, and one all-reduce hands every rank all of them.
    """
    world, me, device = topo.world_size, topo.rank, topo.device
    if world == 1:
        return None
    size = int(min(max(nbytes, _MIN_BYTES), _MAX_BYTES)) // 4 * 4
    # One buffer sent (and received into) ``burst`` times: the transfers run in order on
    # one stream, and what lands in it is never read.
    bufs = [torch.zeros(size // 4, dtype=torch.float32, device=device)] * burst
    seconds = torch.zeros(world - 1, dtype=torch.float64, device=device)
    for a in range(world - 1):
        if me not in (a, a + 1):
            continue
        peer = a + 1 if me == a else a
        samples = []
        for i in range(rounds + 1):
            _sync(device)
            t0 = time.perf_counter()
            for sender in (a, a + 1):
                op = dist.isend if me == sender else dist.irecv
                # Queued one after another without waiting, as the schedule queues them.
                works = [w for b in bufs for w in dist.batch_isend_irecv([dist.P2POp(op, b, peer)])]
                wait_all(works, timeout_s=topo.timeout_s, what="link measurement")
                _sync(device)
            if i:
                samples.append((time.perf_counter() - t0) / (2 * burst))
        if me == a:
            seconds[a] = statistics.median(samples)
    work = dist.all_reduce(seconds, async_op=True)
    wait_all([work], timeout_s=topo.timeout_s, what="link measurement")
    per_link = [s for s in seconds.tolist() if s > 0]
    return size / statistics.median(per_link) if per_link else None
