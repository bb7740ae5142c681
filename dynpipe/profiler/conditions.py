"""Interference conditions and the sweep files that list them.

A condition is the set of interferers running beside the measured layer: none, one kind at
one intensity and count (``gemm@0.5x2``), or a mix (``gemm@0.5x1+copy@0.5x1``). A sweep file
(TOML) lists conditions as grids and sets how layers are timed::

    [sweep]
    name = "cpu"
    warmup = 2          # untimed iterations per (layer, phase)
    repeats = 5         # timing samples per (layer, phase)
    sample_ms = 30      # minimum length of one sample; >= period_ms
    period_ms = 25      # interferer duty-cycle period
    settle_s = 0.3      # wait after the interferers are ready, before timing
    baseline_every = 4  # time ``none`` again after every 4 conditions (0: only first)
    recheck_baseline = true   # and once more at the end

    [defaults]          # fields for every interferer; [defaults.<kind>] for one kind
    [defaults.train]
    batch_size = 64

    [[conditions]]      # a grid: every intensity x every count
    kind = "spin"
    intensity = [0.25, 0.5, 1.0]
    count = [1, 2]
    cores = "same"      # CPU kinds: "same" as the profiler, "other" cores, "all", or [0, 1]

    [[conditions]]      # several kinds at once
    mix = [{kind = "spin", intensity = 0.5}, {kind = "membw", intensity = 0.5}]

The condition ``none`` (nothing beside the layer) is always measured first: it is every
row's ``time_alone_ms``.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from dynpipe.devices.interfere import CPU_KINDS, GPU_KINDS, KINDS, InterfererSpec
from dynpipe.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["NONE", "Condition", "Sweep", "load_sweep", "parse_condition"]

NONE = "none"
_SPEC_FIELDS = {f.name for f in fields(InterfererSpec)}
_SWEEP_KEYS = {
    "name",
    "description",
    "warmup",
    "repeats",
    "sample_ms",
    "period_ms",
    "settle_s",
    "max_iters",
    "recheck_baseline",
    "baseline_every",
}


@dataclass(frozen=True)
class Condition:
    """The interferers of one measurement; no specs means ``none``."""

    specs: tuple[InterfererSpec, ...] = ()
    home_cores: tuple[int, ...] | None = None  # the profiler's cores, to name placements

    @property
    def id(self) -> str:
        """``kind@intensity x count`` joined by ``+``; ``:cA-B`` marks interferers on cores
        other than the profiler's (``:call`` for unpinned)."""
        if not self.specs:
            return NONE
        parts = []
        for s in self.specs:
            cid = s.condition_id
            if s.device == "cpu" and s.cores != self.home_cores:
                cid += ":c" + ("-".join(map(str, s.cores)) if s.cores is not None else "all")
            parts.append(cid)
        return "+".join(parts)

    @property
    def interferer(self) -> str:
        """The kind, ``mix`` for several kinds, ``none`` for none."""
        kinds = {s.kind for s in self.specs}
        if not kinds:
            return NONE
        return kinds.pop() if len(kinds) == 1 else "mix"

    @property
    def n_jobs(self) -> int:
        return sum(int(s.count) for s in self.specs)

    @property
    def intensity(self) -> float:
        """Count-weighted mean duty cycle (0 for ``none``)."""
        n = self.n_jobs
        return sum(float(s.intensity) * s.count for s in self.specs) / n if n else 0.0

    def reusable_from(self, other: Condition) -> bool:
        """Same processes as ``other`` up to intensity: switch by ``set_intensity``."""
        if len(self.specs) != len(other.specs) or not self.specs:
            return False
        return all(
            replace(a, intensity=0.0) == replace(b, intensity=0.0)
            for a, b in zip(self.specs, other.specs, strict=True)
        )

    def __repr__(self) -> str:
        return f"Condition({self.id})"


@dataclass(frozen=True)
class Sweep:
    """A parsed sweep file: timing settings and conditions (``none`` first).

    ``baseline_every`` re-times ``none`` after every that many interference conditions and
    ``recheck_baseline`` once more at the end; all baseline measurements are pooled into the
    ``none`` rows, and how far each moved is kept in the dataset's ``baseline_runs``.
    """

    name: str
    conditions: tuple[Condition, ...]
    warmup: int = 3
    repeats: int = 5
    sample_ms: float = 25.0
    period_ms: float = 25.0
    settle_s: float = 0.3
    max_iters: int = 2000
    recheck_baseline: bool = True
    baseline_every: int = 0
    path: str = ""
    sha1: str = ""

    def __post_init__(self) -> None:
        if self.sample_ms < self.period_ms:
            raise UserError(
                f"sweep {self.name!r}: sample_ms {self.sample_ms:g} is shorter than the "
                f"interferers' period_ms {self.period_ms:g}, so a sample could fall inside one "
                "burst or pause; set sample_ms >= period_ms"
            )


def _home(cores: Sequence[int] | None) -> tuple[int, ...] | None:
    return tuple(sorted(cores)) if cores else None


def _resolve_cores(
    value: Any, *, where: str, profiler_cores: Sequence[int] | None
) -> tuple[int, ...] | None:
    ncpu = os.cpu_count() or 1
    mine = tuple(sorted(profiler_cores)) if profiler_cores else None
    if value is None or value == "same":
        return mine
    if value == "all":
        return None
    if value == "other":
        if mine is None:
            raise UserError(
                f'{where}: cores = "other" needs the profiler pinned; pass --cores to dynpipe '
                "profile"
            )
        rest = tuple(c for c in range(ncpu) if c not in mine)
        if not rest:
            raise UserError(
                f'{where}: cores = "other" but the profiler already uses all {ncpu} cores; '
                "pin it to fewer with --cores"
            )
        return rest
    if isinstance(value, list) and all(isinstance(c, int) for c in value):
        return tuple(value)
    raise UserError(
        f'{where}: cores = {value!r}; use "same", "other", "all" or a list of core numbers'
    )


def _make_spec(
    raw: dict[str, Any],
    *,
    where: str,
    defaults: dict[str, Any],
    device: str,
    profiler_cores: Sequence[int] | None,
) -> InterfererSpec:
    kind = raw.get("kind")
    if kind not in KINDS:
        raise UserError(
            f"{where}: unknown interferer kind {kind!r}; valid kinds are {', '.join(KINDS)}"
        )
    merged = {
        **{k: v for k, v in defaults.items() if not isinstance(v, dict)},
        **defaults.get(kind, {}),
        **raw,
    }
    unknown = sorted(set(merged) - _SPEC_FIELDS)
    if unknown:
        raise UserError(
            f"{where}: unknown interferer field(s) {', '.join(unknown)}; valid fields are "
            f"{', '.join(sorted(_SPEC_FIELDS - {'device'}))}"
        )
    on_gpu = device.startswith("cuda")
    if on_gpu and kind in GPU_KINDS:
        merged["device"] = device
    elif kind in CPU_KINDS:
        merged["device"] = "cpu"
    else:
        raise UserError(
            f"{where}: interferer kind {kind!r} needs a GPU but this sweep runs on {device}; "
            f"on CPU use one of {', '.join(CPU_KINDS)}, or pass --device cuda:0"
        )
    if merged["device"] == "cpu" or "cores" in merged:
        merged["cores"] = _resolve_cores(
            merged.get("cores"), where=where, profiler_cores=profiler_cores
        )
    try:
        return InterfererSpec(**merged)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    except TypeError as exc:
        raise UserError(f"{where}: {exc}") from None


def _grid(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """Expand list-valued ``intensity`` / ``count`` into one dict per combination.

    Intensity varies fastest: consecutive conditions then differ only in duty cycle, and the
    sweep switches them on the running processes instead of restarting them.
    """
    keys = [k for k in ("count", "intensity") if isinstance(raw.get(k), list)]
    if not keys:
        return [raw]
    out = []
    for combo in itertools.product(*(raw[k] for k in keys)):
        out.append({**raw, **dict(zip(keys, combo, strict=True))})
    return out


def parse_condition(
    text: str, *, device: str = "cpu", cores: Sequence[int] | None = None, period_ms: float = 25.0
) -> Condition:
    """``"none"``, ``"spin@0.5x2"`` or ``"gemm@1x1+copy@0.5x1"`` -> ``Condition``."""
    text = text.strip()
    if text == NONE:
        return Condition()
    specs = []
    for part in text.split("+"):
        kind, _, rest = part.partition("@")
        inten, _, count = rest.partition("x")
        try:
            raw = {
                "kind": kind,
                "intensity": float(inten or 1.0),
                "count": int(count or 1),
                "period_ms": period_ms,
            }
        except ValueError:
            raise UserError(
                f"condition {text!r}: cannot read {part!r}; write KIND@INTENSITYxCOUNT, "
                "e.g. spin@0.5x1"
            ) from None
        specs.append(
            _make_spec(
                raw, where=f"condition {text!r}", defaults={}, device=device, profiler_cores=cores
            )
        )
    return Condition(tuple(specs), home_cores=_home(cores))


def load_sweep(
    path: str | os.PathLike[str],
    *,
    device: str = "cpu",
    cores: Sequence[int] | None = None,
) -> Sweep:
    """Parse and validate a sweep file for a profiler on ``device`` pinned to ``cores``."""
    path = Path(path)
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise UserError(
            f"sweep file {path} does not exist; see recipes/sweeps/ for cpu.toml, gpu.toml, "
            "smoke.toml"
        ) from None
    try:
        doc = tomllib.loads(blob.decode())
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"sweep file {path} is not valid TOML: {exc}") from None
    unknown_top = sorted(set(doc) - {"sweep", "defaults", "conditions"})
    if unknown_top:
        raise UserError(
            f"{path}: unknown section(s) {', '.join(unknown_top)}; use [sweep], [defaults] and "
            "[[conditions]]"
        )
    head = dict(doc.get("sweep", {}))
    bad = sorted(set(head) - _SWEEP_KEYS)
    if bad:
        raise UserError(
            f"{path}: unknown [sweep] key(s) {', '.join(bad)}; valid keys are "
            f"{', '.join(sorted(_SWEEP_KEYS))}"
        )
    head.pop("description", None)
    defaults = dict(doc.get("defaults", {}))
    for key, val in defaults.items():
        if isinstance(val, dict) and key not in KINDS:
            raise UserError(
                f"{path}: [defaults.{key}] names unknown interferer kind {key!r}; valid kinds "
                f"are {', '.join(KINDS)}"
            )
    period = float(head.get("period_ms", 25.0))
    defaults.setdefault("period_ms", period)
    conds: list[Condition] = [Condition()]
    seen = {NONE}
    for n, entry in enumerate(doc.get("conditions", []), start=1):
        where = f"{path} condition {n}"
        if not isinstance(entry, dict):
            raise UserError(f'{where}: expected a table like {{kind = "spin", intensity = 0.5}}')
        if "mix" in entry:
            extra = sorted(set(entry) - {"mix"})
            if extra or not isinstance(entry["mix"], list) or not entry["mix"]:
                raise UserError(f"{where}: a mix is `mix = [{{kind = ...}}, ...]` and nothing else")
            parts = [_grid(p) for p in entry["mix"]]
            for combo in itertools.product(*parts):
                specs = tuple(
                    _make_spec(
                        p, where=where, defaults=defaults, device=device, profiler_cores=cores
                    )
                    for p in combo
                )
                cond = Condition(specs, home_cores=_home(cores))
                if cond.id not in seen:
                    seen.add(cond.id)
                    conds.append(cond)
            continue
        for raw in _grid(entry):
            spec = _make_spec(
                raw, where=where, defaults=defaults, device=device, profiler_cores=cores
            )
            cond = Condition((spec,), home_cores=_home(cores))
            if cond.id not in seen:
                seen.add(cond.id)
                conds.append(cond)
    try:
        return Sweep(
            name=str(head.pop("name", path.stem)),
            conditions=tuple(conds),
            path=str(path),
            sha1=hashlib.sha1(blob).hexdigest()[:12],
            **head,
        )
    except TypeError as exc:
        raise UserError(f"{path}: [sweep] {exc}") from None
