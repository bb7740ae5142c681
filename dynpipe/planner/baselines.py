"""Reference partitioners the planner is compared against.

- ``even``: equal layer counts (earlier stages take the remainder), like ``Plan.even``.
- ``parameters``: DeepSpeed's default ``partition_method="parameters"`` — the split whose
  largest stage holds the fewest parameters, packed greedily from the left exactly as
  ``deepspeed.runtime.utils.partition_balanced`` does (min–max bottleneck, then ``_lprobe``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from dynpipe.planner.plan import PlanError

__all__ = ["BASELINES", "baseline_bounds", "even_bounds", "parameter_bounds"]

BASELINES = ("even", "parameters")


def _ranges(cuts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in itertools.pairwise(cuts))


def even_bounds(num_layers: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    if not 1 <= num_stages <= num_layers:
        raise PlanError(f"cannot split {num_layers} layers into {num_stages} stages")
    q, r = divmod(num_layers, num_stages)
    cuts = [0]
    for s in range(num_stages):
        cuts.append(cuts[-1] + q + (1 if s < r else 0))
    return _ranges(cuts)


def _greedy(prefix: np.ndarray, num_stages: int, cap: float) -> list[int] | None:
    # Each stage takes as many layers as fit under ``cap`` while leaving one per later stage.
    n = len(prefix) - 1
    cuts = [0]
    for s in range(num_stages):
        last = n - (num_stages - 1 - s)
        j = int(np.searchsorted(prefix, prefix[cuts[-1]] + cap, side="right")) - 1
        j = min(j, last)
        if j <= cuts[-1]:
            return None
        cuts.append(j)
    return cuts if cuts[-1] == n else None


def parameter_bounds(param_counts: Sequence[float], num_stages: int) -> tuple[tuple[int, int], ...]:
    """Min–max parameter split, left-packed (DeepSpeed ``partition_method="parameters"``)."""
    w = np.asarray(param_counts, dtype=np.float64)
    n = len(w)
    if not 1 <= num_stages <= n:
        raise PlanError(f"cannot split {n} layers into {num_stages} stages")
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    # The optimal cap is one of the range sums; bisect over the sorted distinct candidates.
    cand = np.unique((prefix[None, :] - prefix[:, None])[np.triu_indices(n + 1, 1)])
    lo, hi = 0, len(cand) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _greedy(prefix, num_stages, cand[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    cuts = _greedy(prefix, num_stages, cand[lo])
    assert cuts is not None
    return _ranges(cuts)


def baseline_bounds(
    method: str, *, param_bytes: Sequence[float], num_stages: int
) -> tuple[tuple[int, int], ...]:
    if method == "even":
        return even_bounds(len(param_bytes), num_stages)
    if method == "parameters":
        return parameter_bounds(param_bytes, num_stages)
    raise PlanError(f"unknown baseline {method!r}; use one of {', '.join(BASELINES)}")
