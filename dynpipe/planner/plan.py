"""``Plan``: which contiguous layers each pipeline stage holds, and on which rank.

Plain data with a versioned JSON form. Everything that needs a partition — the runtime,
the planner, the simulator, the migration diff — reads this type and nothing else.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynpipe.errors import UserError

if TYPE_CHECKING:
    from dynpipe.models.base import LayeredModel

__all__ = ["PLAN_VERSION", "SCHEDULES", "Plan", "PlanError", "StagePlan"]

PLAN_VERSION = 1
SCHEDULES = ("gpipe", "1f1b")


class PlanError(UserError):
    """A plan that does not fit the model, the world size or itself."""


@dataclass(frozen=True)
class StagePlan:
    """Stage ``i`` holds layers ``[start, stop)`` and runs on ``rank``.

    The predicted fields are filled by the planner (``None`` for hand-made plans), all per
    microbatch: ``fwd_ms``/``bwd_ms`` of the stage's layers on its device, ``comm_ms`` to send
    ``send_bytes`` of activation to the next stage (the last stage sends nothing), and
    ``mem_bytes`` at the schedule's peak (parameters, gradients, optimizer state, buffers and
    the activations of the microbatches in flight).
    """

    start: int
    stop: int
    rank: int
    layers: tuple[str, ...] = ()
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    mem_bytes: int | None = None
    comm_ms: float | None = None
    send_bytes: int | None = None

    def __len__(self) -> int:
        return self.stop - self.start

    def __repr__(self) -> str:
        return f"[{self.start}:{self.stop})@r{self.rank}"


@dataclass(frozen=True)
class Plan:
    """A pipeline partition: stage ``s`` is ``stages[s]``, in pipeline order."""

    model: str
    num_layers: int
    stages: tuple[StagePlan, ...]
    schedule: str = "1f1b"
    microbatches: int = 4
    model_fingerprint: str | None = None
    version: int = PLAN_VERSION
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        # Structural checks that need no model: a Plan object is always self-consistent.
        object.__setattr__(self, "stages", tuple(self.stages))
        if self.version != PLAN_VERSION:
            raise PlanError(
                f"plan version {self.version} is not supported (this dynpipe reads version "
                f"{PLAN_VERSION}); regenerate it with `dynpipe plan`"
            )
        if self.schedule not in SCHEDULES:
            raise PlanError(
                f"unknown schedule {self.schedule!r}; use one of {', '.join(SCHEDULES)}"
            )
        if self.microbatches < 1:
            raise PlanError(f"microbatches must be >= 1, got {self.microbatches}")
        if not self.stages:
            raise PlanError("plan has no stages; it needs at least one")
        if len(self.stages) > self.num_layers:
            raise PlanError(
                f"plan has {len(self.stages)} stages but {self.model} has only "
                f"{self.num_layers} layers; use at most {self.num_layers} stages"
            )
        expect = 0
        for s, st in enumerate(self.stages):
            if st.start != expect:
                what = "misses" if st.start > expect else "repeats"
                lo, hi = sorted((expect, st.start))
                raise PlanError(
                    f"plan {what} layers {lo}–{hi - 1} before stage {s} (stage {s} starts at "
                    f"layer {st.start}, expected {expect}); stages must cover 0–"
                    f"{self.num_layers - 1} contiguously, each exactly once"
                )
            if st.stop <= st.start:
                raise PlanError(
                    f"stage {s} holds no layers ([{st.start}, {st.stop})); every stage needs "
                    "at least one layer"
                )
            expect = st.stop
        if expect != self.num_layers:
            raise PlanError(
                f"plan covers layers 0–{expect - 1} but {self.model} has {self.num_layers} "
                f"layers; regenerate it with `dynpipe plan --model {self.model} --stages "
                f"{len(self.stages)}`"
            )
        ranks = [st.rank for st in self.stages]
        if len(set(ranks)) != len(ranks):
            raise PlanError(f"plan puts two stages on one rank (ranks {ranks}); use one rank each")

    # ---- views -------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def bounds(self) -> list[tuple[int, int]]:
        return [(st.start, st.stop) for st in self.stages]

    @property
    def ranks(self) -> list[int]:
        return [st.rank for st in self.stages]

    def stage_of_rank(self, rank: int) -> int | None:
        for s, st in enumerate(self.stages):
            if st.rank == rank:
                return s
        return None

    def stage_of_layer(self, index: int) -> int:
        for s, st in enumerate(self.stages):
            if st.start <= index < st.stop:
                return s
        raise IndexError(f"layer {index} is outside the plan's 0–{self.num_layers - 1}")

    def owner(self, index: int) -> int:
        """Rank that holds layer ``index``."""
        return self.stages[self.stage_of_layer(index)].rank

    def __repr__(self) -> str:
        parts = " ".join(repr(st) for st in self.stages)
        return f"Plan({self.model} L={self.num_layers} {self.schedule} mb={self.microbatches}: {parts})"

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def from_bounds(
        cls,
        model: LayeredModel,
        bounds: list[int] | list[tuple[int, int]],
        *,
        ranks: list[int] | None = None,
        schedule: str = "1f1b",
        microbatches: int = 4,
        meta: dict[str, Any] | None = None,
    ) -> Plan:
        """A plan from stage sizes ``[n0, n1, ...]`` or ``[(start, stop), ...]`` ranges."""
        ranges: list[tuple[int, int]] = []
        if bounds and isinstance(bounds[0], int):
            start = 0
            for n in bounds:  # type: ignore[assignment]
                ranges.append((start, start + int(n)))  # type: ignore[arg-type]
                start += int(n)  # type: ignore[arg-type]
        else:
            ranges = [(int(a), int(b)) for a, b in bounds]  # type: ignore[misc]
        ranks = list(range(len(ranges))) if ranks is None else list(ranks)
        if len(ranks) != len(ranges):
            raise PlanError(f"{len(ranges)} stages but {len(ranks)} ranks given; give one each")
        names = model.layer_names
        stages = tuple(
            StagePlan(a, b, r, tuple(names[a:b])) for (a, b), r in zip(ranges, ranks, strict=True)
        )
        return cls(
            model=model.name,
            num_layers=len(model),
            stages=stages,
            schedule=schedule,
            microbatches=microbatches,
            model_fingerprint=model.fingerprint(),
            meta=dict(meta or {}),
        )

    @classmethod
    def even(
        cls, model: LayeredModel, num_stages: int, *, schedule: str = "1f1b", microbatches: int = 4
    ) -> Plan:
        """Equal layer counts per stage (earlier stages take the remainder)."""
        n = len(model)
        if num_stages < 1 or num_stages > n:
            raise PlanError(
                f"cannot split {model.name} ({n} layers) into {num_stages} stages; use 1–{n} stages"
            )
        q, r = divmod(n, num_stages)
        sizes = [q + (1 if s < r else 0) for s in range(num_stages)]
        return cls.from_bounds(
            model, sizes, schedule=schedule, microbatches=microbatches, meta={"method": "even"}
        )

    def with_ranks(self, ranks: list[int]) -> Plan:
        return replace(
            self,
            stages=tuple(replace(st, rank=r) for st, r in zip(self.stages, ranks, strict=True)),
        )

    # ---- validation against a model and a world ------------------------------------------
    def validate(self, model: LayeredModel, world_size: int | None = None) -> Plan:
        """Check the plan fits ``model`` and a world of ``world_size`` ranks; returns self."""
        if self.model != model.name:
            raise PlanError(
                f"plan is for model {self.model!r} but the model is {model.name!r}; "
                f"regenerate it with `dynpipe plan --model {model.name} --stages {self.num_stages}`"
            )
        if self.num_layers != len(model):
            raise PlanError(
                f"plan covers layers 0–{self.num_layers - 1} but {model.name} has {len(model)} "
                f"layers; regenerate it with `dynpipe plan --model {model.name} --stages "
                f"{self.num_stages}`"
            )
        names = model.layer_names
        for s, st in enumerate(self.stages):
            if st.layers and tuple(names[st.start : st.stop]) != tuple(st.layers):
                raise PlanError(
                    f"stage {s} names layers {list(st.layers)[:3]}… but {model.name} has "
                    f"{names[st.start : st.stop][:3]}… at {st.start}–{st.stop - 1}; the model "
                    f"changed since the plan was made: regenerate it with `dynpipe plan`"
                )
        if self.model_fingerprint and self.model_fingerprint != model.fingerprint():
            raise PlanError(
                f"plan was made for {self.model} with layer fingerprint {self.model_fingerprint} "
                f"but this {model.name} has {model.fingerprint()} (its layers changed); "
                f"regenerate it with `dynpipe plan --model {model.name} --stages {self.num_stages}`"
            )
        if world_size is not None:
            if world_size != self.num_stages:
                raise PlanError(
                    f"plan has {self.num_stages} stages but the world has {world_size} ranks; "
                    f"launch with --nproc {self.num_stages} (one process per stage) or make a "
                    f"{world_size}-stage plan"
                )
            bad = [r for r in self.ranks if not 0 <= r < world_size]
            if bad:
                raise PlanError(
                    f"plan places stages on ranks {bad} outside 0–{world_size - 1}; "
                    "fix the stage ranks"
                )
        if self.microbatches < self.num_stages:
            import warnings

            warnings.warn(
                f"{self.microbatches} microbatches for {self.num_stages} stages leaves stages "
                f"idle most of the step; use at least {self.num_stages} (ideally 2–4×)",
                stacklevel=2,
            )
        return self

    # ---- JSON --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = [
            {k: (list(v) if isinstance(v, tuple) else v) for k, v in st.items()}
            for st in d["stages"]
        ]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        try:
            stages = tuple(
                StagePlan(**{**st, "layers": tuple(st.get("layers", ()))}) for st in d["stages"]
            )
            fields = {k: v for k, v in d.items() if k != "stages"}
            plan = cls(stages=stages, **fields)
        except (KeyError, TypeError, AttributeError) as exc:
            raise PlanError(f"malformed plan ({exc}); regenerate it with `dynpipe plan`") from None
        for i, st in enumerate(plan.stages):
            for name in ("start", "stop", "rank"):
                v = getattr(st, name)
                if not isinstance(v, int) or isinstance(v, bool):
                    raise PlanError(
                        f"malformed plan: stage {i} has {name} {v!r} ({type(v).__name__}), not "
                        f"an integer; write it as {name}: {v if isinstance(v, str) else 0} "
                        "without quotes, or regenerate it with `dynpipe plan`"
                    )
        return plan

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(
                f"plan is not valid JSON ({exc}); regenerate it with `dynpipe plan`"
            ) from None
        return cls.from_dict(d)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.to_json() + "\n")
        return p

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        p = Path(path)
        if not p.is_file():
            raise PlanError(f"plan file {p} does not exist; make one with `dynpipe plan -o {p}`")
        return cls.from_json(p.read_text())
