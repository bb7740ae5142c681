"""JSONL run logs: a header, one record per step, and event records.

One file per run, written by a single rank (the last stage, which holds the loss). The
analysis package draws every figure from these files and nothing else.
"""

from __future__ import annotations

import json
import platform
import socket
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["RunLog", "code_revision", "environment", "read_log"]


def code_revision() -> str | None:
    """The code a run ran: ``DYNPIPE_REVISION`` if set (a copy of the tree without its git
    history), else the git commit of the package's checkout (``+dirty`` with uncommitted
    changes), else None."""
    import os
    import subprocess

    if os.environ.get("DYNPIPE_REVISION"):
        return os.environ["DYNPIPE_REVISION"]
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def environment(device: torch.device) -> dict[str, Any]:
    """Library versions and device names for the header."""
    import numpy as np

    env: dict[str, Any] = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
    }
    from dynpipe import __version__

    env["dynpipe"] = __version__
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
        env["device_name"] = torch.cuda.get_device_name(device)
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        env["device_name"] = "cpu"
    return env


class RunLog:
    """Append-only JSONL writer; every record has ``type`` and wall-clock ``time``."""

    def __init__(self, path: str | Path, *, append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a" if append else "w", buffering=1)

    def write(self, record_type: str, **fields: Any) -> None:
        rec = {"type": record_type, "time": time.time(), **fields}
        self._fh.write(json.dumps(rec, default=_jsonable) + "\n")

    def header(self, **fields: Any) -> None:
        self.write("header", **fields)

    def event(self, name: str, **fields: Any) -> None:
        self.write("event", event=name, **fields)

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return repr(obj)


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """All records of a run log (skips a torn last line left by a killed writer, and lines
    that are not text: a binary file has no records, and says so where it is read)."""
    out = []
    with Path(path).open(errors="replace") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
