"""``AdaptConfig``: when and how the runtime repartitions (plain data, validated)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dynpipe.errors import UserError

__all__ = ["ADAPT_MODES", "AdaptConfig"]

ADAPT_MODES = ("static", "measured", "adaptive", "restart", "sweep")


@dataclass(frozen=True)
class AdaptConfig:
    """When and how the runtime repartitions.

    mode: ``static`` never; ``measured`` plans from the measured per-layer times, a device's
        slowdown taken as the same for every layer; ``adaptive`` adds the predictor for how
        much each layer would slow on a device that does not hold it (falls back to measured
        without one); ``restart`` takes adaptive's decisions but applies them by checkpoint,
        exit and relaunch (the original DynPipe's "DynPipe-Re"); ``sweep`` (benchmarks) visits
        every split in turn for ``sweep_windows`` windows each, so that one launch measures
        every static plan under the same conditions.
    monitor_every: steps per monitoring window (one all-gather per window); every layer is
        timed on the window's last step.
    settle_windows: windows ignored at the start and after each repartition (allocator
        warm-up, kernel autotuning for layers new to a device) before times are trusted.
    average_windows: a layer's running time on its device is the mean of its windows since
        its conditions last changed, over at most this many (older ones fade).
    jump: a device whose reading moves by more than this in one window (or by three times
        its measured window-to-window noise, if that is more) has changed conditions: its
        layers' averages start afresh, so an onset is seen in one window, and moves are
        judged, and measured plans compared, only within one set of conditions.
    min_gain: smallest relative step-time gain the model must promise for a repartition
        (hysteresis against its errors). Plans measured under one set of conditions are
        compared on their measurements' noise instead (a move measured slower beyond it
        is undone). 2%: the model's errors are guarded by measurements too (a gain must
        hold with every device one standard error against it; the last moves' shortfall
        raises the bar; a move measured slower is undone), and 5% kept runs a whole phase
        on splits 4-6% off the best (vgg16 256 under ``gemm`` on 2 x H200: 6|10 at 106.5
        ms against 7|9 at 102.2, the model promising 4.0-4.7% every window). In the
        controller simulator 2% came within 0.0001 of the best of 0-5% on every seed tried,
        with fewer moves than 0-1% (README).
    horizon_steps: steps over which a gain must pay back the measured migration pause.
    sweep_windows: windows each split is held in ``sweep`` mode (the first settles).
    sweep_plans: ``sweep`` mode with more than 2 stages: how many splits to visit (the best
        under the measured per-layer costs); 2 stages visit every split.
    partial_reduce: with pipeline replicas, let the policy leave a straggling replica's
        batch share out of the update (SD-Pipe's partial reduce). This changes what training
        computes (fewer samples per update while it holds); off, every move is exact.
    reshape: let the replica policy (``measured``, ``adaptive``) change the data x
        pipeline shape live, from any starting ``--dp`` (one pipeline over every rank is a
        run of one replica to it): every other ``dp' x pp'`` of the same ranks (one
        pipeline and DP only included), each with its best split and batch shares, is predicted from the measured per-layer costs
        and per-device slowdowns, and moved to by the same rule as any other move; layers
        and optimizer state are copied point to point between two steps. Exact: the step's
        microbatches are the same in every shape.
    elastic: one pipeline (``dp`` 1): the controller may also change the number of stages,
        leaving a device idle when the pipeline is predicted faster without it and
        bringing an idle device back when its probe says it recovered, by the same rule
        (gain at least ``min_gain``, paid back within ``horizon_steps``). Off, plans keep
        their ranks (a release request still empties one).
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
