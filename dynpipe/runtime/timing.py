"""Per-microbatch compute timers for a stage: always on, cheap, no syncs in the hot path.

On CUDA each interval is a pair of events resolved once per step (after the step's own
synchronisation), on CPU a ``perf_counter`` pair. Time the stage spends in its schedule that
is not forward or backward compute is its wait: P2P receives and pipeline bubbles.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

__all__ = ["StageTimer", "StepTiming"]


@dataclass
class StepTiming:
    """One step of one stage, in milliseconds."""

    fwd_ms: list[float] = field(default_factory=list)
    bwd_ms: list[float] = field(default_factory=list)
    schedule_ms: float = 0.0

    @property
    def fwd_total(self) -> float:
        return float(sum(self.fwd_ms))

    @property
    def bwd_total(self) -> float:
        return float(sum(self.bwd_ms))

    @property
    def wait_ms(self) -> float:
        return max(0.0, self.schedule_ms - self.fwd_total - self.bwd_total)


class StageTimer:
    """Records forward/backward intervals of one stage during one schedule step."""

    def __init__(self, *, device: torch.device, enabled: bool = True) -> None:
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        # Emulated interference (tests, demos without a real interferer): every compute
        # interval is stretched to ``dilation`` times its length. CPU only.
        self.dilation = 1.0
        self._fwd: list = []
        self._bwd: list = []
        self._open: object | None = None
        self._t_dilate = 0.0

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        if self.dilation > 1.0:
            self._t_dilate = time.perf_counter()
        if self.enabled:
            self._open = self._mark()

    def stop(self, phase: str) -> None:
        if self.dilation > 1.0 and not self.cuda:
            time.sleep((time.perf_counter() - self._t_dilate) * (self.dilation - 1.0))
        if not self.enabled or self._open is None:
            return
        pair = (self._open, self._mark())
        (self._fwd if phase == "fwd" else self._bwd).append(pair)
        self._open = None

    def collect(self, schedule_ms: float) -> StepTiming:
        """Resolve this step's intervals (call after the step has synchronised) and reset."""

        def ms(pairs: list) -> list[float]:
            if self.cuda:
                return [a.elapsed_time(b) for a, b in pairs]
            return [(b - a) * 1e3 for a, b in pairs]

        out = StepTiming(fwd_ms=ms(self._fwd), bwd_ms=ms(self._bwd), schedule_ms=schedule_ms)
        self._fwd, self._bwd = [], []
        return out
