"""The run log's schema: typed records, the registry of event names, and the reader.

A run log is JSONL, one record per line, each with ``type`` and wall-clock ``time``:

- ``header``: one per process launch (config, plan, world size, versions, devices);
- ``step``: one per training step, with every stage's forward / backward / wait time;
- ``telemetry``: one per gather window, every rank's device telemetry means;
- ``eval``: one per evaluation on the held-out split (``--eval-every``);
- ``event``: something that happened at a step, named by one of ``EVENTS``.

Writers build these records (``RunLog.record``, ``RunLog.event``); every reader (the
analysis package, the benchmarks, the tests) gets them from ``read_log``, which loads every
log ever written, version 1 included (those without ``schema`` in their header).

A live run writes plain ``X.jsonl``; logs committed to the repository are stored
gzip-compressed as ``X.jsonl.gz`` (they are most of its bytes). Readers find and open either
through ``find_log``, ``glob_logs``, ``log_stem`` and ``open_text`` here, so no reader knows
which it got.

Adding a record type is one dataclass here: derive from ``Record``, decorate it with
``@record_type("name")``. Adding an event is one ``EventSpec`` line in ``EVENTS``. Bump
``SCHEMA_VERSION`` only when a reader of the previous version would misread a log (a field
renamed or its meaning changed): new record types, events and fields need no bump, since
readers keep what they do not know (``UnknownRecord``, ``Event.fields``, ``extra``).

This module imports no torch, so reading a log is cheap.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import time
import types
import typing
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar, TypeVar

from dynpipe.errors import UserError

__all__ = [
    "EVENTS",
    "LOG_SUFFIXES",
    "RECORD_TYPES",
    "SCHEMA_VERSION",
    "Eval",
    "Event",
    "EventSpec",
    "Header",
    "LayerTimes",
    "LogRecords",
    "Record",
    "ReplicaTiming",
    "StageTiming",
    "Step",
    "Telemetry",
    "UnknownRecord",
    "check_event",
    "find_log",
    "glob_logs",
    "log_stem",
    "open_text",
    "parse_record",
    "read_dicts",
    "read_log",
    "record_type",
]

# 1: headers carry no ``schema`` key (every log before the version was written).
# 2: headers carry ``schema``; records as documented here.
SCHEMA_VERSION = 2

R = TypeVar("R", bound="Record")


@dataclass(frozen=True, kw_only=True)
class Record:
    """A line of a run log. ``to_dict`` gives the JSON object, ``from_dict`` reads it back.

    Subclasses list their fields in the order they are written; keys of a line that no
    field names are kept in ``extra`` (written by a newer dynpipe), so a record read and
    written again is the line it was read from.
    """

    TYPE: ClassVar[str] = ""
    time: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.TYPE, "time": self.time}
        for f in dataclasses.fields(self):
            if f.name not in ("time", "extra"):
                value = getattr(self, f.name)
                # Fields only some runs fill (data parallelism) stay out of other runs' logs.
                if f.metadata.get("omit_empty") and not value:
                    continue
                out[f.name] = _plain(value)
        return {**out, **self.extra}

    @classmethod
    def from_dict(cls: type[R], d: Mapping[str, Any]) -> R:
        hints = _hints(cls)
        kwargs: dict[str, Any] = {}
        names = set()
        for f in dataclasses.fields(cls):
            names.add(f.name)
            if f.name == "extra" or f.name not in d:
                continue
            kwargs[f.name] = _typed(hints[f.name], d[f.name])
        extra = {k: v for k, v in d.items() if k not in names and k != "type"}
        return cls(**kwargs, extra=extra)


RECORD_TYPES: dict[str, type[Record]] = {}


def record_type(name: str) -> Callable[[type[R]], type[R]]:
    """Class decorator: registers a ``Record`` subclass as the reader of ``type == name``."""

    def register(cls: type[R]) -> type[R]:
        if name in RECORD_TYPES:
            raise ValueError(f"record type {name!r} is registered twice")
        cls.TYPE = name
        RECORD_TYPES[name] = cls
        return cls

    return register


@dataclass(frozen=True)
class StageTiming:
    """One stage's share of one step: summed over its microbatches, in milliseconds.

    layers: ``(start, stop)``, the range of layers the stage held during the step.
    wait_ms: time blocked on a neighbour (receives) rather than computing.
    update_ms: the optimizer's update of the stage's parameters after the step's last
        backward (None: not timed, or a log that predates it).
    """

    stage: int
    rank: int
    layers: tuple[int, int]
    fwd_ms: float
    bwd_ms: float
    wait_ms: float
    update_ms: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if out["update_ms"] is None:
            del out["update_ms"]  # as logs without it wrote the stage
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StageTiming:
        a, b = d["layers"]
        return cls(
            stage=int(d["stage"]),
            rank=int(d["rank"]),
            layers=(int(a), int(b)),
            fwd_ms=float(d["fwd_ms"]),
            bwd_ms=float(d["bwd_ms"]),
            wait_ms=float(d["wait_ms"]),
            update_ms=None if d.get("update_ms") is None else float(d["update_ms"]),
        )


@dataclass(frozen=True)
class ReplicaTiming:
    """One pipeline replica's share of one step (data x pipeline parallelism), in ms.

    microbatches: the microbatches it ran (its batch share; 0 for a replica whose share
        partial reduce dropped: it only takes part in the gradient reduce).
    dropped: its share was left out of the update (partial reduce).
    compute_ms: its busiest stage's forward and backward compute over the step: what
        bounds the replica's pipeline, and (unlike its stages' waits, which a stage's
        neighbour blocked in the all-reduce lengthens) free of waiting for other replicas.
    reduce_ms: its longest all-reduce tail: the time a stage waited, after its last
        gradient bucket, for the reduce across replicas (the slowest replica's lead).
    stages: its stages' timings (``rank``: the global rank).
    """

    replica: int
    microbatches: int
    compute_ms: float
    reduce_ms: float
    dropped: bool = False
    stages: tuple[StageTiming, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReplicaTiming:
        return cls(
            replica=int(d["replica"]),
            microbatches=int(d["microbatches"]),
            compute_ms=float(d["compute_ms"]),
            reduce_ms=float(d["reduce_ms"]),
            dropped=bool(d.get("dropped", False)),
            stages=tuple(StageTiming.from_dict(x) for x in d.get("stages", ())),
        )


@record_type("header")
@dataclass(frozen=True, kw_only=True)
class Header(Record):
    """Written by each process launch before its first step (a relaunch appends another).

    config: the ``TrainConfig`` as a dict; plan: the plan this launch starts under.
    env: host, library versions and device name; start_step: the first step it runs.
    schema: the log's ``SCHEMA_VERSION`` (1 for logs that predate the field); revision: the
    code that ran (``runlog.code_revision``; None where unknown or in older logs).
    """

    schema: int = 1
    revision: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    backend: str = ""
    env: dict[str, Any] = field(default_factory=dict)
    start_step: int = 0


@record_type("step")
@dataclass(frozen=True, kw_only=True)
class Step(Record):
    """One training step, written with its window (every window's steps share ``time``).

    wall: seconds from this launch's training loop start to this step's end; t_end: the
    step's end as epoch seconds, which a relaunch shares with the launch before it (None in
    older logs); step_ms: the step's duration on the writing rank (the job's step time: every
    rank's adaptation window carries it); between_ms: the longest time any rank spent between
    its previous step and this one (loading its batch, the adaptation loop's work between
    steps, a move's whole pause: what a move cost beyond its own timers shows here; None in
    older logs); stages: every stage's timing, in stage order (with replicas: replica 0's).
    replicas: with data parallelism, every replica's timing (absent otherwise).
    """

    step: int
    wall: float
    step_ms: float
    t_end: float | None = None
    between_ms: float | None = None
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    samples_per_s: float | None = None
    stages: tuple[StageTiming, ...] = ()
    replicas: tuple[ReplicaTiming, ...] = field(default=(), metadata={"omit_empty": True})


@record_type("telemetry")
@dataclass(frozen=True, kw_only=True)
class Telemetry(Record):
    """Every rank's device telemetry over the window ending after ``step``.

    devices: one dict per rank of the ``tel_*`` means (``dynpipe.devices.columns``); a
    reading the platform lacks is None.
    """

    step: int
    devices: tuple[dict[str, float | None], ...] = ()


@record_type("layer_times")
@dataclass(frozen=True, kw_only=True)
class LayerTimes(Record):
    """Every layer's time per microbatch on the window's sampled step (the last step before
    ``step + 1``), each from the stage that held it: the median over its microbatches (ms;
    None where a layer was not timed). stage_fwd_ms / stage_bwd_ms: every stage's own timer
    on that step, per microbatch (beyond its layers: the stage's overhead). On a GPU a
    layer's time is the longer of its device time and the host's time to issue it, and
    launch_fwd_ms / launch_bwd_ms hold the latter and device_fwd_ms / device_bwd_ms the
    former (absent on CPU, and in logs that predate them; ``runtime/timing.py``).
    With replicas the fields above are replica 0's, and ``replicas`` holds every replica's
    as a dict of the same keys (absent otherwise). ``probes``: one ``(rank, layer, fwd_ms,
    bwd_ms)`` per rank that probed its device on that step, idle or light (one pipeline;
    absent when none did)."""

    step: int
    fwd_ms: tuple[float | None, ...] = ()
    bwd_ms: tuple[float | None, ...] = ()
    stage_fwd_ms: tuple[float | None, ...] = ()
    stage_bwd_ms: tuple[float | None, ...] = ()
    launch_fwd_ms: tuple[float | None, ...] = field(default=(), metadata={"omit_empty": True})
    launch_bwd_ms: tuple[float | None, ...] = field(default=(), metadata={"omit_empty": True})
    device_fwd_ms: tuple[float | None, ...] = field(default=(), metadata={"omit_empty": True})
    device_bwd_ms: tuple[float | None, ...] = field(default=(), metadata={"omit_empty": True})
    replicas: tuple[dict[str, Any], ...] = field(default=(), metadata={"omit_empty": True})
    probes: tuple[tuple[float, ...], ...] = field(default=(), metadata={"omit_empty": True})


@record_type("eval")
@dataclass(frozen=True, kw_only=True)
class Eval(Record):
    """One forward-only pass over the held-out split, after ``step`` training steps (written
    just after it, so ``time`` is when it ended).

    loss: mean per counted target (per sample; per token for gpt/bert); accuracy: top-1 over
    the counted targets (None for float targets); perplexity: ``exp(loss)`` for token models
    (else None); batches / samples / targets: what was evaluated; eval_ms: its wall time.
    """

    step: int
    split: str = "test"
    loss: float | None = None
    accuracy: float | None = None
    perplexity: float | None = None
    batches: int = 0
    samples: int = 0
    targets: int = 0
    eval_ms: float | None = None


@dataclass(frozen=True)
class EventSpec:
    """An event name, what it means, and the keys every record of it carries.

    keys: what readers may rely on; a writer that leaves one out is refused
    (``check_event``). Logs written before a key was added may lack it.
    """

    name: str
    doc: str
    keys: tuple[str, ...] = ()


_INTERFERENCE = ("step", "kind", "intensity", "count", "factor", "stage", "rank", "emulated")

# Every event the runtime writes. A new one is one line here.
EVENTS: dict[str, EventSpec] = {
    spec.name: spec
    for spec in (
        EventSpec(
            "interference_start",
            "a scenario switched an interferer on (or began emulating) before `step` ran; "
            "`rank` is the device's rank, `stage` the stage it held at the start",
            _INTERFERENCE,
        ),
        EventSpec(
            "interference_stop",
            "a scenario switched that interferer off before `step` ran",
            _INTERFERENCE,
        ),
        EventSpec(
            "adapt_mode",
            "the adaptation policy asked for (`mode`), the one in use, and the link warm-up",
            ("mode",),
        ),
        EventSpec(
            "memory_plan",
            "at start-up (--recompute, or on a GPU): per rank its stage, the layers it "
            "recomputes, its predicted peak and its memory limit in GiB",
            ("stages",),
        ),
        EventSpec(
            "loss_scale_skip",
            "--fp16: an inf or NaN gradient on some rank skipped `step` on every rank; the "
            "loss scale is now `scale`",
            ("step", "scale"),
        ),
        EventSpec(
            "links",
            "the links' measured bandwidth (median over neighbouring ranks) and the message size",
            ("bandwidth_gbs", "message_bytes"),
        ),
        EventSpec(
            "calibrated",
            "(logs before per-layer timing) the clean per-stage costs were taken after `step`",
            ("step",),
        ),
        EventSpec(
            "refit",
            "(logs before per-layer timing) the clean costs of moved layers refitted",
            ("step",),
        ),
        EventSpec(
            "decision",
            "the policy's verdict on the window ending at `window_step`, taking effect at "
            "`step` (the policy reads a window while the next step runs): per-device "
            "slowdowns, the model's step time now and under the proposal, `bounds` if it "
            "moves, `decide_ms`: the policy's host time (overlapping that step's device "
            "work), `agree_ms`: the agreement between steps",
            ("step", "mode", "slowdown", "current_ms", "proposed_ms", "repartition", "reason"),
        ),
        EventSpec(
            "judged",
            "a move (its first step `move_step`) measured on the window before `step`: the "
            "median step before and after it and the `verdict` (faster, no better, slower, "
            "conditions changed)",
            ("step", "move_step", "before_ms", "after_ms", "verdict"),
        ),
        EventSpec(
            "repartition",
            "layers moved live before `step`: plans, bytes, and the pause by part "
            "(`pause_ms`: the slowest rank's; older logs: the writing rank's; `compile_ms`, "
            "in `rebuild_ms`: --compile's first compile of the rebuilt stage)",
            ("step", "old_plan", "new_plan", "bytes", "decide_ms", "transfer_ms", "rebuild_ms"),
        ),
        EventSpec(
            "reshare",
            "the batch shares between replicas changed before `step` (no layer moved); "
            "`partial` marks SD-Pipe's partial reduce, which leaves `dropped` replicas' "
            "shares out of the update and so changes what training computes",
            ("step", "old_plan", "new_plan", "shares", "dropped", "partial", "pause_ms"),
        ),
        EventSpec(
            "release",
            "a `dynpipe release` / `dynpipe reclaim` request seen at the monitor point "
            "before `step`: `ranks` newly released, `reclaimed` given back; the plan from "
            "`step` runs on `active` (or the request was `refused`)",
            ("step", "ranks", "reclaimed"),
        ),
        EventSpec(
            "weight_versions",
            "--schedule 2bw is on: this run CHANGES WHAT TRAINING COMPUTES (PipeDream-2BW): "
            "each stage keeps `versions` weight versions, every microbatch of a step runs "
            "on the version one update old and the step's gradients update the newest "
            "(`rule`); `flush`: the pipeline still drains between steps",
            ("step", "changes_training", "versions", "rule", "flush"),
        ),
        EventSpec(
            "freeze_rule",
            "--freeze is on: this run CHANGES WHAT TRAINING COMPUTES (converged leading "
            "layers stop learning); the rule's window (`every` steps), `threshold`, largest "
            "fraction (`alpha`), the windows its trends are fitted over (`patience` + 1) "
            "and the warm-up steps it does not count (`warmup`): once the training loss's "
            "trend falls slower than `threshold` times its fastest, leading layers whose "
            "gradient norm is flat are frozen",
            ("changes_training", "every", "threshold", "alpha"),
        ),
        EventSpec(
            "freeze",
            "from `step` layers [0, `frozen`) are frozen (no backward, no optimizer state); "
            "`layers` newly frozen, their gradient norms, the window losses the plateau "
            "was read on (`losses`, against the fastest fall `best_rate`), the plan that "
            "keeps them on the first stage and the ranks it leaves `idle`",
            ("step", "frozen", "layers", "changes_training", "plan"),
        ),
        EventSpec(
            "freeze_capped",
            "replicated: the rule asked to freeze [0, `wanted`) before `step` but every "
            "stage must keep a layer, so [0, `frozen`) stays frozen",
            ("step", "wanted", "frozen", "shape"),
        ),
        EventSpec(
            "autodp",
            "--autodp's check at the freeze check before `step`: the model's step time of "
            "the `current` [replicas, stages] and of the best candidate shape `proposed` "
            "(every candidate in `shapes`), the predicted pause, and whether to `take` it",
            ("step", "frozen", "current", "current_ms", "proposed", "take", "reason"),
        ),
        EventSpec(
            "reshape",
            "from `step` the run has `new_shape` [replicas, stages] (was `old_shape`): "
            "`copies` each layer a rank lacked from a rank holding it, `bytes` in all, and "
            "the pause by part (`pause_ms`: the slowest rank's)",
            (
                "step",
                "old_shape",
                "new_shape",
                "old_plan",
                "new_plan",
                "bytes",
                "transfer_ms",
                "rebuild_ms",
                "pause_ms",
            ),
        ),
        EventSpec(
            "stage_count",
            "from `step` the plan leaves other ranks idle: `stages` active stages (was "
            "`old_stages`) on ranks `active`; `idle` ranks hold no layer and take part in "
            "the run's collectives only",
            ("step", "stages", "old_stages", "active", "idle"),
        ),
        EventSpec(
            "light_probes",
            "from `step` the ranks of `ranks` (rank -> layer) hold too little work for their "
            "timers to read their devices and time that layer on sampled steps instead "
            "(none: empty)",
            ("step", "ranks"),
        ),
        EventSpec(
            "first_step",
            "the first step under a new plan beside the medians before and after it, and the "
            "job's time between it and the step before (the move's whole pause)",
            ("step", "first_step_ms", "before_ms", "after_ms"),
        ),
        EventSpec(
            "restart",
            "the restart baseline checkpointed before `step` to relaunch under `new_plan`",
            ("step", "new_plan", "decide_ms"),
        ),
        EventSpec(
            "resumed",
            "a relaunch resumed at `step`; `pause_ms` from the restart decision until then",
            ("step", "pause_ms"),
        ),
        EventSpec(
            "checkpoint",
            "a checkpoint of the state after `step - 1` published at `path` (older logs: "
            "written); newer ones carry its `save_id`, `bytes`, the training thread's "
            "`stall_ms` (of which `wait_ms` waiting for the previous save's write), `write_ms` until publication and the marker's `marker_sha256`",
            ("step", "path"),
        ),
        EventSpec(
            "checkpoint_skipped",
            "an automatic resume passed over the checkpoint at `path`: `reason` says what "
            "failed its verification",
            ("path", "reason"),
        ),
        EventSpec(
            "recovered",
            "a relaunch after a worker died (`attempt` of torchrun's agent) resumed at `step`: "
            "the run had reached `reached_step`, so `steps_lost` are run again (`lost_from`: "
            "the progress in the launcher's store, or the run log); `down_s` from the last "
            "step before the failure",
            ("step", "attempt", "steps_lost", "reached_step", "lost_from"),
        ),
        EventSpec(
            "stopped",
            "a signal (`signal`) stopped every rank before `step`; `checkpoint`: the final "
            "checkpoint written there, or null",
            ("step", "signal", "checkpoint"),
        ),
        EventSpec("end", "the run finished `step` steps under `plan`", ("step", "plan")),
    )
}


def check_event(name: str, fields: Mapping[str, Any]) -> None:
    """Refuses an event name not in ``EVENTS`` or one that lacks the keys its spec lists."""
    spec = EVENTS.get(name)
    if spec is None:
        raise ValueError(
            f"run-log event {name!r} is not registered; add an EventSpec for it to "
            "dynpipe.runtime.records.EVENTS"
        )
    missing = [k for k in spec.keys if k not in fields]
    if missing:
        raise ValueError(f"run-log event {name!r} lacks {missing}; its spec lists {spec.keys}")


@record_type("event")
@dataclass(frozen=True, kw_only=True)
class Event(Record):
    """Something that happened: ``event`` names it (``EVENTS``), ``step`` is the step it
    happened before (None for run-wide events), ``fields`` holds the rest of the record.

    ``event["bytes"]`` and ``event.get("bytes")`` read the fields.
    """

    event: str
    step: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.TYPE, "time": self.time, "event": self.event}
        if self.step is not None:
            out["step"] = self.step
        return {**out, **self.fields, **self.extra}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Event:
        rest = {k: v for k, v in d.items() if k not in ("type", "time", "event", "step")}
        step = d.get("step")
        return cls(
            time=float(d["time"]),
            event=str(d["event"]),
            step=None if step is None else int(step),
            fields=rest,
        )


@dataclass(frozen=True, kw_only=True)
class UnknownRecord(Record):
    """A record of a type this version does not know (written by a newer one), kept whole."""

    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.data)


def parse_record(d: Mapping[str, Any]) -> Record:
    """The typed record of one decoded log line."""
    cls = RECORD_TYPES.get(str(d.get("type")))
    if cls is None:
        return UnknownRecord(time=float(d.get("time", 0.0)), data=dict(d))
    return cls.from_dict(d)


T = TypeVar("T", bound=Record)


@dataclass(frozen=True)
class LogRecords:
    """Every record of one run log, in file order, with typed views."""

    path: Path
    records: tuple[Record, ...]

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def of_type(self, cls: type[T]) -> list[T]:
        return [r for r in self.records if isinstance(r, cls)]

    @property
    def headers(self) -> list[Header]:
        return self.of_type(Header)

    @property
    def steps(self) -> list[Step]:
        return self.of_type(Step)

    @property
    def telemetry(self) -> list[Telemetry]:
        return self.of_type(Telemetry)

    @property
    def layer_times(self) -> list[LayerTimes]:
        return self.of_type(LayerTimes)

    @property
    def evals(self) -> list[Eval]:
        return self.of_type(Eval)

    def events(self, *names: str) -> list[Event]:
        """Every event, or those named (each name must be in ``EVENTS``)."""
        unknown = [n for n in names if n not in EVENTS]
        if unknown:
            raise KeyError(f"unknown run-log events {unknown}; known: {', '.join(EVENTS)}")
        evs = self.of_type(Event)
        return [e for e in evs if e.event in names] if names else evs


# A run log as written (first: preferred where a log is present both ways), and as committed.
LOG_SUFFIXES = (".jsonl", ".jsonl.gz")


def log_stem(path: str | Path) -> str:
    """A log's file name without its log suffix: ``static`` for ``static.jsonl`` and for
    ``static.jsonl.gz`` (``Path.stem`` for any other file)."""
    path = Path(path)
    for suffix in sorted(LOG_SUFFIXES, key=len, reverse=True):
        if path.name.endswith(suffix) and len(path.name) > len(suffix):
            return path.name[: -len(suffix)]
    return path.stem


def open_text(path: str | Path) -> IO[str]:
    """A log (or any text file) open for reading lines, decompressed when its name ends in
    ``.gz``. Undecodable bytes become replacement characters: such a line is not JSON and is
    skipped like a torn one, so a binary file reads as a log without records."""
    path = Path(path)
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", errors="replace")
    return path.open(errors="replace")


def find_log(folder: str | Path, stem: str) -> Path | None:
    """The log named ``stem`` in ``folder``, plain or compressed, or None."""
    for suffix in LOG_SUFFIXES:
        path = Path(folder) / f"{stem}{suffix}"
        if path.is_file():
            return path
    return None


def glob_logs(root: str | Path, pattern: str = "**/*") -> list[Path]:
    """The logs below ``root`` whose names without their log suffix match ``pattern``
    (``Path.glob`` syntax: the default is every log below ``root``), plain or compressed,
    sorted; a log present both ways is listed once, as its plain file."""
    found: dict[tuple[Path, str], Path] = {}
    for suffix in LOG_SUFFIXES:
        for path in Path(root).glob(f"{pattern}{suffix}"):
            found.setdefault((path.parent, log_stem(path)), path)
    return sorted(found.values())


def read_log(path: str | Path) -> LogRecords:
    """Every record of a run log, typed. Lines that are not JSON (a torn last line left by
    a killed writer) are skipped; a log from a newer schema is refused. ``X.jsonl`` that is
    not there but committed as ``X.jsonl.gz`` reads that."""
    path = Path(path)
    if not path.is_file() and path.name.endswith(LOG_SUFFIXES[0]):
        path = find_log(path.parent, log_stem(path)) or path
    if not path.is_file():
        raise UserError(f"run log {path} does not exist; write one with `dynpipe train --log FILE`")
    try:
        with open_text(path) as fh:
            records = tuple(_parse_lines(fh, source=path))
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:  # not gzip, cut short, corrupt
        raise UserError(
            f"run log {path} cannot be decompressed ({exc}); compress it again from the "
            "plain log with `gzip -9 -n`"
        ) from exc
    return LogRecords(path=path, records=records)


def read_dicts(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a run log as the plain dict it is written as, read through
    ``read_log`` (so version checks hold): for scripts that index fields by name."""
    return [rec.to_dict() for rec in read_log(path)]


def _parse_lines(lines: Iterable[str], *, source: Path) -> Iterator[Record]:
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(d, dict):
            continue
        rec = parse_record(d)
        if isinstance(rec, Header) and rec.schema > SCHEMA_VERSION:
            raise UserError(
                f"{source} was written with run-log schema {rec.schema}, newer than this "
                f"dynpipe reads ({SCHEMA_VERSION}); upgrade dynpipe to read it"
            )
        yield rec


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _plain(value: Any) -> Any:
    """A field value as JSON-ready data (nested records as dicts, tuples as lists)."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _typed(hint: Any, value: Any) -> Any:
    """A JSON value as the field's declared type: tuples of records are rebuilt, numbers
    coerced; anything else (dicts, free-form payloads) is kept as read."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is tuple and args and isinstance(value, list):
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_typed(args[0], v) for v in value)
        return tuple(_typed(a, v) for a, v in zip(args, value, strict=True))
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _typed(inner[0], value) if len(inner) == 1 else value
    if isinstance(hint, type) and hasattr(hint, "from_dict") and isinstance(value, Mapping):
        return hint.from_dict(value)
    if hint is int and not isinstance(value, bool):
        return int(value)
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value
