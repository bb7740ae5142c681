"""The run-log writer: JSONL records of ``dynpipe.runtime.records``, one per line.

One file per run, written by a single rank (the last stage, which holds the loss). The
analysis package draws every figure from these files and nothing else, and reads them
through ``dynpipe.runtime.records.read_log``. Sinks (``TensorBoardSink``) see every record
as it is written, so a live view shows exactly what the log holds.
"""

from __future__ import annotations

import json
import platform
import socket
from pathlib import Path
from typing import Any, Protocol

import torch

from dynpipe.runtime.records import (
    SCHEMA_VERSION,
    Event,
    Header,
    Record,
    check_event,
    parse_record,
)

__all__ = ["RecordSink", "RunLog", "code_revision", "environment"]


class RecordSink(Protocol):
    """Anything that takes run-log records as they are written (``TensorBoardSink``)."""

    def write(self, rec: Record) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


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
        # CPU results depend on it in the last bit (``runtime.cli._pin_threads``).
        "torch_threads": torch.get_num_threads(),
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
    """Append-only JSONL writer of ``dynpipe.runtime.records`` records."""

    def __init__(
        self, path: str | Path, *, append: bool = False, sinks: tuple[RecordSink, ...] = ()
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a" if append else "w", buffering=1)
        self.sinks = tuple(sinks)

    def record(self, rec: Record) -> None:
        line = json.dumps(rec.to_dict(), default=_jsonable)
        self._fh.write(line + "\n")
        if self.sinks:
            # Sinks get the record as the log will read back (numbers rounded by JSON the
            # same way), so a live view equals one converted from the file afterwards.
            back = parse_record(json.loads(line))
            for sink in self.sinks:
                sink.write(back)

    def header(self, **fields: Any) -> None:
        """The launch's header, stamped with the schema version this dynpipe writes."""
        self.record(Header(schema=SCHEMA_VERSION, **fields))

    def event(self, name: str, **fields: Any) -> None:
        """An event of ``records.EVENTS`` (an unregistered name or a missing key is refused)."""
        check_event(name, fields)
        step = fields.pop("step", None)
        self.record(Event(event=name, step=step, fields=fields))

    def flush(self) -> None:
        self._fh.flush()
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
            for sink in self.sinks:
                sink.close()

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
