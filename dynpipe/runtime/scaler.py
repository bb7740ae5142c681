"""One dynamic loss scale for a whole pipeline (``--fp16``).

torch's ``GradScaler`` keeps one scale per optimizer and decides per optimizer whether to
skip a step. A pipeline has one optimizer per stage (and per replica), and a step must be
skipped everywhere or nowhere, or the stages would train different models. So:

- the last stage multiplies each microbatch's loss by ``scale`` before its backward;
- every stage divides its own gradients by the same ``scale`` (before clipping, so the
  global norm is the true gradient's) and notes whether any is inf or NaN;
- the flags are reduced over every rank of the world (pipeline stages and replicas) in the
  step's one small all-reduce, and if any is set every optimizer skips the step;
- ``update`` then halves the scale (``backoff``), or doubles it after ``growth_interval``
  clean steps in a row, as ``GradScaler`` does.

The scale and the growth tracker are plain Python numbers changed only by ``update`` from
the all-reduced flag, so they are equal on every rank by construction (a migrated or
rebuilt stage needs nothing moved), and they travel in checkpoints (``state_dict``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dynpipe.errors import UserError

__all__ = ["LossScaler", "ScalerConfig"]


@dataclass(frozen=True)
class ScalerConfig:
    """The loss scale's schedule (``GradScaler``'s defaults).

    init_scale: the scale of the first step.
    growth_factor: what the scale is multiplied by after ``growth_interval`` clean steps.
    backoff_factor: what it is multiplied by after a step with an inf or NaN gradient.
    growth_interval: clean steps in a row before the scale grows.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not self.init_scale > 0 or self.growth_factor <= 1 or not 0 < self.backoff_factor < 1:
            raise UserError(
                f"loss scale needs init_scale > 0, growth_factor > 1 and 0 < backoff_factor "
                f"< 1; got {self.init_scale}, {self.growth_factor}, {self.backoff_factor}"
            )
        if self.growth_interval < 1:
            raise UserError(f"growth_interval must be >= 1, got {self.growth_interval}")


class LossScaler:
    """The pipeline's loss scale and its growth tracker (see the module's docstring)."""

    def __init__(self, config: ScalerConfig | None = None) -> None:
        self.config = config or ScalerConfig()
        self.scale = float(self.config.init_scale)
        self.growth_tracker = 0
        self.skipped = 0  # steps skipped so far (for logs)

    def __repr__(self) -> str:
        return f"LossScaler(scale={self.scale:g} tracker={self.growth_tracker})"

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """Divide ``grads`` by the scale in place; a 0-d float tensor, 1 where any of them
        holds an inf or NaN (on their device; no host synchronisation)."""
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        dev = grads[0].device
        found = torch.zeros((), dtype=torch.float32, device=dev)
        inv = torch.full((), 1.0 / self.scale, dtype=torch.float32, device=dev)
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        for group in by_kind.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
        return found

    def update(self, found_inf: bool) -> bool:
        """The step's outcome over the whole world; returns whether the step is skipped."""
        c = self.config
        if found_inf:
            self.scale *= c.backoff_factor
            self.growth_tracker = 0
            self.skipped += 1
            return True
        self.growth_tracker += 1
        if self.growth_tracker == c.growth_interval:
            self.scale *= c.growth_factor
            self.growth_tracker = 0
        return False

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.skipped = int(state.get("skipped", 0))
