"""``AdaptConfig``: when and how the runtime repartitions (plain data, validated)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dynpipe.errors import UserError

__all__ = ["ADAPT_CORES", "ADAPT_MODES", "AdaptConfig"]

ADAPT_MODES = ("static", "measured", "adaptive", "restart", "sweep")
ADAPT_CORES = ("rules", "model")


@dataclass(frozen=True)
class AdaptConfig:
    """When and how the runtime repartitions.

    Each entry below is the flag's ``--help`` text; docs/adaptation.md gives each default's
    reason and measurement.

    mode: static never moves; measured plans from measured per-layer times; adaptive adds
        the predictor for layers a device does not hold; restart applies adaptive's moves
        by checkpoint and relaunch; sweep (benchmarks) holds every split in turn.
    monitor_every: steps per monitoring window (one all-gather per window); every layer is
        timed on the window's last step.
    settle_windows: windows ignored at the start and after each repartition (allocator
        warm-up, autotuning of layers new to a device) before times are trusted.
    average_windows: a layer's time on its device is the mean of its windows since its
        conditions last changed, over at most this many.
    jump: relative change of a device's reading in one window (or three times its measured
        noise, if more) that counts as a change of conditions.
    min_gain: smallest relative step-time gain the model must promise for a move (the
        measurements guard the rest: a move measured slower is undone).
    horizon_steps: steps over which a gain must pay back the measured migration pause.
    sweep_windows: windows each split is held in ``sweep`` mode (the first settles).
    sweep_plans: ``sweep`` mode with more than 2 stages: how many of the best splits to
        visit (2 stages visit every split).
    partial_reduce: with pipeline replicas, may leave a straggling replica's batch share out
        of the update (SD-Pipe's partial reduce; CHANGES WHAT TRAINING COMPUTES).
    reshape: with the replica policy, may change the data x pipeline shape live (any
        dp' x pp' of the same ranks); exact, like every move.
    elastic: one pipeline: may change the number of stages, leaving a slowed device idle and
        bringing it back when its probe says it recovered.
    core: the decision core of ``measured`` / ``adaptive`` with one pipeline: ``rules``
        (``Controller``) or ``model`` (``ModelPolicy``: device and plan beliefs, one rule).
    confidence: model core: a move is made when the gain over ``horizon_steps`` less the
        pause is positive at this one-sided confidence.
    model_error: model core: the prior standard deviation of the cost model's error on a
        move's log gain, before moves measure it.
    change_h: model core: the CUSUM threshold (in standardised innovations) at which a
        device's readings are a change of conditions.
    noise_floor: model core: the smallest standard deviation (relative) any window's reading
        is given: no two windows of a real machine agree more closely than this.
    noise_prior: model core: the standard deviation (relative) a device's window readings
        are believed to have before its own windows show it, worth one window.
    """

    mode: str = "adaptive"
    monitor_every: int = 5
    settle_windows: int = 1
    average_windows: int = 8
    jump: float = 0.1
    min_gain: float = 0.02
    horizon_steps: int = 100
    sweep_windows: int = 3
    sweep_plans: int = 12
    partial_reduce: bool = False
    reshape: bool = False
    elastic: bool = False
    core: str = field(default="rules", metadata={"choices": ADAPT_CORES})
    confidence: float = 0.9
    model_error: float = 0.02
    change_h: float = 4.0
    noise_floor: float = 0.01
    noise_prior: float = 0.05

    def __post_init__(self) -> None:
        if self.mode not in ADAPT_MODES:
            raise UserError(f"unknown --adapt {self.mode!r}; use one of {', '.join(ADAPT_MODES)}")
        if self.monitor_every < 1:
            raise UserError(f"--monitor-every must be >= 1, got {self.monitor_every}")
        if self.settle_windows < 0:
            raise UserError(f"settle_windows must be >= 0, got {self.settle_windows}")
        if self.average_windows < 1:
            raise UserError(f"average_windows must be >= 1, got {self.average_windows}")
        if self.jump <= 0:
            raise UserError(f"jump must be > 0, got {self.jump}")
        if not 0 <= self.min_gain < 1:
            raise UserError(f"--min-gain must be in [0, 1), got {self.min_gain}")
        if self.horizon_steps < 1:
            raise UserError(f"--horizon must be >= 1 step, got {self.horizon_steps}")
        if self.sweep_windows < 2:
            raise UserError(
                f"sweep_windows must be >= 2 (one settles, one measures), got {self.sweep_windows}"
            )
        if self.core not in ADAPT_CORES:
            raise UserError(f"unknown adaptation core {self.core!r}; use one of {ADAPT_CORES}")
        if not 0.5 <= self.confidence < 1:
            raise UserError(f"confidence must be in [0.5, 1), got {self.confidence}")
        if self.model_error <= 0:
            raise UserError(f"model_error must be > 0, got {self.model_error}")
        if self.noise_floor <= 0:
            raise UserError(f"noise_floor must be > 0, got {self.noise_floor}")
        if self.noise_prior <= 0:
            raise UserError(f"noise_prior must be > 0, got {self.noise_prior}")
        if self.change_h <= 0:
            raise UserError(f"change_h must be > 0, got {self.change_h}")
        if self.sweep_plans < 1:
            raise UserError(f"sweep_plans must be >= 1, got {self.sweep_plans}")

    @property
    def adapting(self) -> bool:
        return self.mode != "static"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AdaptConfig:
        """From a run log's or checkpoint's config; fields of older versions are dropped."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
