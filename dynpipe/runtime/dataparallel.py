"""Gradient averaging across pipeline replicas: torch's ``DistributedDataParallel`` per stage.

Every stage's module is wrapped in DDP over the mesh's ``dp`` group (the stage's copies in
every replica). ``torch.distributed.pipelining`` knows DDP: it runs every microbatch's
forward and every backward but the last under ``no_sync`` (gradients accumulate locally),
and prepares DDP's reducer for the last one, so the gradient buckets are all-reduced as
they become ready during the last microbatch's backward, overlapped with it.

What was checked in torch 2.13, and why DDP:

- ``replicate`` (composable; in 2.13 built on FSDP2) and ``fully_shard``: the pipelining
  stage turns their gradient sync off for every backward and reduces everything in
  ``perform_reduce_grad`` after the last one, so the reduce does not overlap the backward;
  ``fully_shard`` needs reduce-scatter, which gloo lacks.
- DDP: the reduce overlaps the last backward, it runs on gloo and NCCL, and replicas may
  run different numbers of microbatches (each replica's last backward is its own).

Two settings differ from DDP's defaults:

- A comm hook that sums each bucket across replicas (DDP's default divides by the group
  size first). The engine divides by the step's microbatch count afterwards, so uneven
  batch shares weigh every microbatch alike and the update is the full batch's; with two
  replicas ``a + b`` is what a single process accumulating ``a`` then ``b`` computes. The
  hook also marks, on the stage's timer, when the last bucket was handed over: the rest of
  that backward is reduce time (waiting for the slowest replica), not compute.
- ``forward_sync_buffers=False``: no buffer broadcast before each forward. Buffers (batch
  norm statistics) are synced at construction; after that every replica updates its own
  from its share of the batch, as each microbatch of a single process would, in a
  different order. Models with running statistics therefore train the same weights only up
  to those statistics; the zoo's mlp and gpt have none.

A replica whose share partial reduce leaves out computes nothing; its ranks take part in
the reduce with zero gradients and receive the others' sum (``shadow``), through the
calls DDP's own uneven-input ``join`` makes for a rank that has run out of data: rebuild
the buckets when the others do (DDP rebuilds them once, on the forward after its first
synchronised backward, with a broadcast over the group), all-reduce one zero bucket per
bucket in DDP's order through the same comm hook, then offer its parameters for the
rebuild. Unlike ``join``, the reduced buckets are kept: they become the gradients, so the
dropped replica applies the same update and stays identical to the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dynpipe.runtime.mesh import Mesh
from dynpipe.runtime.timing import StageTimer

__all__ = ["ReplicaReducer"]


@dataclass
class _HookState:
    group: dist.ProcessGroup | None
    timer: StageTimer


def _sum_buckets(state: _HookState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket summed over the replicas (no division)."""
    state.timer.handed_to_reduce()
    work = dist.all_reduce(bucket.buffer(), group=state.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# DDP checks a hook's annotations as objects; postponed annotations are strings.
_sum_buckets.__annotations__ = {
    "state": _HookState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


class ReplicaReducer:
    """A stage module wrapped in DDP over the mesh's ``dp`` group (see the module docstring).

    init_sync: broadcast replica 0's parameters and buffers at construction (the first build;
        rebuilds after a repartition skip it: every replica moved identical copies).
    bucket_mb: DDP's bucket size (MiB).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        mesh: Mesh,
        timer: StageTimer,
        init_sync: bool = True,
        bucket_mb: float = 25.0,
    ) -> None:
        import inspect

        from torch.nn.parallel import DistributedDataParallel

        # torch 2.13 renamed the forward buffer sync (broadcast_buffers is deprecated there).
        params = inspect.signature(DistributedDataParallel).parameters
        no_sync = (
            "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
        )
        self.ddp = DistributedDataParallel(
            module,
            process_group=mesh.dp_group,
            init_sync=init_sync,
            bucket_cap_mb=bucket_mb,
            **{no_sync: False},
        )
        self._state = _HookState(mesh.dp_group, timer)
        self.ddp.register_comm_hook(self._state, _sum_buckets)

    @property
    def module(self) -> nn.Module:
        """What the pipelining stage runs (the DDP wrapper)."""
        return self.ddp

    def shadow(self) -> None:
        """This step's reduce without a backward: zeros in, the other replicas' gradient
        sums out, written as this stage's gradients (see the module docstring)."""
        reducer = self.ddp.reducer
        timer = self._state.timer
        start = timer.mark()
        reducer._rebuild_buckets()
        buckets = reducer._get_zeros_like_grad_buckets()
        futures = [reducer._run_comm_hook(b) for b in buckets]
        for bucket, fut in zip(buckets, futures, strict=True):
            fut.wait()
            for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
                p.grad = g.detach().clone()
        reducer._push_all_rebuilt_params()
        if start is not None:
            timer.reduce_interval(start)
