"""Which layers of a stage recompute their activations, and what that costs and saves.

A recomputed layer (``torch.utils.checkpoint``) keeps only its input from the forward
until the backward and runs its forward again inside its backward. Per microbatch in
flight it saves ``act_bytes - kept`` (``kept``: its input, which the checkpoint holds) and
costs one more forward. While one microbatch's backward runs through it, the layer's full
activations exist again, once, and that microbatch has by then freed what the layers after
it held. With ``held_l`` = ``kept`` inside ``R`` and ``act_bytes`` outside, ``H`` their sum
over the stage, and ``k`` microbatches in flight, a stage's peak is

    static + (k - 1) * H + max(H, max over j in R of (sum of held_l for l < j) + act_bytes_j)

(the last microbatch's forward end, or the re-forward of a recomputed layer in its backward,
whichever is higher: recomputing the first layers of a stage adds nothing to the peak).

Modes: ``none`` keeps everything; ``all`` recomputes every layer; ``auto`` recomputes
nothing when the stage fits and otherwise the cheapest layers that make it fit: layers in
order of forward milliseconds per byte saved, then any chosen layer whose removal still
fits (cheapest-first by this ratio is exact when the layers are alike, as a transformer's
blocks are).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynpipe.planner.costs import CostModel, gib

__all__ = ["RECOMPUTE", "Recompute", "choose_recompute", "kept_bytes", "stage_peak"]

RECOMPUTE = ("none", "all", "auto")


@dataclass(frozen=True)
class Recompute:
    """One stage's choice: the recomputed layers (global indices, ascending), the forward
    milliseconds their re-forwards add to the stage's backward per microbatch, the stage's
    predicted peak bytes, and whether that is within its limit."""

    layers: tuple[int, ...]
    extra_ms: float
    peak_bytes: float
    fits: bool

    def __repr__(self) -> str:
        return (
            f"Recompute({list(self.layers)} +{self.extra_ms:.3g}ms peak={gib(self.peak_bytes)} "
            f"{'fits' if self.fits else 'over'})"
        )


def kept_bytes(costs: CostModel) -> np.ndarray:
    """``[L]`` bytes a recomputed layer still keeps per microbatch: its input (the previous
    layer's output; the first layer's input is the data, which the stage holds anyway)."""
    inp = np.concatenate([[0.0], costs.out_bytes[:-1]])
    return np.minimum(inp, costs.act_bytes)


def stage_peak(
    static: float, act: np.ndarray, kept: np.ndarray, chosen: np.ndarray, k: int
) -> float:
    """The peak bytes of a stage (layers ``act``/``kept``, recomputed where ``chosen``) with
    ``k`` microbatches in flight: see the module's docstring."""
    held = np.where(chosen, kept, act)
    total = float(held.sum())
    last = total
    if chosen.any():
        before = np.concatenate([[0.0], np.cumsum(held)[:-1]])
        last = max(total, float((before + act)[chosen].max()))
    return float(static + (k - 1) * total + last)


_peak = stage_peak


def choose_recompute(
    costs: CostModel,
    *,
    device: int,
    start: int,
    stop: int,
    in_flight: int,
    limit: float = np.inf,
    mode: str | None = None,
) -> Recompute:
    """The recomputed layers of stage ``[start, stop)`` on ``device`` under ``mode``
    (default: ``costs.recompute``) with ``in_flight`` microbatches and ``limit`` bytes."""
    mode = costs.recompute if mode is None else mode
    if mode not in RECOMPUTE:
        raise ValueError(f"recompute mode {mode!r}; use one of {', '.join(RECOMPUTE)}")
    act = costs.act_bytes[start:stop]
    kept = kept_bytes(costs)[start:stop]
    static = float(costs.static_bytes[start:stop].sum())
    fwd = costs.fwd_ms[device, start:stop]
    n = stop - start
    chosen = np.zeros(n, dtype=bool)
    if mode == "all":
        chosen[:] = True
    elif mode == "auto" and _peak(static, act, kept, chosen, in_flight) > limit:
        saving = act - kept
        useful = np.flatnonzero(saving > 0)
        # Cheapest milliseconds per byte saved first; ties to the earlier layer.
        order = useful[np.lexsort((useful, fwd[useful] / saving[useful]))]
        for j in order:
            chosen[j] = True
            if _peak(static, act, kept, chosen, in_flight) <= limit:
                break
        if _peak(static, act, kept, chosen, in_flight) <= limit:
            # Greedy can overshoot: drop the dearest choices that the limit does not need.
            for j in sorted(np.flatnonzero(chosen), key=lambda j: (-fwd[j], -j)):
                chosen[j] = False
                if _peak(static, act, kept, chosen, in_flight) > limit:
                    chosen[j] = True
    peak = _peak(static, act, kept, chosen, in_flight)
    return Recompute(
        layers=tuple(int(start + j) for j in np.flatnonzero(chosen)),
        extra_ms=float(fwd[chosen].sum()),
        peak_bytes=peak,
        fits=bool(peak <= limit),
    )
