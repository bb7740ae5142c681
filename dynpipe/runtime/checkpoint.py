"""Checkpoints with ``torch.distributed.checkpoint``, keyed by stable layer names.

Every rank writes its own layers (``model.<layer>.<param>``) and their optimizer state
(``optim.<layer>.<param>/<key>``) into one checkpoint folder; nothing in a key depends on the
plan. A checkpoint written under one plan therefore loads under any other plan, any stage
count, or into a single process: each reader asks only for the keys of the layers it holds.

The folder is complete only once ``dynpipe.json`` (step, plan, config) exists; it is
written last, atomically, so an interrupted save is never resumed from.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dynpipe.errors import UserError

__all__ = ["META_FILE", "find_checkpoint", "load_checkpoint", "save_checkpoint"]

META_FILE = "dynpipe.json"


def save_checkpoint(
    path: str | Path,
    *,
    model_state: dict[str, torch.Tensor],
    optim_state: dict[str, torch.Tensor],
    meta: dict[str, Any],
    rank: int = 0,
) -> Path:
    """Collective when a process group exists: every rank calls it with its own state."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = {
        "model": {k: v.detach() for k, v in model_state.items()},
        "optim": {k: v.detach() for k, v in optim_state.items()},
        "rng": {f"rank{rank}": torch.get_rng_state()},
    }
    with warnings.catch_warnings():
        # Rewriting a folder (the restart baseline reuses one) is intended.
        warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint.*")
        dcp.save(sd, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        tmp = path / (META_FILE + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1, default=str) + "\n")
        os.replace(tmp, path / META_FILE)
    if dist.is_initialized():
        dist.barrier()
    return path


def find_checkpoint(path: str | Path) -> Path:
    """``path`` itself if it is a complete checkpoint, else its newest complete ``step_*``."""
    p = Path(path)
    if (p / META_FILE).is_file():
        return p
    if p.is_dir():
        done = sorted(c for c in p.glob("step_*") if (c / META_FILE).is_file())
        if done:
            return done[-1]
    raise UserError(
        f"no complete checkpoint at {p} (a checkpoint folder holds {META_FILE}); pass the "
        "folder given to --save-dir or one of its step_* subfolders"
    )


def load_checkpoint(
    path: str | Path,
    *,
    model_state: dict[str, torch.Tensor],
    held_params: set[str],
    rank: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load into ``model_state`` in place; return this rank's optimizer state and the meta.

    ``held_params`` names this stage's parameters; their optimizer entries are discovered
    from the checkpoint's metadata (whatever optimizer state was saved for them).
    """
    ckpt = find_checkpoint(path)
    meta = json.loads((ckpt / META_FILE).read_text())
    reader = dcp.FileSystemReader(str(ckpt))
    stored = reader.read_metadata().state_dict_metadata
    missing = [k for k in model_state if f"model.{k}" not in stored]
    if missing:
        raise UserError(
            f"checkpoint {ckpt} lacks {len(missing)} tensors this stage needs (e.g. "
            f"{missing[0]}); it was written for a different model or model config"
        )
    optim: dict[str, torch.Tensor] = {}
    for key, md in stored.items():
        if not key.startswith("optim."):
            continue
        name = key[len("optim.") :]
        pname = name.rpartition("/")[0]
        if pname in held_params:
            optim[name] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    rng_key = f"rng.rank{rank}"
    sd: dict[str, Any] = {"model": model_state, "optim": optim}
    if rng_key in stored:
        sd["rng"] = {f"rank{rank}": torch.empty(tuple(stored[rng_key].size), dtype=torch.uint8)}
    with warnings.catch_warnings():
        # Loading into one process is a supported use, not something to warn about.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
        dcp.load(sd, checkpoint_id=str(ckpt), no_dist=not dist.is_initialized())
    if "rng" in sd:
        torch.set_rng_state(sd["rng"][f"rank{rank}"])
    return {
        k: v.to(device) if k.rpartition("/")[2] != "step" else v for k, v in optim.items()
    }, meta
