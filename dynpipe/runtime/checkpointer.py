"""Writing checkpoints: each save a fresh folder, published atomically, in the background.

``Checkpointer.save`` copies this rank's state to host memory and returns; a thread then
writes it (``dcp.save``), waits for every rank's files, hashes this rank's share of them,
and rank 0 publishes the folder: rename from its hidden temporary name, then the marker
``dynpipe.json`` last (see ``dynpipe.runtime.checkpoint`` for the format and the reading
side). Whenever a process group exists (one rank included) the saves use a gloo group of
their own: DCP's messages then run in the background thread without ever interleaving with
the training's on the default group, and never need a CPU backend the default group may
lack (NCCL's, even of one rank: ``dcp.async_save`` refuses such a group outright, and a
torch before 2.5 has no ``no_dist`` to keep one rank's save off it).

The copy is what blocks training. CPU tensors are cloned. GPU tensors are copied into
pinned host buffers (kept for the next save) on a side stream, so ``save`` returns once
the copies are queued: parameters and optimizer state are changed again only by the next
optimizer step, so that step waits (on the device, through a global optimizer pre-hook)
for the copies to finish; other model tensors (buffers a forward pass may update, such as
batch-norm statistics) are copied first and the training stream waits for those at once.
``DYNPIPE_CKPT_STAGING=sync`` copies GPU tensors before ``save`` returns instead.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import threading
import time
import uuid
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.optim.optimizer import register_optimizer_step_pre_hook

from dynpipe.errors import UserError
from dynpipe.runtime.checkpoint import (
    FORMAT,
    FORMAT_VERSION,
    META_FILE,
    ONE_PROCESS_WARNING,
    TMP_PREFIX,
    CheckpointError,
    dcp_kwargs,
    file_sha256,
    list_checkpoints,
)

__all__ = ["STAGING_ENV", "Checkpointer", "SaveRecord", "save_checkpoint"]

STAGING_ENV = "DYNPIPE_CKPT_STAGING"  # "pinned" (the default) or "sync"
# Threads that write (and then hash) one rank's checkpoint files. DCP's default of one
# thread writes one file per rank serially; with several, a rank's tensors are spread over
# several files written side by side.
WRITE_THREADS = 4


def _distributed(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


@dataclass
class SaveRecord:
    """A finished save, for the run log: where, which step, and what it cost."""

    path: Path
    step: int
    save_id: str
    stall_ms: float  # the training thread was blocked this long, wait_ms included
    wait_ms: float  # ... of which waiting for the previous save's write to finish
    write_ms: float  # from the call to publication (overlaps training when async)
    bytes: int
    marker_sha256: str


class Checkpointer:
    """Saves of one run into fresh folders of ``directory``, at most one in flight.

    Collective: every rank constructs it at the same point (it creates a gloo group for the
    saves when a process group exists, of any size and backend) and calls ``save`` at the
    same steps.

    ``keep``: published checkpoints kept in ``directory`` (older ones are deleted after each
    publication; the newest ``keep`` always stay). ``run_id``: recorded in every marker so a
    relaunch finds the checkpoints of its own run. ``async_save``: write in the background
    (the default); ``False`` writes before ``save`` returns.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        rank: int = 0,
        keep: int = 3,
        run_id: str | None = None,
        timeout_s: float = 120.0,
        async_save: bool = True,
    ) -> None:
        if keep < 1:
            raise UserError(f"--keep-checkpoints must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.rank = rank
        self.keep = keep
        self.run_id = run_id
        self.async_save = async_save
        self.group = None
        if dist.is_available() and dist.is_initialized():
            # The saves' own gloo group: its collectives run in a background thread and must
            # never interleave with the training's P2P messages on the default group. Made for
            # one rank too: DCP falls back to the default group, and one NCCL rank's has no
            # CPU backend.
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done: list[SaveRecord] = []
        self._pending: dict[str, Any] | None = None
        self._pinned: dict[str, torch.Tensor] = {}  # host copies of GPU tensors, reused
        self._stream: Any = None  # the copies' CUDA stream
        self._fence: Any = None  # CUDA event the next optimizer step waits for
        self._hook: Any = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(
        self,
        *,
        step: int,
        model_state: dict[str, torch.Tensor],
        optim_state: dict[str, torch.Tensor],
        meta: dict[str, Any],
        block: bool = False,
        params: set[str] | None = None,
    ) -> Path:
        """Start saving this rank's state for ``step``; returns the folder it will publish.

        The state is copied before training may change it (see the module's docstring):
        ``params`` names the ``model_state`` entries that only an optimizer step changes
        (None: every entry may change sooner, in a forward pass).
        """
        t0 = time.perf_counter()
        self._join()
        wait_ms = (time.perf_counter() - t0) * 1e3
        sid = self._agree_save_id()
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f"{TMP_PREFIX}{step:08d}-{sid}"
        final = self.directory / f"ckpt-{step:08d}-{sid}"
        background = self.async_save and not block
        rng = {f"rank{self.rank}": torch.get_rng_state()}
        ready = None
        if background:
            staged, ready = self._stage(model_state, optim_state, params or set())
            sd = {"model": staged["model"], "optim": staged["optim"], "rng": rng}
        else:
            sd = {
                "model": {k: v.detach() for k, v in model_state.items()},
                "optim": {k: v.detach() for k, v in optim_state.items()},
                "rng": rng,
            }
        job = {
            "sd": sd,
            "ready": ready,
            "tmp": tmp,
            "final": final,
            "step": step,
            "sid": sid,
            "meta": meta,
            "t0": t0,
            "stall_ms": 0.0,
            "wait_ms": wait_ms,
        }
        if not background:
            self._write(job)
            job["stall_ms"] = (time.perf_counter() - t0) * 1e3
            self._finish(job)
        else:
            job["stall_ms"] = (time.perf_counter() - t0) * 1e3  # the thread's start aside
            self._thread = threading.Thread(
                target=self._run, args=(job,), name="dynpipe-checkpoint", daemon=True
            )
            self._thread.start()
        if block:
            self._join()
        return final

    def _stage(
        self,
        model_state: dict[str, torch.Tensor],
        optim_state: dict[str, torch.Tensor],
        params: set[str],
    ) -> tuple[dict[str, dict[str, torch.Tensor]], Any]:
        """Host copies of the state; the CUDA event that marks the GPU copies done (None when
        every copy is done already)."""
        out: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optim": {}}
        early, late = [], []  # GPU tensors a forward may change / only an optimizer step
        for part, tensors in (("model", model_state), ("optim", optim_state)):
            for k, v in tensors.items():
                v = v.detach()
                if not v.is_cuda:
                    out[part][k] = v.clone()
                elif part == "optim" or k in params:
                    late.append((part, k, v))
                else:
                    early.append((part, k, v))
        if not early and not late:
            return out, None
        if os.environ.get(STAGING_ENV, "pinned") == "sync":
            for part, k, v in early + late:
                out[part][k] = v.to("cpu")
            return out, None
        keep: dict[str, torch.Tensor] = {}
        try:
            for part, k, v in early + late:
                key = f"{part}/{k}"
                buf = self._pinned.get(key)
                if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
                    buf = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                keep[key] = buf
        except RuntimeError as exc:  # no page-locked memory to be had: copy before returning
            warnings.warn(
                f"checkpoint: no pinned host buffers ({exc}); copying synchronously",
                stacklevel=3,
            )
            self._pinned = {}
            for part, k, v in early + late:
                out[part][k] = v.to("cpu")
            return out, None
        device = (early or late)[0][2].device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        training = torch.cuda.current_stream(device)
        self._stream.wait_stream(training)  # copy what the step wrote
        copied_early = torch.cuda.Event()
        done = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            for i, (part, k, v) in enumerate(early + late):
                buf = keep[f"{part}/{k}"]
                buf.copy_(v, non_blocking=True)
                # The allocator must not hand this memory to the training stream (a layer
                # that moved away frees it) before the copy has read it.
                v.record_stream(self._stream)
                out[part][k] = buf
                if i + 1 == len(early):
                    copied_early.record(self._stream)
            done.record(self._stream)
        self._pinned = keep
        if early:
            training.wait_event(copied_early)
        self._fence = done
        if self._hook is None:
            self._hook = register_optimizer_step_pre_hook(
                functools.partial(_fence_before_step, weakref.ref(self))
            )
        return out, done

    def wait(self) -> list[SaveRecord]:
        """Finish the save in flight (re-raising its error); the saves published since the
        last ``wait`` or ``drain``."""
        self._join()
        return self.drain()

    def drain(self) -> list[SaveRecord]:
        """The saves published since the last ``wait`` or ``drain`` (never blocks)."""
        if self._thread is not None and not self._thread.is_alive():
            self._join()
        out, self._done = self._done, []
        return out

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"rank {self.rank}: saving a checkpoint failed: {err}") from err

    def _run(self, job: dict[str, Any]) -> None:
        try:
            if job["ready"] is not None:
                job["ready"].synchronize()
            self._write(job)
            self._finish(job)
        except BaseException as exc:  # surfaced to the training thread by wait()
            self._error = exc

    def _agree_save_id(self) -> str:
        sid = [uuid.uuid4().hex[:12]]
        if _distributed(self.group):
            dist.broadcast_object_list(sid, src=0, group=self.group)
        return sid[0]

    def _write(self, job: dict[str, Any]) -> None:
        """DCP writes this rank's files (collective on the saves' group)."""
        no_dist = not _distributed(self.group)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=ONE_PROCESS_WARNING)
            job["index"] = dcp.save(
                job.pop("sd"),
                checkpoint_id=str(job["tmp"]),
                storage_writer=dcp.FileSystemWriter(str(job["tmp"]), thread_count=WRITE_THREADS),
                process_group=self.group,
                **dcp_kwargs(dcp.save, no_dist),
            )

    def _finish(self, job: dict[str, Any]) -> None:
        """Hash this rank's share of the files, then rank 0 publishes the folder."""
        index = job["index"]
        storage = getattr(index, "storage_data", None)
        if not storage:
            # Some torch releases (2.11) hand back the plan's metadata without its storage
            # index on every rank but the coordinator: read it from what was written (a save
            # returns once every rank's files and the metadata are on disk).
            storage = dcp.FileSystemReader(str(job["tmp"])).read_metadata().storage_data
        names = sorted({si.relative_path for si in storage.values()} | {".metadata"})
        world = dist.get_world_size(self.group) if _distributed(self.group) else 1
        me = dist.get_rank(self.group) if _distributed(self.group) else 0
        own = [n for i, n in enumerate(names) if i % world == me]
        # hashlib releases the GIL on large buffers: the files hash side by side.
        with ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="dynpipe-hash") as pool:
            digests = list(pool.map(lambda n: file_sha256(job["tmp"] / n), own))
        mine = {
            n: {"size": (job["tmp"] / n).stat().st_size, "sha256": h}
            for n, h in zip(own, digests, strict=True)
        }
        parts: list[dict | None] = [mine]
        if world > 1:
            parts = [None] * world if me == 0 else None  # type: ignore[assignment]
            dist.gather_object(
                mine, parts, dst=dist.get_global_rank(self.group, 0), group=self.group
            )
        record = None
        if me == 0:
            files: dict[str, Any] = {}
            for p in parts or []:
                files.update(p or {})
            record = self._publish(job, files)
        if world > 1:
            dist.barrier(group=self.group)
        if record is None:
            # Published by rank 0 before the barrier: the run log's writer may be any rank.
            text = (job["final"] / META_FILE).read_bytes()
            record = SaveRecord(
                path=job["final"],
                step=job["step"],
                save_id=job["sid"],
                stall_ms=job["stall_ms"],
                wait_ms=job["wait_ms"],
                write_ms=(time.perf_counter() - job["t0"]) * 1e3,
                bytes=sum(int(f["size"]) for f in json.loads(text)["files"].values()),
                marker_sha256=hashlib.sha256(text).hexdigest(),
            )
        self._done.append(record)

    def _publish(self, job: dict[str, Any], files: dict[str, Any]) -> SaveRecord:
        done, _ = list_checkpoints(self.directory)
        seq = 1 + max((i.seq for i in done), default=0)
        marker = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "save_id": job["sid"],
            "seq": seq,
            "step": job["step"],
            "run_id": self.run_id,
            "published": time.time(),
            "files": files,
            "meta": job["meta"],
        }
        os.replace(job["tmp"], job["final"])
        text = (json.dumps(marker, indent=1, default=str) + "\n").encode()
        tmp_marker = job["final"] / (META_FILE + ".tmp")
        with tmp_marker.open("wb") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_marker, job["final"] / META_FILE)
        _fsync_dir(job["final"])
        _fsync_dir(self.directory)
        self._prune(keep_path=job["final"])
        return SaveRecord(
            path=job["final"],
            step=job["step"],
            save_id=job["sid"],
            stall_ms=job["stall_ms"],
            wait_ms=job["wait_ms"],
            write_ms=(time.perf_counter() - job["t0"]) * 1e3,
            bytes=sum(int(f["size"]) for f in files.values()),
            marker_sha256=hashlib.sha256(text).hexdigest(),
        )

    def _prune(self, *, keep_path: Path) -> None:
        """Drop published checkpoints beyond the newest ``keep``, and leftovers of saves that
        never finished (one job writes into a save folder at a time)."""
        done, skipped = list_checkpoints(self.directory)
        for info in done[: max(0, len(done) - self.keep)]:
            if info.path != keep_path:
                shutil.rmtree(info.path, ignore_errors=True)
        for path, _ in skipped:
            if not (path / META_FILE).exists():
                shutil.rmtree(path, ignore_errors=True)
        for tmp in self.directory.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(tmp, ignore_errors=True)


def _fence_before_step(ref: weakref.ref, optimizer: Any, args: Any, kwargs: Any) -> None:
    """Optimizer pre-hook: the step's updates wait (on the device) for a save's copies."""
    ckpt = ref()
    if ckpt is not None and ckpt._fence is not None:
        torch.cuda.current_stream().wait_event(ckpt._fence)
        ckpt._fence = None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(
    directory: str | Path,
    *,
    model_state: dict[str, torch.Tensor],
    optim_state: dict[str, torch.Tensor],
    meta: dict[str, Any],
    rank: int = 0,
    keep: int = 3,
) -> Path:
    """Write and publish one checkpoint into ``directory`` before returning (collective when
    a process group exists); returns its folder."""
    ckpt = Checkpointer(directory, rank=rank, keep=keep, async_save=False)
    step = int(meta.get("step", 0))
    return ckpt.save(
        step=step, model_state=model_state, optim_state=optim_state, meta=meta, block=True
    )
