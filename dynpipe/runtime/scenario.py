"""Interference scenarios: which interferer starts and stops at which step, on whose device.

A scenario file (``recipes/scenarios/*.toml``)::

    name = "gemm-on-stage-1"
    [[events]]
    step = 30            # before this step runs
    action = "start"     # or "stop"
    kind = "gemm"        # an interferer kind (dynpipe.devices.interfere), or "emulate"
    intensity = 1.0      # duty cycle of a real interferer
    count = 1
    stage = 1            # the device of the rank holding this stage in the initial plan
    [[events]]
    step = 80
    action = "stop"
    stage = 1

With pipeline replicas (``dynpipe train --dp R``) ``replica = r`` (default 0) picks stage
``stage`` of replica ``r``; ``rank = n`` instead of ``stage`` names a rank's device outright
(rank ``n`` is GPU ``n`` of a one-node run), which stays the same device whatever the
dp x pp shape, so runs of different shapes can be slowed on the same GPU.

Real interferers are separate processes on the target rank's device (its GPU, or its CPU
cores), started idle before training and switched on and off at their steps, so an onset
costs no process start-up inside the run. ``emulate`` instead stretches the target stage's
compute by ``factor``; logs label it as emulation.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynpipe.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Scenario", "ScenarioEvent", "ScenarioRunner", "load_scenario"]


@dataclass(frozen=True)
class ScenarioEvent:
    step: int
    action: str
    stage: int
    kind: str = "emulate"
    intensity: float = 1.0
    count: int = 1
    factor: float = 3.0
    replica: int = 0
    rank: int | None = None  # a rank's device, in place of (replica, stage)

    @property
    def emulated(self) -> bool:
        return self.kind == "emulate"

    @property
    def target(self) -> tuple[int, int]:
        """What the event names: ``(replica, stage)``, or ``(-1, rank)``."""
        return (-1, self.rank) if self.rank is not None else (self.replica, self.stage)


@dataclass(frozen=True)
class Scenario:
    name: str
    events: tuple[ScenarioEvent, ...] = field(default_factory=tuple)

    def active_at(self, step: int) -> dict[tuple[int, int], ScenarioEvent]:
        """Interference running on each target's device just before ``step`` runs, by
        ``ScenarioEvent.target``."""
        on: dict[tuple[int, int], ScenarioEvent] = {}
        for ev in sorted(self.events, key=lambda e: e.step):
            if ev.step > step:
                break
            if ev.action == "start":
                on[ev.target] = ev
            else:
                on.pop(ev.target, None)
        return on


def load_scenario(
    path: str | Path, *, num_stages: int | None = None, dp: int = 1, device: str = "cpu"
) -> Scenario:
    """A scenario file, checked against the pipeline (``num_stages``, ``dp`` replicas) and
    the device type: emulated interference stretches layer times on the host clock, which
    on CUDA would only delay kernel launches, so it is refused there."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"scenario file {p} does not exist; see recipes/scenarios/ for examples")
    try:
        doc = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"scenario {p} is not valid TOML: {exc}") from None
    events = []
    from dynpipe.devices.interfere import KINDS

    raw_events = doc.get("events", [])
    if not isinstance(raw_events, list) or not all(isinstance(e, dict) for e in raw_events):
        raise UserError(f"scenario {p}: events must be [[events]] tables; see runtime/scenarios/")
    for i, raw in enumerate(raw_events):
        keys = {"step", "action", "stage", "kind", "intensity", "count", "factor", "replica"}
        unknown = set(raw) - keys - {"rank"}
        if unknown:
            raise UserError(f"scenario {p} event {i} has unknown keys {sorted(unknown)}")
        action = raw.get("action")
        if action not in ("start", "stop"):
            raise UserError(f"scenario {p} event {i}: action must be start or stop, got {action!r}")
        kind = raw.get("kind", "emulate")
        if kind != "emulate" and kind not in KINDS:
            raise UserError(
                f"scenario {p} event {i}: unknown kind {kind!r}; use emulate or one of "
                f"{', '.join(KINDS)}"
            )
        if "step" not in raw:
            raise UserError(f"scenario {p} event {i} needs step = N (>= 0)")
        step = _number(p, i, raw, "step", int, None)
        if step < 0:
            raise UserError(f"scenario {p} event {i} needs step = N (>= 0), got {step}")
        rank = _number(p, i, raw, "rank", int, None) if "rank" in raw else None
        world = None if num_stages is None else num_stages * dp
        if rank is not None and (rank < 0 or (world is not None and rank >= world)):
            raise UserError(
                f"scenario {p} event {i}: rank {rank} is not a rank of this {world}-rank "
                f"run; use 0–{(world or 1) - 1}"
            )
        if rank is not None and ("stage" in raw or "replica" in raw):
            raise UserError(
                f"scenario {p} event {i} names both a rank and a stage or replica; give one"
            )
        replica = _number(p, i, raw, "replica", int, 0)
        if replica < 0 or replica >= dp:
            raise UserError(
                f"scenario {p} event {i}: replica {replica} is not a replica of this run "
                f"({dp} replica{'s' if dp > 1 else ''}); use 0–{dp - 1}"
            )
        stage = _number(p, i, raw, "stage", int, -1 if rank is None else 0)
        if stage < 0 or (num_stages is not None and stage >= num_stages):
            raise UserError(
                f"scenario {p} event {i}: stage {stage} is not a stage of this "
                f"{num_stages}-stage pipeline; use 0–{(num_stages or 1) - 1}"
            )
        factor = _number(p, i, raw, "factor", float, 3.0)
        if kind == "emulate" and factor < 1:
            raise UserError(f"scenario {p} event {i}: emulate factor {factor} must be >= 1")
        if kind == "emulate" and action == "start" and device.startswith("cuda"):
            raise UserError(
                f'scenario {p} event {i}: kind = "emulate" is CPU only (it would only delay '
                "kernel launches on a GPU); on CUDA use a real interferer: "
                f"{', '.join(k for k in KINDS if k not in ('spin', 'membw'))}"
            )
        if kind != "emulate" and action == "start":
            from dynpipe.devices.interfere import CPU_KINDS, GPU_KINDS

            # Said before any worker starts (the interferer itself refuses it only once its
            # step comes, and its rank's failure then reaches the others as a lost peer).
            gpu = device.startswith("cuda")
            if kind not in (GPU_KINDS if gpu else CPU_KINDS):
                what, use = (
                    ("runs on CPU", f"on CUDA use one of {', '.join(GPU_KINDS)}")
                    if gpu
                    else ("needs a GPU", f"on CPU use emulate or one of {', '.join(CPU_KINDS)}")
                )
                raise UserError(f"scenario {p} event {i}: interferer kind {kind!r} {what}; {use}")
        events.append(
            ScenarioEvent(
                step=step,
                action=action,
                stage=stage,
                kind=kind,
                intensity=_number(p, i, raw, "intensity", float, 1.0),
                count=_number(p, i, raw, "count", int, 1),
                factor=factor,
                replica=replica,
                rank=rank,
            )
        )
    if not events:
        raise UserError(f"scenario {p} has no [[events]]; see recipes/scenarios/ for examples")
    running: set[tuple[int, int]] = set()
    for ev in sorted(events, key=lambda e: e.step):  # stable: a file's order within a step
        if ev.action == "start":
            running.add(ev.target)
        elif ev.target in running:
            running.discard(ev.target)
        else:
            # A stop with nothing to stop is a typo in the step or the target, and the
            # interference it was meant to end would run to the end of the run.
            what = f"rank {ev.rank}" if ev.rank is not None else f"stage {ev.stage}"
            if ev.rank is None and dp > 1:
                what += f" of replica {ev.replica}"
            raise UserError(
                f"scenario {p}: the stop at step {ev.step} ({what}) follows no start there; "
                "start it at an earlier step or remove the stop"
            )
    return Scenario(name=str(doc.get("name", p.stem)), events=tuple(events))


_EXAMPLE = {
    "step": 30,
    "stage": 1,
    "factor": 3.0,
    "intensity": 1.0,
    "count": 1,
    "replica": 1,
    "rank": 3,
}


def _number(path: Path, i: int, raw: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    """``raw[key]`` as an int or float (a TOML string such as "soon" is refused)."""
    value = raw.get(key, default)
    ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if not ok or isinstance(value, bool):
        what = "an integer" if kind is int else "a number"
        raise UserError(
            f"scenario {path} event {i}: {key} must be {what}, got {value!r}; write it "
            f"without quotes, e.g. {key} = {_EXAMPLE[key]}"
        )
    return kind(value)


class ScenarioRunner:
    """Applies a scenario on this rank: real interferers on its device, or emulation.

    ``target_ranks[s]`` is the rank whose device "stage s" names (fixed at the start: when
    layers move, the interference stays on the device, which is the point); with replicas it
    is the stage's place in its pipeline, and replica ``r``'s copy is on rank
    ``r * len(target_ranks) + target_ranks[s]``.
    """

    def __init__(
        self,
        scenario: Scenario,
        *,
        rank: int,
        target_ranks: list[int],
        device: str,
        timer: Any,
        timeout_s: float = 3600.0,
        dp: int = 1,
    ) -> None:
        self.scenario = scenario
        self.dp = dp
        self.rank = rank
        self.targets = target_ranks
        self.device = device
        self.timer = timer
        self.timeout_s = timeout_s
        self._procs: dict[tuple[str, float, int], Any] = {}

    def _rank(self, ev: ScenarioEvent) -> int:
        if ev.rank is not None:
            return ev.rank
        return ev.replica * len(self.targets) + self.targets[ev.stage]

    def _mine(self, ev: ScenarioEvent) -> bool:
        return self._rank(ev) == self.rank

    def prepare(self) -> None:
        """Start every real interferer this rank will need, idle (intensity 0), and wait."""
        from dynpipe.devices.interfere import start_interferer

        for ev in self.scenario.events:
            if ev.action != "start" or ev.emulated or not self._mine(ev):
                continue
            key = (ev.kind, ev.intensity, ev.count)
            if key in self._procs:
                continue
            kw: dict[str, Any] = {
                "kind": ev.kind,
                "intensity": 0.0,
                "count": ev.count,
                "device": self.device,
            }
            if self.device == "cpu" and hasattr(os, "sched_getaffinity"):
                kw["cores"] = tuple(sorted(os.sched_getaffinity(0)))
            self._procs[key] = start_interferer(timeout_s=self.timeout_s, wait=True, **kw)

    def apply(self, step: int) -> list[dict[str, Any]]:
        """Switch interference on/off for events at ``step``; returns event records (all ranks)."""
        records = []
        running = self.scenario.active_at(step - 1)
        for ev in self.scenario.events:
            if ev.step != step:
                continue
            if ev.action == "stop":
                if ev.target not in running:
                    continue  # nothing runs there: a stop without a start is a no-op
                on = running[ev.target]
                ev = ScenarioEvent(
                    step=ev.step,
                    action="stop",
                    stage=ev.stage,
                    kind=on.kind,
                    intensity=on.intensity,
                    count=on.count,
                    factor=on.factor,
                    replica=ev.replica,
                    rank=ev.rank,
                )
            rec = {
                "step": step,
                "kind": ev.kind,
                "intensity": ev.intensity,
                "count": ev.count,
                "factor": ev.factor if ev.emulated else None,
                "stage": self.targets.index(self._rank(ev) % len(self.targets)),
                "rank": self._rank(ev),
                "emulated": ev.emulated,
                "event": f"interference_{ev.action}",
            }
            if self.dp > 1:
                rec["replica"] = self._rank(ev) // len(self.targets)
            records.append(rec)
            if self._mine(ev):
                self._switch(ev, on=ev.action == "start")
        return records

    def resume_at(self, step: int) -> None:
        """After a relaunch: turn on what the scenario has running at ``step``."""
        for ev in self.scenario.active_at(step - 1).values():
            if self._mine(ev) and ev.step < step:
                self._switch(ev, on=True)

    def _switch(self, ev: ScenarioEvent, *, on: bool) -> None:
        if ev.emulated:
            self.timer.dilation = ev.factor if on else 1.0
            return
        for (kind, intensity, _count), proc in self._procs.items():
            if kind == ev.kind and (not on or intensity == ev.intensity):
                proc.set_intensity(ev.intensity if on else 0.0)

    def close(self) -> None:
        for proc in self._procs.values():
            proc.stop()
        self._procs.clear()
        self.timer.dilation = 1.0
