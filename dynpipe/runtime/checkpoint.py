"""Checkpoints with ``torch.distributed.checkpoint``, keyed by stable layer names, published
atomically into fresh folders.

Every rank writes its own layers (``model.<layer>.<param>``) and their optimizer state
(``optim.<layer>.<param>/<key>``); nothing in a key depends on the plan, so a checkpoint
written under one plan loads under any other plan, any stage count, or into one process.

A save never touches a published checkpoint. It writes into a hidden ``.tmp-ckpt-*``
folder, renames it to ``ckpt-<step>-<save id>`` once every rank's files are on disk, and only
then writes the marker ``dynpipe.json`` (through a temporary name and a rename). The marker
holds the save id, a sequence number (newer saves have larger ones), the step, the size and
SHA-256 of every file of the save, and the run's metadata (plan, config, adaptation state).
A folder without a readable marker is never loaded; a file whose size or digest differs from
the marker is refused before anything is read from it, so state from two saves can never mix.

Writing is ``dynpipe.runtime.checkpointer`` (in the background, on a gloo group of its own);
this module reads, verifies and loads.

DCP stores its index (``.metadata``) as a Python pickle. ``load_checkpoint`` checks that
file's digest against the marker, then unpickles it with an allow-list of DCP's own metadata
classes, so a crafted ``.metadata`` is refused instead of running code.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import io
import json
import pickle
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dynpipe.errors import UserError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "META_FILE",
    "ONE_PROCESS_WARNING",
    "TMP_PREFIX",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointInfo",
    "check_checkpoint",
    "dcp_kwargs",
    "file_sha256",
    "find_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "newest_checkpoint",
    "read_marker",
]

META_FILE = "dynpipe.json"
FORMAT = "dynpipe-checkpoint"
FORMAT_VERSION = 2
_NAME = re.compile(r"^ckpt-(\d{8})-([0-9a-f]{12})$")
TMP_PREFIX = ".tmp-ckpt-"
_HASH_CHUNK = 1 << 22
# Saving or loading in one process (no process group) is a supported use; DCP warns about it
# from the background thread too, where a local catch_warnings would not reach.
ONE_PROCESS_WARNING = r"torch\.distributed is (disabled, )?unavailable or uninitialized"
warnings.filterwarnings("ignore", message=ONE_PROCESS_WARNING)


def dcp_kwargs(fn: Any, no_dist: bool) -> dict[str, bool]:
    """``no_dist`` for a DCP entry point, where this torch's has the argument: before 2.5 it
    had none (one process was assumed exactly when no process group existed)."""
    return {"no_dist": no_dist} if _takes_no_dist(fn) else {}


@functools.cache
def _takes_no_dist(fn: Any) -> bool:
    try:
        return "no_dist" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class CheckpointError(RuntimeError):
    """A save failed (disk full, a peer died while writing): the message says which."""


class CheckpointCorrupt(UserError):
    """A checkpoint that cannot be trusted: unreadable marker, missing or altered files."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A published checkpoint: its folder and what its marker says."""

    path: Path
    step: int
    seq: int
    save_id: str
    run_id: str | None
    marker: dict[str, Any]

    @property
    def meta(self) -> dict[str, Any]:
        return self.marker["meta"]

    def __repr__(self) -> str:
        return f"CheckpointInfo({self.path.name}, step {self.step}, seq {self.seq})"


# -- reading ----------------------------------------------------------------------------------


def read_marker(path: str | Path) -> CheckpointInfo:
    """The marker of checkpoint folder ``path``; ``CheckpointCorrupt`` if it is not one."""
    p = Path(path)
    f = p / META_FILE
    if not f.is_file():
        if (p / ".metadata").is_file() or any(p.glob("*.distcp")):
            raise CheckpointCorrupt(
                f"{p} has checkpoint files but no {META_FILE}: its save never finished (or it "
                "was written by a dynpipe before 0.2 without file digests); resume from a "
                "complete checkpoint, e.g. the folder given to --save-dir"
            )
        raise CheckpointCorrupt(
            f"no checkpoint at {p} (a checkpoint folder holds {META_FILE}); pass the folder "
            "given to --save-dir or one of its ckpt-* subfolders"
        )
    try:
        marker = json.loads(f.read_bytes().decode())
        if not isinstance(marker, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorrupt(
            f"{f} is not a readable checkpoint marker ({type(exc).__name__}: "
            f"{str(exc)[:80]}); resume from another checkpoint of that folder"
        ) from None
    if marker.get("format") != FORMAT or marker.get("format_version") != FORMAT_VERSION:
        raise CheckpointCorrupt(
            f"{f} is not a dynpipe checkpoint marker of format {FORMAT_VERSION} (got "
            f"{marker.get('format')!r} {marker.get('format_version')!r}); it was written by "
            "another program or an older dynpipe and cannot be verified"
        )
    try:
        info = CheckpointInfo(
            path=p,
            step=int(marker["step"]),
            seq=int(marker["seq"]),
            save_id=str(marker["save_id"]),
            run_id=marker.get("run_id"),
            marker=marker,
        )
        files = marker["files"]
        if not isinstance(files, dict) or ".metadata" not in files or "meta" not in marker:
            raise KeyError("files")
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointCorrupt(
            f"{f} lacks field {exc}; the marker was altered: resume from another checkpoint"
        ) from None
    m = _NAME.match(p.name)
    if m and m.group(2) != info.save_id:
        raise CheckpointCorrupt(
            f"{p} is named for save {m.group(2)} but its marker is for save {info.save_id}: "
            "files of two saves are mixed; resume from another checkpoint"
        )
    return info


def list_checkpoints(directory: str | Path) -> tuple[list[CheckpointInfo], list[tuple[Path, str]]]:
    """Published checkpoints in ``directory``, oldest first, and the folders skipped (why)."""
    d = Path(directory)
    done: list[CheckpointInfo] = []
    skipped: list[tuple[Path, str]] = []
    if not d.is_dir():
        return done, skipped
    for c in sorted(d.iterdir()):
        if not c.is_dir() or not _NAME.match(c.name):
            continue
        try:
            done.append(read_marker(c))
        except CheckpointCorrupt as exc:
            skipped.append((c, str(exc)))
    done.sort(key=lambda i: (i.seq, i.step))
    return done, skipped


def newest_checkpoint(directory: str | Path, *, run_id: str | None = None) -> CheckpointInfo | None:
    """The most recently published checkpoint in ``directory`` (of ``run_id`` if given)."""
    done, _ = list_checkpoints(directory)
    if run_id is not None:
        done = [i for i in done if i.run_id == run_id]
    return done[-1] if done else None


def find_checkpoint(path: str | Path) -> Path:
    """``path`` itself if it is a checkpoint, else the newest published one inside it."""
    p = Path(path)
    if (
        (p / META_FILE).is_file()
        or not p.is_dir()
        or _NAME.match(p.name)
        or (p / ".metadata").is_file()
    ):
        return read_marker(p).path
    newest = newest_checkpoint(p)
    if newest is None:
        _, skipped = list_checkpoints(p)
        why = (
            f" ({len(skipped)} unfinished or unreadable: {skipped[-1][0].name})" if skipped else ""
        )
        raise CheckpointCorrupt(
            f"no complete checkpoint in {p}{why}; pass the folder given to --save-dir, one of "
            "its ckpt-* subfolders, or --resume auto to start fresh when there is none"
        )
    return newest.path


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _verify_files(info: CheckpointInfo, names: Iterable[str], *, digest: bool = True) -> None:
    files = info.marker["files"]
    for name in sorted(set(names)):
        want = files.get(name)
        f = info.path / name
        if want is None:
            raise CheckpointCorrupt(
                f"{f} is not listed in {info.path.name}/{META_FILE}; the folder mixes files of "
                "other saves: resume from another checkpoint"
            )
        if not f.is_file():
            raise CheckpointCorrupt(
                f"{f} is missing (the checkpoint is incomplete); resume from another checkpoint"
            )
        size = f.stat().st_size
        if size != int(want["size"]):
            raise CheckpointCorrupt(
                f"{f} has {size} bytes but {want['size']} were saved (truncated or altered); "
                "resume from another checkpoint"
            )
        if digest and file_sha256(f) != want["sha256"]:
            raise CheckpointCorrupt(
                f"{f} does not match the SHA-256 recorded when it was saved (altered or "
                "corrupt); resume from another checkpoint"
            )


def check_checkpoint(
    path: str | Path, *, model_shapes: dict[str, tuple[int, ...]] | None = None
) -> CheckpointInfo:
    """What can be checked before any worker starts, cheaply: a readable marker, every file
    present with its saved size, the index ``.metadata`` intact and safe to read, and (given
    ``model_shapes``) every model tensor stored with the shape the model has. The digests
    of the data files are checked by each rank as it loads."""
    info = read_marker(find_checkpoint(path))
    _verify_files(info, info.marker["files"], digest=False)
    _verify_files(info, [".metadata"])
    if model_shapes is not None:
        stored = _SafeReader(str(info.path)).read_metadata().state_dict_metadata
        _check_model_keys(info.path, model_shapes, stored)
    return info


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` allowing only DCP's metadata classes and torch's
    dtype/size/layout values: a pickle that names anything else (``os.system``) fails."""

    _MODULES = (
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch.distributed.checkpoint.planner",
    )

    def find_class(self, module: str, name: str) -> Any:
        import importlib
        import pathlib

        if module in self._MODULES:
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        elif module == "torch":
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout)):
                return obj
            if isinstance(obj, torch.memory_format):
                return obj
        elif module == "torch.serialization" and name == "_get_layout":
            from torch.serialization import _get_layout

            return _get_layout
        elif module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "Path"):
            return getattr(pathlib, name)
        elif module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint index")


class _SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses the allow-listed unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = Path(self.path) / ".metadata"
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
            raise CheckpointCorrupt(
                f"{path} is not a plain DCP index ({str(exc)[:100]}); refusing to load it "
                "(a crafted index could run code)"
            ) from None
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _agree_error(error: str | None) -> str | None:
    """Every rank's verification verdict: the first error any rank found, or None."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return error
    verdicts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, error)
    return next((v for v in verdicts if v), None)


def load_checkpoint(
    path: str | Path,
    *,
    model_state: dict[str, torch.Tensor],
    held_params: set[str],
    rank: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load into ``model_state`` in place; return this rank's optimizer state and the meta.

    Collective when a process group exists. ``held_params`` names this stage's parameters;
    their optimizer entries are discovered from the checkpoint's index. Before anything is
    read, every rank checks the digests of the files it needs; if any rank finds a problem,
    every rank raises ``CheckpointCorrupt`` with that rank's message.
    """
    error: str | None = None
    optim: dict[str, torch.Tensor] = {}
    sd: dict[str, Any] = {}
    info: CheckpointInfo | None = None
    reader: _SafeReader | None = None
    try:
        info = read_marker(find_checkpoint(path))
        _verify_files(info, [".metadata"])
        reader = _SafeReader(str(info.path))
        index = reader.read_metadata()
        stored = index.state_dict_metadata
        _check_model_keys(info.path, {k: tuple(v.shape) for k, v in model_state.items()}, stored)
        for key, md in stored.items():
            if not key.startswith("optim."):
                continue
            name = key[len("optim.") :]
            if name.rpartition("/")[0] in held_params:
                optim[name] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        sd = {"model": model_state, "optim": optim}
        rng_key = f"rng.rank{rank}"
        if rng_key in stored:
            sd["rng"] = {f"rank{rank}": torch.empty(tuple(stored[rng_key].size), dtype=torch.uint8)}
        wanted = {f"model.{k}" for k in model_state} | {f"optim.{k}" for k in optim}
        if "rng" in sd:
            wanted.add(rng_key)
        needed = {si.relative_path for idx, si in index.storage_data.items() if idx.fqn in wanted}
        _verify_files(info, needed)
    except UserError as exc:
        error = str(exc)
    error = _agree_error(error)
    if error is not None:
        raise CheckpointCorrupt(error)
    assert info is not None and reader is not None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=ONE_PROCESS_WARNING)
        # One rank reads alone (no collective on a default group that may lack a CPU backend).
        one = not (dist.is_initialized() and dist.get_world_size() > 1)
        dcp.load(sd, storage_reader=reader, **dcp_kwargs(dcp.load, one))
    if "rng" in sd:
        torch.set_rng_state(sd["rng"][f"rank{rank}"])
    return {
        k: v.to(device) if k.rpartition("/")[2] != "step" else v for k, v in optim.items()
    }, info.meta


def _check_model_keys(ckpt: Path, shapes: dict[str, tuple[int, ...]], stored: dict) -> None:
    missing = [k for k in shapes if f"model.{k}" not in stored]
    if missing:
        raise UserError(
            f"checkpoint {ckpt} lacks {len(missing)} tensors this stage needs (e.g. "
            f"{missing[0]}); it was written for a different model or model config"
        )
    for k, shape in shapes.items():
        size = tuple(getattr(stored[f"model.{k}"], "size", ()))
        if size != tuple(shape):
            raise UserError(
                f"checkpoint {ckpt} holds {k} with shape {list(size)} but this model's is "
                f"{list(shape)}; resume with the model config the checkpoint was written with"
            )
