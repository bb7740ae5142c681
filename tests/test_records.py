"""The run-log schema: every committed log loads typed and round-trips; writers may only
write registered events; readers refuse logs from a newer schema and keep what they do not
know."""

from __future__ import annotations

import ast
import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from dynpipe.errors import UserError
from dynpipe.runtime.records import (
    EVENTS,
    RECORD_TYPES,
    SCHEMA_VERSION,
    Event,
    Header,
    Record,
    StageTiming,
    Step,
    Telemetry,
    UnknownRecord,
    check_event,
    find_log,
    glob_logs,
    log_stem,
    open_text,
    parse_record,
    read_dicts,
    read_log,
    record_type,
)

ROOT = Path(__file__).parents[1]
COMMITTED = sorted([*glob_logs(ROOT / "analysis" / "logs"), *glob_logs(ROOT / "tests" / "data")])


def test_there_are_committed_logs_of_both_schema_generations_to_read() -> None:
    # Guards the parametrised test below against silently reading nothing.
    assert len(COMMITTED) >= 90, COMMITTED


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_committed_log_loads_typed_and_round_trips(path: Path) -> None:
    log = read_log(path)
    with open_text(path) as fh:
        lines = [json.loads(line) for line in fh if line.strip()]
    assert len(log) == len(lines) > 0
    assert log.headers and all(1 <= h.schema <= SCHEMA_VERSION for h in log.headers)
    assert log.steps and all(st.layers[0] < st.layers[1] for s in log.steps for st in s.stages)
    for rec, line in zip(log, lines, strict=True):
        assert not isinstance(rec, UnknownRecord), line["type"]
        if isinstance(rec, Event):
            assert rec.event in EVENTS, f"{path}: event {rec.event!r} is not in EVENTS"
        again = rec.to_dict()
        # Written again, a record is the line it was read from (old headers gain a version;
        # fields added since are written as unknown: None).
        assert {k: again[k] for k in line} == line
        added = set(again) - set(line)
        assert all(k == "schema" or again[k] is None for k in added), added
        assert parse_record(again) == rec


def test_writers_write_only_registered_events() -> None:
    # Every `.event("name", ...)` in the package names an event of the registry, so a
    # typo or a new event without its EventSpec fails here, not in a long run.
    written = {}
    for src in (ROOT / "dynpipe").rglob("*.py"):
        for node in ast.walk(ast.parse(src.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "event"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                written[node.args[0].value] = src.relative_to(ROOT)
    assert {"end", "repartition", "decision"} <= set(written)
    unknown = {name: str(where) for name, where in written.items() if name not in EVENTS}
    assert not unknown, unknown


def test_run_log_writes_records_that_read_back(tmp_path) -> None:
    from dynpipe.runtime.runlog import RunLog

    path = tmp_path / "log.jsonl"
    step = Step(
        step=3,
        wall=0.5,
        step_ms=12.5,
        loss=1.25,
        lr=0.1,
        grad_norm=None,
        samples_per_s=100.0,
        stages=(StageTiming(0, 0, (0, 4), 1.0, 2.0, 0.5), StageTiming(1, 1, (4, 9), 3.0, 4.0, 0.0)),
    )
    tel = Telemetry(step=3, devices=({"tel_util": 50.0, "tel_power_w": None},))
    with RunLog(path) as log:
        log.header(config={"steps": 4}, plan={"stages": []}, world_size=2, backend="gloo")
        log.record(step)
        log.record(tel)
        log.event("checkpoint", step=4, path=tmp_path / "ckpt")
        log.event("adapt_mode", mode="static", using="static")
    back = read_log(path)
    (header,) = back.headers
    assert header.schema == SCHEMA_VERSION and header.world_size == 2
    assert back.steps == [step] and back.telemetry == [tel]
    ckpt, mode = back.events()
    assert (ckpt.event, ckpt.step, ckpt["path"]) == ("checkpoint", 4, str(tmp_path / "ckpt"))
    assert mode.step is None and mode.get("using") == "static" and mode.get("nothing") is None
    assert back.events("checkpoint") == [ckpt]
    assert read_dicts(path)[1]["stages"][1]["layers"] == [4, 9]
    with pytest.raises(KeyError, match="unknown run-log events"):
        back.events("checkpointed")


def test_unregistered_events_and_missing_keys_are_refused(tmp_path) -> None:
    from dynpipe.runtime.runlog import RunLog

    with pytest.raises(ValueError, match="not registered"):
        check_event("repartitoin", {"step": 1})
    with RunLog(tmp_path / "log.jsonl") as log, pytest.raises(ValueError, match="lacks"):
        log.event("resumed", step=3)  # no pause_ms
    assert (tmp_path / "log.jsonl").read_text() == ""


def test_newer_schema_is_refused_and_torn_lines_are_skipped(tmp_path) -> None:
    path = tmp_path / "log.jsonl"
    head = Header(schema=SCHEMA_VERSION, config={}, plan={}).to_dict()
    end = Event(event="end", step=2, fields={"plan": {}}).to_dict()
    path.write_text(json.dumps(head) + "\n" + json.dumps(end) + '\n{"type": "step", "ti')
    assert [type(r) for r in read_log(path)] == [Header, Event]
    path.write_text(json.dumps({**head, "schema": SCHEMA_VERSION + 1}) + "\n")
    with pytest.raises(UserError, match=f"schema {SCHEMA_VERSION + 1}, newer"):
        read_log(path)
    with pytest.raises(UserError, match="does not exist"):
        read_log(tmp_path / "missing.jsonl")


def test_compressed_logs_read_as_the_plain_ones(tmp_path) -> None:
    # Committed logs are stored as X.jsonl.gz: every reader finds and reads them as X.jsonl.
    plain = ROOT / "tests" / "data" / "logs" / "static.jsonl"
    packed = tmp_path / "runs" / "static.jsonl.gz"
    packed.parent.mkdir()
    packed.write_bytes(gzip.compress(plain.read_bytes(), mtime=0))
    assert read_log(packed).records == read_log(plain).records
    assert read_dicts(packed) == read_dicts(plain)
    with open_text(packed) as a, open_text(plain) as b:
        assert a.read() == b.read()
    # The plain name reads the compressed file where only that is there.
    assert read_log(tmp_path / "runs" / "static.jsonl").path == packed
    assert log_stem(packed) == log_stem(plain) == "static" and log_stem("a/b.json") == "b"
    assert find_log(packed.parent, "static") == packed and find_log(tmp_path, "static") is None
    # A log present both ways is the plain one: a decompressed copy beside its archive.
    (tmp_path / "runs" / "static.jsonl").write_bytes(plain.read_bytes())
    (tmp_path / "runs" / "deep" / "x").mkdir(parents=True)
    deep = tmp_path / "runs" / "deep" / "x" / "measured.jsonl.gz"
    deep.write_bytes(packed.read_bytes())
    (tmp_path / "runs" / "notes.txt").write_text("not a log")
    assert find_log(packed.parent, "static") == tmp_path / "runs" / "static.jsonl"
    assert glob_logs(tmp_path) == [deep, tmp_path / "runs" / "static.jsonl"]
    assert glob_logs(tmp_path, "runs/*") == [tmp_path / "runs" / "static.jsonl"]
    assert glob_logs(tmp_path, "*/deep/**/*") == [deep]


def test_a_broken_compressed_log_is_refused_with_the_fix(tmp_path) -> None:
    good = gzip.compress((ROOT / "tests" / "data" / "logs" / "static.jsonl").read_bytes())
    for name, data in (("cut", good[: len(good) // 2]), ("notgz", b"plain text, not gzip\n")):
        path = tmp_path / f"{name}.jsonl.gz"
        path.write_bytes(data)
        with pytest.raises(UserError, match=r"cannot be decompressed.*gzip -9 -n"):
            read_log(path)


def test_records_of_unknown_types_and_fields_are_kept(tmp_path) -> None:
    later = {"type": "probe", "time": 1.0, "what": [1, 2]}
    rec = parse_record(later)
    assert isinstance(rec, UnknownRecord) and rec.to_dict() == later
    step = {**Step(step=1, wall=0.1, step_ms=2.0).to_dict(), "gpu_ms": 1.5}
    typed = parse_record(step)
    assert isinstance(typed, Step) and typed.extra == {"gpu_ms": 1.5}
    assert typed.to_dict() == step


def test_a_new_record_type_is_one_registered_dataclass(tmp_path) -> None:
    # What adding a record type takes: a Record subclass and its decorator; nothing else.
    @record_type("test_layer_times")
    @dataclass(frozen=True, kw_only=True)
    class LayerTimes(Record):
        step: int
        fwd_ms: tuple[float, ...] = ()

    try:
        from dynpipe.runtime.runlog import RunLog

        with RunLog(tmp_path / "log.jsonl") as log:
            log.record(LayerTimes(step=5, fwd_ms=(1.0, 2.5)))
        (rec,) = read_log(tmp_path / "log.jsonl")
        assert isinstance(rec, LayerTimes) and rec.fwd_ms == (1.0, 2.5) and rec.step == 5
        with pytest.raises(ValueError, match="twice"):
            record_type("test_layer_times")(LayerTimes)
    finally:
        del RECORD_TYPES["test_layer_times"]
