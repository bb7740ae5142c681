"""Batches loaded ahead of the step that needs them, by worker processes, in step order.

A batch can cost more CPU than a pipeline step costs GPU (vgg16 at 224x224, batch 64: about
150 ms of synthetic data against about 35 ms of compute), so the ranks that read batches
(first and last stage) load them ahead in worker processes. This stays simple because a
source is a pure function of the step (see ``base``): any worker can make any step's batch,
so a stream is just the steps ``start..stop-1`` handed out to ``torch.utils.data``'s
workers and put back in order. There is no iterator state: a run resumed or repartitioned
at step ``s`` opens a stream at ``s`` and sees exactly the data it would have seen.

    with BatchStream(source, batch_size=64, start=0, stop=1000, workers=2) as stream:
        for step in range(1000):
            x, y = stream.batch(step)  # the step is checked: a stream cannot drift
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from dynpipe.data.base import BatchSource
from dynpipe.errors import UserError

__all__ = ["BatchStream", "CyclicBatches"]

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class _Failure:
    """A ``batch()`` that raised in a worker, sent back as plain strings.

    Raised there, DataLoader would re-raise a copy whose message is the whole worker
    traceback; sent back, the stream raises a one-line error with the traceback as its cause.
    """

    kind: str
    message: str
    user: bool
    traceback: str


class _WorkerTraceback(Exception):
    """The traceback of a worker, shown as the cause of the error it led to."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0])


class _Steps(Dataset):
    """Item ``i`` is ``(start + i, source.batch(start + i, batch_size))``."""

    def __init__(self, source: BatchSource, *, batch_size: int, start: int, stop: int) -> None:
        self.source = source
        self.batch_size = batch_size
        self.start = start
        self.stop = stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> tuple[int, Batch | _Failure]:
        step = self.start + i
        try:
            return step, self.source.batch(step, self.batch_size)
        except Exception as exc:
            msg = str(exc).strip().splitlines()
            return step, _Failure(
                kind=type(exc).__name__,
                message=msg[0] if msg else "",
                user=isinstance(exc, UserError),
                traceback=traceback.format_exc(),
            )


def _hide_gpus(worker_id: int) -> None:
    # Workers only make CPU tensors. A source that touched CUDA by mistake would open a
    # context (hundreds of MB) on GPU 0 in every worker; with no GPU visible it fails instead.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _context() -> Any:
    """Where workers start: a fork server, not a fork of the training process.

    The training process holds CUDA and NCCL state and several threads (heartbeat, telemetry);
    a fork of it can inherit a lock another thread held. A fork server is a clean,
    single-threaded process started once per training process with torch already imported,
    so each later worker is a cheap fork of it (milliseconds; the first costs about a second).
    The source is pickled to the workers, so sources must be picklable.
    """
    if "forkserver" not in mp.get_all_start_methods():  # Windows
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "dynpipe.data"])  # read when the server starts
    return ctx


class BatchStream:
    """``source.batch(step, batch_size)`` for ``step`` in ``[start, stop)``, in order.

    workers: processes loading ahead (0: each batch is made in this process when asked).
    device: where the batches go; pinned host memory (faster, asynchronous copies) for CUDA.
    prefetch: batches each worker loads ahead.
    timeout_s: the longest wait for one batch from the workers; past it the stream raises
        rather than hang (a wait in-process, with ``workers=0``, is not bounded).

    Batches are bit-identical to the direct calls for any worker count. Call ``close()``
    (or use ``with``) to stop the workers when leaving early; reaching ``stop`` stops them.
    """

    def __init__(
        self,
        source: BatchSource,
        *,
        batch_size: int,
        start: int,
        stop: int,
        workers: int = 0,
        device: torch.device | str = "cpu",
        prefetch: int = 2,
        timeout_s: float = 120.0,
    ) -> None:
        if workers < 0:
            raise UserError(f"data workers must be >= 0, got {workers}")
        if not 0 <= start <= stop:
            raise UserError(f"a batch stream needs 0 <= start <= stop, got {start}..{stop}")
        if prefetch < 1 or timeout_s <= 0:
            raise UserError(
                f"a batch stream needs prefetch >= 1 and timeout_s > 0, got prefetch={prefetch} "
                f"timeout_s={timeout_s}"
            )
        self.source = source
        self.batch_size = batch_size
        self.start, self.stop = start, stop
        self.next_step = start  # the step the next batch belongs to
        self.timeout_s = timeout_s
        self.workers = min(workers, stop - start)  # no idle processes for a short stream
        self._it: Any = None
        if self.workers > 0:
            loader = DataLoader(
                _Steps(source, batch_size=batch_size, start=start, stop=stop),
                batch_size=None,  # an item is already a whole batch
                num_workers=self.workers,
                pin_memory=torch.device(device).type == "cuda",
                prefetch_factor=prefetch,
                timeout=timeout_s,
                worker_init_fn=_hide_gpus,
                multiprocessing_context=_context(),
                # Starting the workers draws a seed; from the global RNG it would shift
                # dropout and init in the training process, so runs would depend on workers.
                generator=torch.Generator(),
            )
            try:
                self._it = iter(loader)  # starts the workers, pickling the source to each
            except Exception as exc:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise RuntimeError(
                    f"cannot start data workers for {source!r}: {first}; a source must be "
                    "picklable to load in workers (or load in-process with --data-workers 0)"
                ) from exc

    def __repr__(self) -> str:
        return (
            f"BatchStream({self.source!r}, steps {self.start}..{self.stop - 1}, "
            f"next {self.next_step}, {self.workers} workers)"
        )

    def batch(self, step: int) -> Batch:
        """The batch of ``step``, which must be the stream's next step."""
        if step != self.next_step or step >= self.stop:
            raise RuntimeError(
                f"{self!r} was asked for step {step}; a stream gives each step once, in order"
            )
        if self.workers == 0:
            x, y = self.source.batch(step, self.batch_size)
        else:
            x, y = self._receive(step)
        self.next_step += 1
        if self.next_step == self.stop:
            self.close()
        return x, y

    def __iter__(self) -> Iterator[tuple[int, Batch]]:
        """``(step, batch)`` for the remaining steps."""
        while self.next_step < self.stop:
            step = self.next_step
            yield step, self.batch(step)

    def _receive(self, step: int) -> Batch:
        t0 = time.monotonic()
        try:
            got, out = next(self._it)
        except Exception as exc:
            waited = time.monotonic() - t0
            self.close()
            if isinstance(exc, RuntimeError) and waited >= self.timeout_s:
                raise TimeoutError(
                    f"no batch for step {step} after {self.timeout_s:g}s from {self.workers} "
                    f"data workers of {self.source!r}: a worker is stalled or slower than the "
                    "timeout; raise the timeout (dynpipe train --timeout) or load in-process "
                    "(--data-workers 0) to see where it hangs"
                ) from exc
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise RuntimeError(
                f"the data workers of {self.source!r} failed while loading step {step}: "
                f"{first}; load in-process (--data-workers 0) to debug"
            ) from exc
        # Workers return items in index order and each item carries its step: a mismatch
        # would be a bug here, never a silent shift of the data.
        assert got == step, f"data worker returned step {got} for step {step}"
        if isinstance(out, _Failure):
            self.close()
            cause = _WorkerTraceback(out.traceback)
            if out.user:
                raise UserError(f"{out.message} (loading step {step})") from cause
            raise RuntimeError(
                f"{self.source!r}.batch(step={step}, batch_size={self.batch_size}) raised "
                f"{out.kind} in a data worker: {out.message}"
            ) from cause
        x, y = out
        return x, y

    def close(self) -> None:
        """Stop the workers (idempotent); the stream gives no more batches."""
        it, self._it = self._it, None
        if it is not None:
            # The iterator's own clean-up: join, then terminate a worker that is stuck.
            # Dropping the last reference would run it too, but not while a traceback still
            # holds a frame that references the iterator.
            it._shutdown_workers()
        self.stop = min(self.stop, self.next_step)

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class CyclicBatches:
    """The batches of steps ``0..count-1``, made once and kept on ``device``; step ``s``
    trains on batch ``s mod count``.

    For measuring the GPUs alone: a 224x224 batch of 512 is 300 MB to make and copy every
    step, more than a host's cores keep up with beside the training processes, and a step
    waiting for data hides what the GPUs do. Training then sees the same ``count`` batches
    over and over: for throughput and adaptation benchmarks, not for models meant to
    generalise. Same interface as ``BatchStream``; the batch of a step is still a pure
    function of the step, so resumed and repartitioned runs see the data they would have.
    """

    def __init__(
        self, source: BatchSource, *, batch_size: int, count: int, device: torch.device | str
    ) -> None:
        if count < 1:
            raise UserError(f"device batches must be >= 1, got {count}")
        self.source = source
        self.batches = [
            tuple(t.to(device) for t in source.batch(step, batch_size)) for step in range(count)
        ]

    def __repr__(self) -> str:
        return f"CyclicBatches({self.source!r}, {len(self.batches)} batches)"

    def batch(self, step: int) -> Batch:
        if not self.batches:
            raise RuntimeError(f"{self!r} was asked for step {step} after it was closed")
        x, y = self.batches[step % len(self.batches)]
        return x, y

    def close(self) -> None:
        self.batches = []

    def __enter__(self) -> CyclicBatches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
