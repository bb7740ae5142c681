"""``Plan``: which contiguous layers each pipeline stage holds, and on which rank.

Plain data with a versioned JSON form. Everything that needs a partition — the runtime,
the planner, the simulator, the migration diff — reads this type and nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynpipe.errors import UserError

if TYPE_CHECKING:
    from dynpipe.models.base import LayeredModel

__all__ = [
    "DELAYED_SCHEDULES",
    "MULTI_SCHEDULES",
    "PLAN_VERSION",
    "SCHEDULES",
    "Plan",
    "PlanError",
    "StagePlan",
    "check_batch",
    "microbatch_problem",
    "schedule_ranks",
    "split_label",
]

PLAN_VERSION = 1
# gpipe, 1f1b and 2bw run one stage per rank; the others are torch's multi-stage schedules
# (``PipelineScheduleMulti``), which may give a rank several virtual stages. 2bw is 1F1B's
# order with PipeDream-2BW's delayed weight update (``dynpipe.runtime.twobw``), which
# changes what training computes.
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb", "zbv", "dualpipev", "2bw")
# Schedules whose steps compute gradients on weights one update old (two weight versions).
DELAYED_SCHEDULES = ("2bw",)
# Multi-stage schedules and how they place stage ``s`` of ``pp * chunks`` on a rank: "loop"
# (rank ``s % pp``, torch's default) or "v" (down the ranks and back up, so a rank holds
# stages ``r`` and ``2 pp - 1 - r``), as ``torch.distributed.pipelining`` maps them.
MULTI_SCHEDULES = {"interleaved-1f1b": "loop", "zb": "loop", "zbv": "v", "dualpipev": "v"}
# Schedules that need an exact number of virtual stages per rank.
_FIXED_CHUNKS = {"zbv": 2, "dualpipev": 2}


def schedule_ranks(schedule: str, *, pp: int, chunks: int) -> list[int]:
    """The rank of each of the ``pp * chunks`` stages under ``schedule``'s placement."""
    n = pp * chunks
    if MULTI_SCHEDULES.get(schedule, "loop") == "loop":
        return [s % pp for s in range(n)]
    out = []
    for s in range(n):
        lap, at = divmod(s, pp)
        out.append(at if lap % 2 == 0 else pp - 1 - at)
    return out


def microbatch_problem(schedule: str, *, pp: int, chunks: int, microbatches: int) -> str | None:
    """Why ``schedule`` cannot run ``microbatches`` microbatches over ``pp`` ranks holding
    ``chunks`` virtual stages each (a one-line error with the fix), or None when it can.
    The rules are torch's (``torch.distributed.pipelining.schedules``)."""
    m, stages = microbatches, pp * chunks
    if schedule in ("1f1b", "2bw") and m < pp:
        return (
            f"{schedule.upper()} needs at least as many microbatches as stages ({m} < {pp}); use "
            f"--microbatches {pp} or more" + (", or --schedule gpipe" if schedule == "1f1b" else "")
        )
    if schedule in ("interleaved-1f1b", "zb"):
        rounds = max(1, m // pp)
        if m % rounds:
            good = (m // pp) * pp
            return (
                f"{schedule} runs microbatches in rounds of {pp} (one per rank) and needs "
                f"their count to be a multiple of the rounds ({m} microbatches, {rounds} "
                f"rounds); use --microbatches {good} or {good + pp}"
            )
    if schedule == "dualpipev" and m < stages:
        return (
            f"dualpipev needs at least as many microbatches as virtual stages ({m} < "
            f"{stages}: {pp} ranks x 2); use --microbatches {stages} or more"
        )
    return None


def check_batch(plan: Plan, batch_size: int) -> None:
    """Batch/microbatch/schedule combinations that cannot run, as one-line errors."""
    if plan.dp > 1 and batch_size % plan.total_microbatches:
        total = plan.total_microbatches
        raise UserError(
            f"batch size {batch_size} does not split into {plan.dp} replicas x "
            f"{plan.microbatches} microbatches = {total} equal microbatches; use a batch size "
            f"divisible by {total}"
        )
    if batch_size % plan.microbatches:
        raise UserError(
            f"batch size {batch_size} does not split into {plan.microbatches} equal microbatches; "
            f"use a batch size divisible by {plan.microbatches}"
        )
    if plan.schedule in ("1f1b", "2bw") and plan.microbatches < plan.num_stages:
        raise UserError(
            f"{plan.schedule.upper()} needs at least as many microbatches as stages "
            f"({plan.microbatches} < {plan.num_stages}); use --microbatches {plan.num_stages} "
            "or more" + (", or --schedule gpipe" if plan.schedule == "1f1b" else "")
        )
    if plan.schedule in MULTI_SCHEDULES:
        problem = microbatch_problem(
            plan.schedule, pp=plan.pp, chunks=plan.chunks, microbatches=plan.microbatches
        )
        if problem:
            raise UserError(problem)
    counts = [n for r, n in enumerate(plan.replica_microbatches) if r not in plan.dropped]
    if plan.schedule == "1f1b" and min(counts) < plan.num_stages:
        raise UserError(
            f"1F1B needs at least as many microbatches as stages in every replica (batch "
            f"shares {list(plan.replica_microbatches)}, {plan.num_stages} stages); give each "
            f"replica {plan.num_stages} or more, or use --schedule gpipe"
        )


class PlanError(UserError):
    """A plan that does not fit the model, the world size or itself."""


def split_label(bounds: Sequence[tuple[int, int]]) -> str:
    """A split as logs, tables and decisions write it: layers per stage, ``4|3|3|4``."""
    return "|".join(str(b - a) for a, b in bounds)


@dataclass(frozen=True)
class StagePlan:
    """Stage ``i`` holds layers ``[start, stop)`` and runs on ``rank``.

    The predicted fields are filled by the planner (``None`` for hand-made plans), all per
    microbatch: ``fwd_ms``/``bwd_ms`` of the stage's layers on its device, ``comm_ms`` to send
    ``send_bytes`` of activation to the next stage (the last stage sends nothing), and
    ``mem_bytes`` at the schedule's peak (parameters, gradients, optimizer state, buffers and
    the activations of the microbatches in flight).
    ``recompute``: names of the stage's layers that recompute their activations in the
    backward (``dynpipe.planner.recompute``); empty: none does (or the run's ``--recompute``
    decides). Predicted times and memory include it.
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
    recompute: tuple[str, ...] = ()

    def __len__(self) -> int:
        return self.stop - self.start

    def __repr__(self) -> str:
        return f"[{self.start}:{self.stop})@r{self.rank}"


@dataclass(frozen=True)
class Plan:
    """A pipeline partition: stage ``s`` is ``stages[s]``, in pipeline order.

    dp: data-parallel replicas of the pipeline. Replica ``r`` runs every stage of the plan
        on its own ranks: stage ``s`` on rank ``r * num_stages + stages[s].rank`` (a
        ``(dp, pp)`` device mesh); ``stages[s].rank`` is the stage's place in its pipeline.
        Every replica holds the same layers on the same stages (uneven replication of
        stages is not supported: see docs/data-pipeline.md).
    microbatches: microbatches per replica per step when the batch is shared evenly; a step
        has ``dp * microbatches`` microbatches of ``batch_size / (dp * microbatches)``
        samples in all.
    shares: microbatches each replica takes per step (None: ``microbatches`` each), at
        least one each. They sum to ``dp * microbatches``; replica ``r`` takes the
        consecutive microbatches after those of replicas ``0..r-1``, so every sample is
        still a pure function of the step and the update is the full batch's.
    dropped: replicas whose share is left out of the update (SD-Pipe's partial reduce: they
        compute nothing, and the gradient is the mean over the other replicas' microbatches
        only). This changes what training computes; empty (the default) keeps it exact.
    chunks: virtual stages per rank (``v``). The plan has ``pp * chunks`` stages in
        pipeline order; under a multi-stage schedule each of the ``pp`` ranks holds
        ``chunks`` of them, placed as the schedule places them (``schedule_ranks``: looped
        for interleaved-1f1b and zb, V-shaped for zbv and dualpipev). 1 for gpipe and 1f1b.
    """

    model: str
    num_layers: int
    stages: tuple[StagePlan, ...]
    schedule: str = "1f1b"
    microbatches: int = 4
    model_fingerprint: str | None = None
    version: int = PLAN_VERSION
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    dp: int = 1
    shares: tuple[int, ...] | None = None
    dropped: tuple[int, ...] = ()
    chunks: int = 1

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
        self._check_chunks()
        if not self.stages:
            raise PlanError("plan has no stages; it needs at least one")
        if len(self.stages) > self.num_layers:
            raise PlanError(
                f"plan has {len(self.stages)} stages but {self.model} has only "
                f"{self.num_layers} layers; use at most {self.num_layers} stages"
            )
        expect = 0
        # Every replica runs the plan's stages: a gap is a gap in every replica.
        each = f" in each of its {self.dp} replicas" if self.dp > 1 else ""
        for s, st in enumerate(self.stages):
            if st.start != expect:
                what = "misses" if st.start > expect else "repeats"
                lo, hi = sorted((expect, st.start))
                raise PlanError(
                    f"plan {what} layers {lo}–{hi - 1} before stage {s}{each} (stage {s} "
                    f"starts at layer {st.start}, expected {expect}); stages must cover 0–"
                    f"{self.num_layers - 1} contiguously, each exactly once"
                )
            if st.stop <= st.start:
                raise PlanError(
                    f"stage {s} holds no layers ([{st.start}, {st.stop})); every stage needs "
                    "at least one layer"
                )
            if st.recompute:
                object.__setattr__(st, "recompute", tuple(st.recompute))
                stray = [n for n in st.recompute if st.layers and n not in st.layers]
                if stray or len(set(st.recompute)) != len(st.recompute):
                    raise PlanError(
                        f"stage {s} recomputes {stray or list(st.recompute)}, which are not "
                        f"its layers {list(st.layers)[:3]}… (or are named twice); name each "
                        "of the stage's own layers at most once, or regenerate the plan"
                    )
            expect = st.stop
        if expect != self.num_layers:
            raise PlanError(
                f"plan covers layers 0–{expect - 1}{each} but {self.model} has "
                f"{self.num_layers} layers; regenerate it with `dynpipe plan --model "
                f"{self.model} --stages {len(self.stages)}`"
            )
        ranks = [st.rank for st in self.stages]
        if self.chunks > 1 or self.schedule in MULTI_SCHEDULES:
            self._check_placement(ranks)
        elif len(set(ranks)) != len(ranks):
            raise PlanError(f"plan puts two stages on one rank (ranks {ranks}); use one rank each")
        self._check_replicas()

    def _check_chunks(self) -> None:
        v, sched = self.chunks, self.schedule
        if v < 1:
            raise PlanError(f"chunks (virtual stages per rank) must be >= 1, got {v}")
        if v > 1 and sched not in MULTI_SCHEDULES:
            raise PlanError(
                f"schedule {sched} runs one stage per rank but the plan gives each rank {v} "
                f"virtual stages; use --schedule interleaved-1f1b (or zb, zbv, dualpipev), or "
                "--chunks 1"
            )
        need = _FIXED_CHUNKS.get(sched)
        if need is not None and v != need:
            raise PlanError(
                f"schedule {sched} needs exactly {need} virtual stages per rank, got {v}; "
                f"use --chunks {need}"
            )
        n = len(self.stages)
        if n % v:
            raise PlanError(
                f"plan has {n} stages, which {v} virtual stages per rank cannot share out "
                f"evenly; give it a multiple of {v} stages"
            )
        if v > 1 and n > self.num_layers:
            raise PlanError(
                f"{n // v} ranks x {v} virtual stages need {n} layers but {self.model} has "
                f"{self.num_layers}; use at most {self.num_layers // v} ranks or fewer chunks"
            )
        if (v > 1 or sched in MULTI_SCHEDULES) and self.dp > 1:
            raise PlanError(
                f"schedule {sched} ({v} virtual stages per rank) runs one pipeline only, but "
                f"the plan has {self.dp} replicas; use --dp 1, or --schedule 1f1b or gpipe"
            )

    def _check_placement(self, ranks: list[int]) -> None:
        want = schedule_ranks(self.schedule, pp=self.pp, chunks=self.chunks)
        if ranks != want:
            bad = next(s for s, (a, b) in enumerate(zip(ranks, want, strict=True)) if a != b)
            raise PlanError(
                f"stage {bad} sits on rank {ranks[bad]} but {self.schedule} with {self.chunks} "
                f"virtual stages per rank places it on rank {want[bad]} (ranks by stage: "
                f"{want}); make the plan with `dynpipe plan --schedule {self.schedule} "
                f"--chunks {self.chunks}`"
            )

    def _check_replicas(self) -> None:
        if self.dp < 1:
            raise PlanError(f"dp must be >= 1 (pipeline replicas), got {self.dp}")
        if self.shares is not None:
            object.__setattr__(self, "shares", tuple(int(x) for x in self.shares))
            total = self.dp * self.microbatches
            if len(self.shares) != self.dp or sum(self.shares) != total or min(self.shares) < 1:
                raise PlanError(
                    f"batch shares {list(self.shares)} do not give {self.dp} replicas "
                    f"{total} microbatches ({self.dp} x {self.microbatches}); give one count "
                    f">= 1 per replica summing to {total}"
                )
        object.__setattr__(self, "dropped", tuple(sorted({int(r) for r in self.dropped})))
        bad = [r for r in self.dropped if not 0 <= r < self.dp]
        if bad:
            raise PlanError(f"dropped replicas {bad} are not replicas 0–{self.dp - 1}")
        if len(self.dropped) >= self.dp:
            raise PlanError(
                f"partial reduce drops every replica ({list(self.dropped)}), leaving no "
                "microbatch to train on; keep at least one"
            )

    # ---- views -------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        """Stages of the pipeline (virtual stages: ``pp * chunks``)."""
        return len(self.stages)

    @property
    def pp(self) -> int:
        """Ranks of one pipeline (each holds ``chunks`` stages)."""
        return len(self.stages) // self.chunks

    def stages_of_rank(self, rank: int) -> list[int]:
        """The stages ``rank`` holds, in pipeline order (one, or ``chunks``)."""
        return [s for s, st in enumerate(self.stages) if st.rank == rank]

    def layers_of_rank(self, rank: int) -> list[int]:
        """The layer indices ``rank`` holds, in layer order."""
        return [i for s in self.stages_of_rank(rank) for i in range(*self.bounds[s])]

    @property
    def bounds(self) -> list[tuple[int, int]]:
        return [(st.start, st.stop) for st in self.stages]

    @property
    def ranks(self) -> list[int]:
        return [st.rank for st in self.stages]

    @property
    def world_size(self) -> int:
        """Ranks the plan runs on: every stage of every replica."""
        return self.pp * self.dp

    @property
    def total_microbatches(self) -> int:
        """Microbatches of one step over all replicas (their size is fixed by the batch)."""
        return self.dp * self.microbatches

    @property
    def replica_microbatches(self) -> tuple[int, ...]:
        """Microbatches of the step that replica ``r`` takes (its share)."""
        return self.shares if self.shares is not None else (self.microbatches,) * self.dp

    def replica_slice(self, replica: int) -> tuple[int, int]:
        """``[first, stop)``: the microbatches of the step's ``total_microbatches`` that
        ``replica`` takes."""
        shares = self.replica_microbatches
        first = sum(shares[:replica])
        return first, first + shares[replica]

    @property
    def counted_microbatches(self) -> int:
        """Microbatches whose gradients make the update: all of them, unless replicas are
        dropped (partial reduce)."""
        shares = self.replica_microbatches
        return sum(n for r, n in enumerate(shares) if r not in self.dropped)

    @property
    def partial(self) -> bool:
        """The plan drops replicas' shares: the update differs from full-batch training."""
        return bool(self.dropped)

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
        dp = ""
        if self.dp > 1:
            dp = f" dp={self.dp}"
            if self.shares is not None:
                dp += f" shares={'/'.join(map(str, self.shares))}"
            if self.dropped:
                dp += f" dropped={list(self.dropped)}"
        v = f" v={self.chunks}" if self.chunks > 1 else ""
        return (
            f"Plan({self.model} L={self.num_layers} {self.schedule}{v} mb={self.microbatches}"
            f"{dp}: {parts})"
        )

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
        chunks: int = 1,
    ) -> Plan:
        """A plan from stage sizes ``[n0, n1, ...]`` or ``[(start, stop), ...]`` ranges.

        ranks: one per stage; default: one rank each, or under a multi-stage schedule the
        schedule's placement of ``len(bounds) // chunks`` ranks (``schedule_ranks``)."""
        ranges: list[tuple[int, int]] = []
        if bounds and isinstance(bounds[0], int):
            start = 0
            for n in bounds:  # type: ignore[assignment]
                ranges.append((start, start + int(n)))  # type: ignore[arg-type]
                start += int(n)  # type: ignore[arg-type]
        else:
            ranges = [(int(a), int(b)) for a, b in bounds]  # type: ignore[misc]
        if chunks < 1:
            raise PlanError(f"chunks (virtual stages per rank) must be >= 1, got {chunks}")
        if ranks is None and (chunks > 1 or schedule in MULTI_SCHEDULES):
            if len(ranges) % chunks:
                raise PlanError(
                    f"{len(ranges)} stages cannot be shared out as {chunks} virtual stages per "
                    f"rank; give a multiple of {chunks} stages"
                )
            ranks = schedule_ranks(schedule, pp=len(ranges) // chunks, chunks=chunks)
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
            chunks=chunks,
        )

    @classmethod
    def even(
        cls,
        model: LayeredModel,
        num_stages: int,
        *,
        schedule: str = "1f1b",
        microbatches: int = 4,
        chunks: int = 1,
    ) -> Plan:
        """Equal layer counts per stage (earlier stages take the remainder); ``num_stages``
        ranks, each holding ``chunks`` virtual stages (``num_stages * chunks`` in all)."""
        n = len(model)
        total = num_stages * max(chunks, 1)
        if chunks >= 1 and (num_stages < 1 or total > n):
            each = f" x {chunks} virtual stages" if chunks > 1 else ""
            raise PlanError(
                f"cannot split {model.name} ({n} layers) into {num_stages} ranks{each} = "
                f"{total} stages of at least one layer; use at most {n // max(chunks, 1)} ranks"
                + (" or fewer chunks" if chunks > 1 else "")
            )
        q, r = divmod(n, total)
        sizes = [q + (1 if s < r else 0) for s in range(total)]
        return cls.from_bounds(
            model,
            sizes,
            schedule=schedule,
            microbatches=microbatches,
            meta={"method": "even"},
            chunks=chunks,
        )

    def idle_ranks(self, world_size: int) -> list[int]:
        """Ranks of a ``world_size`` world that hold no stage (an elastic plan's idle ranks)."""
        held = set(self.ranks)
        return [r for r in range(world_size) if r not in held]

    def wide_bounds(self, world_size: int) -> tuple[tuple[int, int], ...]:
        """One ``(start, stop)`` per rank of the world, in rank order: an idle rank holds the
        empty range at the boundary where it sits in the pipeline. A plan of a subset of the
        ranks is one point in the same space as the full plans (one replica only)."""
        if self.dp != 1 or self.chunks > 1:
            return tuple(self.bounds)
        by_rank = {st.rank: (st.start, st.stop) for st in self.stages}
        out, at = [], 0
        for r in range(world_size):
            a, b = by_rank.get(r, (at, at))
            out.append((a, b))
            at = b
        return tuple(out)

    @classmethod
    def from_wide_bounds(
        cls,
        model: LayeredModel,
        wide: list[tuple[int, int]] | tuple[tuple[int, int], ...],
        **kwargs: Any,
    ) -> Plan:
        """The plan of ``wide_bounds``: rank ``r`` holds ``wide[r]``, empty ranges are idle."""
        held = [(r, (a, b)) for r, (a, b) in enumerate(wide) if b > a]
        return cls.from_bounds(model, [ab for _, ab in held], ranks=[r for r, _ in held], **kwargs)

    def with_ranks(self, ranks: list[int]) -> Plan:
        return replace(
            self,
            stages=tuple(replace(st, rank=r) for st, r in zip(self.stages, ranks, strict=True)),
        )

    # ---- validation against a model and a world ------------------------------------------
    def validate(
        self, model: LayeredModel, world_size: int | None = None, *, elastic: bool = False
    ) -> Plan:
        """Check the plan fits ``model`` and a world of ``world_size`` ranks; returns self.

        elastic: the plan may leave ranks idle (one replica only): its stages sit on
        distinct ranks of the world in increasing order (a torch pipelining group numbers
        its members in rank order, so pipeline order must be rank order).
        """
        if self.model != model.name:
            raise PlanError(
                f"plan is for model {self.model!r} but the model is {model.name!r}; "
                f"train it with --model {self.model} (and the --model-arg it was planned "
                f"for), or make one for {model.name} with `dynpipe plan --model {model.name} "
                f"--stages {self.num_stages}`"
            )
        if self.num_layers != len(model):
            raise PlanError(
                f"plan covers layers 0–{self.num_layers - 1} but {model.name} has {len(model)} "
                f"layers; regenerate it with `dynpipe plan --model {model.name} --stages "
                f"{self.num_stages}`"
            )
        names = model.layer_names
        for s, st in enumerate(self.stages):
            stray = [n for n in st.recompute if n not in names[st.start : st.stop]]
            if stray:
                raise PlanError(
                    f"stage {s} recomputes {stray}, which {model.name} does not have at "
                    f"{st.start}–{st.stop - 1}; name layers of the stage, or regenerate the plan"
                )
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
        if (
            world_size is not None
            and elastic
            and self.dp == 1
            and self.chunks == 1
            and self.pp < world_size
        ):
            if any(not 0 <= r < world_size for r in self.ranks) or self.ranks != sorted(self.ranks):
                raise PlanError(
                    f"plan places its {self.num_stages} stages on ranks {self.ranks}; a plan "
                    f"that leaves ranks idle needs increasing ranks within 0–{world_size - 1}"
                )
        elif world_size is not None:
            if world_size != self.world_size and self.dp > 1:
                raise PlanError(
                    f"plan has {self.num_stages} stages x {self.dp} replicas = "
                    f"{self.world_size} ranks but the world has {world_size} ranks; launch "
                    f"with --nproc {self.world_size}, or plan for {world_size} GPUs "
                    f"(`dynpipe plan --gpus {world_size}`)"
                )
            if world_size != self.world_size:
                idle = (
                    ", or train with --elastic to leave the other ranks idle"
                    if self.pp < world_size and self.dp == 1 and self.chunks == 1
                    else ""
                )
                what = f"{self.pp} stages" if self.chunks == 1 else f"{self.pp} ranks of stages"
                raise PlanError(
                    f"plan has {what} but the world has {world_size} ranks; "
                    f"launch with --nproc {self.pp} (one process per stage) or make a "
                    f"{world_size}-stage plan{idle}"
                )
            bad = [r for r in self.ranks if not 0 <= r < self.pp]
            if bad:
                raise PlanError(
                    f"plan places stages on ranks {bad} outside 0–{self.pp - 1}; "
                    "fix the stage ranks"
                )
        if self.microbatches < self.pp:
            import warnings

            warnings.warn(
                f"{self.microbatches} microbatches for {self.pp} stages leaves stages "
                f"idle most of the step; use at least {self.pp} (ideally 2–4×)",
                stacklevel=2,
            )
        return self

    # ---- JSON --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = [
            {
                k: (list(v) if isinstance(v, tuple) else v)
                for k, v in st.items()
                if k != "recompute" or v  # plans without recomputation read as they did
            }
            for st in d["stages"]
        ]
        # One replica writes the plan as it always has (files, logs and checkpoints of
        # single-pipeline runs do not change).
        if self.chunks == 1:
            d.pop("chunks")
        if self.dp == 1:
            for k in ("dp", "shares", "dropped"):
                d.pop(k)
        else:
            d["shares"] = None if self.shares is None else list(self.shares)
            d["dropped"] = list(self.dropped)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        try:
            stages = tuple(
                StagePlan(
                    **{
                        **st,
                        "layers": tuple(st.get("layers", ())),
                        "recompute": tuple(st.get("recompute", ())),
                    }
                )
                for st in d["stages"]
            )
            fields = {k: v for k, v in d.items() if k != "stages"}
            if fields.get("shares") is not None:
                fields["shares"] = tuple(fields["shares"])
            fields["dropped"] = tuple(fields.get("dropped") or ())
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
