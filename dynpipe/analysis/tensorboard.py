"""Run-log records as TensorBoard scalars and text, live and from logs already written.

One mapping, ``entries``, turns each ``dynpipe.runtime.records`` record into TensorBoard
entries. Both paths use it, so a live run's event files and those converted from its JSONL
log hold the same scalars at the same steps:

- live: ``dynpipe train --tensorboard DIR`` attaches a ``TensorBoardSink`` to the run log
  on the rank that writes it, so every record the log gets goes to TensorBoard as it is
  written;
- offline: ``dynpipe figures --tensorboard DIR LOG...`` (``convert``) reads logs through
  ``read_log`` and writes the same entries.

Each entry carries the record's wall-clock ``time``, so TensorBoard's relative and wall-time
axes show when things happened, not when the file was converted. ``tensorboard`` is an
optional dependency (``pip install 'dynpipe[tb]'``); ``require_tensorboard`` says so in one
line before anything is launched.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynpipe.errors import UserError
from dynpipe.runtime.records import (
    Eval,
    Event,
    Record,
    Step,
    Telemetry,
    log_stem,
    read_log,
)

__all__ = ["Entry", "TensorBoardSink", "convert", "entries", "require_tensorboard"]

# Events whose numbers are worth a curve (name -> the keys drawn, under migration/).
_MOVE_EVENTS = ("repartition", "reshape", "reshare")
_MOVE_KEYS = ("pause_ms", "bytes", "decide_ms", "transfer_ms", "rebuild_ms")
# Events shown as text in the adaptation log, beside the decisions.
_TEXT_EVENTS = (
    "decision",
    "judged",
    "repartition",
    "reshape",
    "reshare",
    "stage_count",
    "release",
    "freeze",
    "freeze_capped",
    "autodp",
    "restart",
    "resumed",
    "recovered",
    "interference_start",
    "interference_stop",
    "checkpoint",
    "stopped",
)


@dataclass(frozen=True)
class Entry:
    """One TensorBoard entry: a scalar (``value``) or a text (``text``) at ``step``."""

    tag: str
    step: int
    time: float
    value: float | None = None
    text: str | None = None


def require_tensorboard() -> None:
    """Refuses, in one line, when the tensorboard package is missing."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as exc:
        raise UserError(
            f"--tensorboard needs the tensorboard package ({exc.name or exc} is missing); "
            "install it with `pip install 'dynpipe[tb]'` (or `pip install tensorboard`)"
        ) from exc


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _split(plan: Any) -> str:
    """A plan dict as layers per stage (``8|6``), or its repr when it is not one."""
    if isinstance(plan, dict) and isinstance(plan.get("stages"), list):
        return "|".join(str(s.get("stop", 0) - s.get("start", 0)) for s in plan["stages"])
    if isinstance(plan, list) and all(isinstance(b, list) and len(b) == 2 for b in plan):
        return "|".join(str(b[1] - b[0]) for b in plan)
    return str(plan)


def _event_text(ev: Event) -> str:
    f = ev.fields
    if ev.event == "decision":
        slow = ", ".join(f"{s:.2f}" for s in f.get("slowdown") or () if _num(s) is not None)
        move = "move" if f.get("repartition") else "hold"
        return (
            f"**{move}** ({f.get('mode')}): model {f.get('current_ms', 0):.1f} -> "
            f"{f.get('proposed_ms', 0):.1f} ms/step; device slowdowns [{slow}]; "
            f"{f.get('reason', '')}"
        )
    if ev.event in ("repartition", "reshape"):
        return (
            f"**{ev.event}** {_split(f.get('old_plan'))} -> {_split(f.get('new_plan'))}: "
            f"{int(f.get('bytes') or 0):,} bytes, pause {float(f.get('pause_ms') or 0):.1f} ms"
        )
    if ev.event == "judged":
        return (
            f"**judged** move of step {f.get('move_step')}: {f.get('verdict')} "
            f"(before {f.get('before_ms')} ms, after {f.get('after_ms')} ms)"
        )
    keys = ", ".join(f"{k}={v}" for k, v in f.items() if not isinstance(v, (dict, list)))
    return f"**{ev.event}** {keys}".rstrip()


def _step_entries(rec: Step) -> Iterator[tuple[str, float | None]]:
    yield "train/loss", rec.loss
    yield "train/lr", rec.lr
    yield "train/grad_norm", rec.grad_norm
    yield "perf/step_ms", rec.step_ms
    yield "perf/samples_per_s", rec.samples_per_s
    yield "perf/between_steps_ms", rec.between_ms
    for st in rec.stages:
        yield f"stage{st.stage}/compute_ms", st.fwd_ms + st.bwd_ms
        yield f"stage{st.stage}/fwd_ms", st.fwd_ms
        yield f"stage{st.stage}/bwd_ms", st.bwd_ms
        yield f"stage{st.stage}/wait_ms", st.wait_ms
        yield f"stage{st.stage}/update_ms", st.update_ms
        yield f"stage{st.stage}/layers", float(st.layers[1] - st.layers[0])
    for rep in rec.replicas:
        yield f"replica{rep.replica}/compute_ms", rep.compute_ms
        yield f"replica{rep.replica}/reduce_ms", rep.reduce_ms
        yield f"replica{rep.replica}/microbatches", float(rep.microbatches)


def entries(rec: Record) -> list[Entry]:
    """The TensorBoard entries of one run-log record (none for headers, layer times and
    records of types this version does not know)."""
    pairs: list[tuple[str, float | None]] = []
    texts: list[tuple[str, str]] = []
    step: int | None = None
    if isinstance(rec, Step):
        step = rec.step
        pairs = list(_step_entries(rec))
    elif isinstance(rec, Eval):
        step = rec.step
        pairs = [
            ("eval/loss", rec.loss),
            ("eval/accuracy", rec.accuracy),
            ("eval/perplexity", rec.perplexity),
        ]
    elif isinstance(rec, Telemetry):
        step = rec.step
        for rank, dev in enumerate(rec.devices):
            for key, value in sorted(dev.items()):
                pairs.append((f"device{rank}/{key.removeprefix('tel_')}", _num(value)))
    elif isinstance(rec, Event) and rec.step is not None:
        step = rec.step
        f = rec.fields
        if rec.event == "decision":
            for rank, s in enumerate(f.get("slowdown") or ()):
                pairs.append((f"device{rank}/slowdown", _num(s)))
            pairs.append(("adapt/model_current_ms", _num(f.get("current_ms"))))
            pairs.append(("adapt/model_proposed_ms", _num(f.get("proposed_ms"))))
            pairs.append(("adapt/moved", 1.0 if f.get("repartition") else 0.0))
        elif rec.event in _MOVE_EVENTS:
            for key in _MOVE_KEYS:
                pairs.append((f"migration/{key}", _num(f.get(key))))
        elif rec.event == "judged":
            pairs.append(("adapt/predicted_gain", _num(f.get("predicted_gain"))))
            pairs.append(("adapt/achieved_gain", _num(f.get("achieved_gain"))))
        if rec.event in _TEXT_EVENTS:
            texts.append(("adapt/events", _event_text(rec)))
    if step is None:
        return []
    out = [
        Entry(tag=tag, step=step, time=rec.time, value=float(v))
        for tag, v in pairs
        if v is not None
    ]
    out += [Entry(tag=tag, step=step, time=rec.time, text=text) for tag, text in texts]
    return out


class TensorBoardSink:
    """Writes run-log records to TensorBoard event files in ``logdir`` as they come.

    Attached to a ``RunLog`` (``RunLog(path, sinks=[...])``) it sees every record the log
    writes; ``write`` may also be called directly (``convert``).
    """

    def __init__(self, logdir: str | Path, *, flush_secs: int = 10) -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = Path(logdir)
        self._writer = SummaryWriter(log_dir=str(self.logdir), flush_secs=flush_secs)

    def write(self, rec: Record) -> None:
        for e in entries(rec):
            if e.text is not None:
                self._writer.add_text(e.tag, e.text, global_step=e.step, walltime=e.time)
            else:
                self._writer.add_scalar(e.tag, e.value, global_step=e.step, walltime=e.time)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def convert(logs: Iterable[str | Path], *, out: str | Path) -> list[Path]:
    """Writes each run log's entries under ``out/<log name>/``; returns those folders.

    Logs of one name in different folders get the folder's name too
    (``out/<folder>-<log name>``), so the runs stay apart in TensorBoard.
    """
    paths = [Path(p) for p in logs]
    stems = [log_stem(p) for p in paths]
    dirs = []
    for path, stem in zip(paths, stems, strict=True):
        name = stem if stems.count(stem) == 1 else f"{path.parent.name}-{stem}"
        logdir = Path(out) / name
        sink = TensorBoardSink(logdir)
        try:
            for rec in read_log(path):
                sink.write(rec)
        finally:
            sink.close()
        dirs.append(logdir)
    return dirs
