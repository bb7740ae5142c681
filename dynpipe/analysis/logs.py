"""Run logs as tidy pandas frames: one ``Run`` per JSONL file.

A run log (records of ``dynpipe.runtime.records``) holds a header per process launch, step
records and events. ``load_run`` reads one file through ``records.read_log`` into a ``Run``: per-step and per-stage frames, the events,
the interference windows and the phase of every step. Nothing is edited: every number in a
frame is a number of the file, or arithmetic on them that the column docs below spell out.

Step records are written in windows (one gather per window), so all steps of a window carry
the same ``time``: the moment the window was written, just after its last step ended. The end
time of every other step of the window is that time minus the ``step_ms`` of the steps after
it. Pauses between windows (a repartition, a relaunch) stay where they happened, because a
window is always written before the pause begins.
"""

from __future__ import annotations

import glob
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from dynpipe.analysis.phases import Window, assign_phases, interference_windows
from dynpipe.errors import UserError
from dynpipe.runtime.records import (
    EVENTS,
    LOG_SUFFIXES,
    Eval,
    Event,
    Header,
    Step,
    glob_logs,
    log_stem,
    read_log,
)

__all__ = [
    "Run",
    "expand_log_paths",
    "group_experiments",
    "load_run",
    "load_runs",
    "stages_frame",
    "steps_frame",
]


@dataclass
class Run:
    """One run log, read.

    name: unique label of this run among those loaded together (figure legends).
    system: the label given by the user, else the adapt mode (``static``, ``measured``,
        ``adaptive``, ``restart``); runs with the same system share a colour.
    steps: one row per step (a step redone after a relaunch keeps its last attempt):
        ``step, segment`` (index of the process launch), ``t_end`` (unix s),
        ``elapsed_s`` (since the first header), ``step_ms, loss, lr, samples_per_s,
        phase, condition``.
    stages: one row per (step, stage): ``step, stage, rank, start, stop, fwd_ms, bwd_ms,
        wait_ms, busy`` (= (fwd + bwd) / step_ms of that step).
    events: one row per event record: ``event, step, time, elapsed_s, segment, record``
        (the ``records.Event``).
    evals: one row per evaluation on the held-out split (``--eval-every``): ``step`` (steps
        trained), ``segment, time, elapsed_s`` (when the record was written, right after
        the evaluation), ``loss, accuracy, perplexity, samples, batches, eval_ms``; empty
        for a run that never evaluated.
    headers: the header of every process launch, in order.
    windows: interference windows, in onset order.
    """

    name: str
    system: str
    mode: str
    path: Path
    model: str
    device: str
    world_size: int
    batch_size: int
    microbatches: int
    schedule: str
    headers: list[Header]
    steps: pd.DataFrame = field(repr=False)
    stages: pd.DataFrame = field(repr=False)
    events: pd.DataFrame = field(repr=False)
    evals: pd.DataFrame = field(default_factory=lambda: _evals_frame([], [], 0.0), repr=False)
    windows: list[Window] = field(default_factory=list)
    t0: float = 0.0
    redone_steps: int = 0

    @property
    def condition(self) -> str:
        """The interference this run saw, in onset order, or ``no interference``."""
        labels = list(dict.fromkeys(w.label for w in self.windows))
        return " then ".join(labels) if labels else "no interference"

    @property
    def num_stages(self) -> int:
        return len(self.headers[0].plan["stages"])

    def events_of(self, name: str) -> list[Event]:
        """The records of every ``name`` event (one of ``records.EVENTS``), in file order."""
        if name not in EVENTS:
            raise KeyError(f"unknown run-log event {name!r}; known: {', '.join(EVENTS)}")
        if self.events.empty:
            return []
        return list(self.events.loc[self.events["event"] == name, "record"])

    def __repr__(self) -> str:
        return (
            f"Run({self.name!r} {self.model} on {self.device}, {len(self.steps)} steps, "
            f"{self.condition}, {len(self.events_of('repartition'))} repartitions)"
        )


def expand_log_paths(items: Iterable[str | Path]) -> list[Path]:
    """Files, folders (every ``*.jsonl`` or ``*.jsonl.gz`` below) and glob patterns, in the
    order given. A pattern (or file name) ending in ``.jsonl`` also matches the compressed
    logs of those names (how logs are committed)."""
    out: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = glob_logs(p)
        elif p.is_file():
            found = [p]
        else:
            plain = {Path(g) for g in glob.glob(str(item), recursive=True)}
            packed: set[Path] = set()
            if str(item).endswith(LOG_SUFFIXES[0]):
                packed = {Path(g) for g in glob.glob(f"{item}.gz", recursive=True)}
            found = sorted(plain | {f for f in packed if f.with_suffix("") not in plain})
        if not found:
            raise UserError(
                f"no run log at {item}; give JSONL files written by `dynpipe train --log FILE` "
                "or a folder holding them"
            )
        out.extend(f for f in found if f not in out)
    return out


def group_experiments(root: str | Path) -> dict[str, list[Path]]:
    """Experiments under ``root``, each a list of run logs (one per system).

    Every folder holding ``*.jsonl`` (or ``*.jsonl.gz``) logs is an experiment, named by its
    path below ``root`` (``root``'s own name for logs lying directly in it). A folder of logs
    named ``<experiment>-<system>.jsonl`` with several experiment prefixes (what
    ``bench/gpu_adapt.sh`` writes) is split by prefix.
    """
    root = Path(root)
    found = glob_logs(root) if root.is_dir() else []
    if not found:
        raise UserError(
            f"no run logs under {root}; put each experiment's logs in {root}/<experiment>/"
            "<system>.jsonl (written by `dynpipe train --log FILE`)"
        )
    folders: dict[Path, list[Path]] = {}
    for f in found:
        folders.setdefault(f.parent, []).append(f)
    out: dict[str, list[Path]] = {}
    for folder, files in folders.items():
        rel = folder.relative_to(root).as_posix()
        base = root.name if rel == "." else rel
        prefixes = {log_stem(f).rpartition("-")[0] for f in files}
        if "" in prefixes or len(prefixes) < 2:
            out[base] = files
            continue
        for f in files:
            prefix = log_stem(f).rpartition("-")[0]
            out.setdefault(prefix if rel == "." else f"{rel}/{prefix}", []).append(f)
    return out


_EVAL_COLUMNS = ("loss", "accuracy", "perplexity", "samples", "batches", "eval_ms")


def _evals_frame(records: list[Eval], segments: list[int], t0: float) -> pd.DataFrame:
    """Eval records as a frame; a relaunch that evaluated a step again keeps its last one."""
    frame = pd.DataFrame(
        {
            "step": pd.Series([r.step for r in records], dtype="int64"),
            "segment": pd.Series(segments, dtype="int64"),
            "time": pd.Series([r.time for r in records], dtype="float64"),
            **{
                c: pd.Series(
                    [np.nan if getattr(r, c) is None else float(getattr(r, c)) for r in records],
                    dtype="float64",
                )
                for c in _EVAL_COLUMNS
            },
        }
    )
    frame["elapsed_s"] = frame["time"] - t0
    frame = frame.drop_duplicates("step", keep="last").sort_values("step", kind="stable")
    return frame.reset_index(drop=True)


def _mode(header: Header) -> str:
    adapt = header.config.get("adapt") or {}
    return str(adapt.get("mode", "static")) if isinstance(adapt, Mapping) else "static"


def _end_times(records: list[Step], segments: list[int]) -> np.ndarray:
    """End time of each step: its window's write time minus the later steps of the window.

    A window's records are written back to back (microseconds apart); the next window's
    first record comes at least one full step later. So record ``i + 1`` opens a new window
    when it was written more than half its own step time after record ``i``.
    """
    t = np.array([r.time for r in records], dtype=np.float64)
    ms = np.array([r.step_ms for r in records], dtype=np.float64)
    n = len(records)
    new = np.ones(n, dtype=bool)
    new[1:] = (t[1:] - t[:-1] > 0.5 * ms[1:] / 1e3) | (np.diff(segments) != 0)
    window = np.cumsum(new) - 1
    out = np.empty(n)
    for w in np.unique(window):
        idx = np.flatnonzero(window == w)
        # The first record is written right after the window's last step ended.
        after = np.concatenate([np.cumsum(ms[idx][::-1])[::-1][1:], [0.0]])
        out[idx] = t[idx[0]] - after / 1e3
    return out


def load_run(path: str | Path, *, label: str | None = None) -> Run:
    """Read one run log (every process launch appended to it) into a ``Run``."""
    path = Path(path)
    headers: list[Header] = []
    step_recs: list[Step] = []
    ev_recs: list[Event] = []
    segs: list[int] = []
    ev_segs: list[int] = []
    eval_recs: list[Eval] = []
    eval_segs: list[int] = []
    for rec in read_log(path):
        if isinstance(rec, Header):
            headers.append(rec)
        elif not headers:
            continue  # records before any header belong to no launch we can describe
        elif isinstance(rec, Step):
            step_recs.append(rec)
            segs.append(len(headers) - 1)
        elif isinstance(rec, Event):
            ev_recs.append(rec)
            ev_segs.append(len(headers) - 1)
        elif isinstance(rec, Eval):
            eval_recs.append(rec)
            eval_segs.append(len(headers) - 1)
    if not headers:
        raise UserError(
            f"{path} has no header record; is it a run log written by `dynpipe train --log`?"
        )
    if not step_recs:
        raise UserError(
            f"{path} has no step records; the run stopped before its first window was written "
            "(rerun with more steps or a smaller --log-every)"
        )
    h0 = headers[0]
    cfg = h0.config
    t0 = h0.time
    steps = pd.DataFrame(
        {
            "step": [r.step for r in step_recs],
            "segment": segs,
            "t_end": _end_times(step_recs, segs),
            "step_ms": [r.step_ms for r in step_recs],
            "loss": [np.nan if r.loss is None else r.loss for r in step_recs],
            "lr": [np.nan if r.lr is None else r.lr for r in step_recs],
            "samples_per_s": [r.samples_per_s or np.nan for r in step_recs],
        }
    )
    steps["elapsed_s"] = steps["t_end"] - t0
    stage_rows = [
        {
            "step": r.step,
            "segment": seg,
            "stage": st.stage,
            "rank": st.rank,
            "start": st.layers[0],
            "stop": st.layers[1],
            "fwd_ms": st.fwd_ms,
            "bwd_ms": st.bwd_ms,
            "wait_ms": st.wait_ms,
            "step_ms": r.step_ms,
        }
        for r, seg in zip(step_recs, segs, strict=True)
        for st in r.stages
    ]
    stages = pd.DataFrame(stage_rows)
    # A relaunch may redo steps a killed process had already logged: keep the last attempt.
    n_all = len(steps)
    steps = steps.drop_duplicates("step", keep="last").sort_values("step", kind="stable")
    steps = steps.reset_index(drop=True)
    if not stages.empty:
        stages = stages.drop_duplicates(["step", "stage"], keep="last")
        stages = stages.sort_values(["step", "stage"], kind="stable").reset_index(drop=True)
        stages["busy"] = (stages["fwd_ms"] + stages["bwd_ms"]) / stages["step_ms"]
    events = pd.DataFrame(
        {
            "event": [r.event for r in ev_recs],
            "step": [r.step for r in ev_recs],
            "time": [r.time for r in ev_recs],
            "segment": ev_segs,
            "record": ev_recs,
        }
    )
    events["elapsed_s"] = events["time"] - t0
    windows = interference_windows(ev_recs, last_step=int(steps["step"].max()), t0=t0)
    steps["phase"], steps["condition"] = assign_phases(steps["step"].to_numpy(), windows)
    mode = _mode(h0)
    return Run(
        name=label or mode,
        system=label or mode,
        mode=mode,
        path=path,
        model=str(cfg.get("model") or h0.plan.get("model")),
        device=str(h0.env.get("device_name", "?")),
        world_size=h0.world_size,
        batch_size=int(cfg.get("batch_size", 0)),
        microbatches=int(h0.plan.get("microbatches", cfg.get("microbatches", 1))),
        schedule=str(h0.plan.get("schedule", cfg.get("schedule", "?"))),
        headers=headers,
        steps=steps,
        stages=stages,
        events=events,
        evals=_evals_frame(eval_recs, eval_segs, t0),
        windows=windows,
        t0=t0,
        redone_steps=n_all - len(steps),
    )


def load_runs(
    paths: Iterable[str | Path] = (), *, labels: Mapping[str, str | Path] | None = None
) -> list[Run]:
    """Load logs; ``labels`` maps a system name to a log (loaded too if not in ``paths``).

    A run's system is its label, else its adapt mode. Two unlabelled runs of one mode, model,
    interference and device count are different systems (a static run of another plan,
    say; runs on other device counts are the same system at another scale): each is
    named after what its file name adds to the others' (``static`` and ``static_tuned`` for
    ``…-static.jsonl`` and ``…-static_tuned.jsonl``). Run names are then made unique by
    folder or file name, so runs of one system under different interference stay apart.
    """
    by_path: dict[Path, str | None] = {p.resolve(): None for p in expand_log_paths(paths)}
    for name, log in (labels or {}).items():
        for p in expand_log_paths([log]):
            by_path[p.resolve()] = name
    runs = [load_run(p, label=lab) for p, lab in by_path.items()]
    groups: dict[tuple[str, str, str, int], list[Run]] = {}
    for run, lab in zip(runs, by_path.values(), strict=True):
        if lab is None:
            key = (run.system, run.model, run.condition, run.world_size)
            groups.setdefault(key, []).append(run)
    for (mode, _, _, _), group in groups.items():
        if len(group) < 2:
            continue
        common = _common_prefix([log_stem(r.path) for r in group])
        for r in group:
            rest = log_stem(r.path)[len(common) :]
            if rest and rest[0] in "_-.":
                r.system = r.name = f"{mode}{rest}"
            elif rest:
                r.system = r.name = f"{mode} ({log_stem(r.path)})"
        if len({r.system for r in group}) < len(group):
            for r in group:
                r.system = r.name = f"{r.system} ({r.path.parent.name})"
    _unique_names(runs)
    return runs


def _common_prefix(words: list[str]) -> str:
    # The lexicographically first and last words differ where any two differ first.
    lo, hi = min(words), max(words)
    n = 0
    while n < len(lo) and lo[n] == hi[n]:
        n += 1
    return lo[:n]


def _unique_names(runs: list[Run]) -> None:
    """Runs sharing a name get their file's name added, or their folder's if the files are
    named alike (one log per experiment folder)."""
    by_name: dict[str, list[Run]] = {}
    for run in runs:
        by_name.setdefault(run.name, []).append(run)
    taken = {name for name, group in by_name.items() if len(group) == 1}
    for name, group in by_name.items():
        if len(group) == 1:
            continue
        stems_differ = len({log_stem(r.path) for r in group}) == len(group)
        for k, run in enumerate(group):
            tag = log_stem(run.path) if stems_differ else run.path.parent.name
            cand = f"{name} ({tag})"
            run.name = cand if cand not in taken else f"{name} #{k + 1}"
            taken.add(run.name)


def steps_frame(runs: Iterable[Run]) -> pd.DataFrame:
    """Every run's steps in one frame, with ``run``, ``system``, ``model`` and ``device``."""
    parts = [
        r.steps.assign(run=r.name, system=r.system, model=r.model, device=r.device) for r in runs
    ]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def stages_frame(runs: Iterable[Run]) -> pd.DataFrame:
    """Every run's per-stage timings in one frame, with ``run`` and ``system``."""
    parts = [r.stages.assign(run=r.name, system=r.system) for r in runs if not r.stages.empty]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
