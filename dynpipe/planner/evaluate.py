"""Per-stage costs of a given partition: compute, boundary transfer, memory.

The one place that defines what a stage costs, shared by the DP (through prefix sums with
the same meaning), the simulator and the baselines, so they can never disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dynpipe.planner.costs import CostModel
from dynpipe.planner.plan import PlanError

__all__ = ["StageCosts", "in_flight", "memory_limits", "stage_costs", "transfer_ms"]


def in_flight(schedule: str, *, num_stages: int, microbatches: int) -> np.ndarray:
    """Microbatches whose activations stage ``s`` holds at its peak: ``[S]``.

    1F1B: stage ``s`` runs ``min(M, S - s)`` forwards before its first backward; GPipe runs
    all ``M`` forwards first.
    """
    s = np.arange(num_stages)
    if schedule == "gpipe":
        return np.full(num_stages, microbatches)
    return np.minimum(num_stages - s, microbatches)


def transfer_ms(costs: CostModel, link: int, nbytes: float | np.ndarray) -> float | np.ndarray:
    """Time to move ``nbytes`` over link ``link`` (device ``link`` to ``link + 1``)."""
    return nbytes / costs.bandwidth[link] * 1e3 + costs.latency_ms[link]


@dataclass(frozen=True)
class StageCosts:
    """What each stage of one partition costs per microbatch, and holds in memory."""

    bounds: tuple[tuple[int, int], ...]
    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    comm_ms: tuple[float, ...]  # boundary s -> s+1, one direction, per microbatch
    send_bytes: tuple[int, ...]
    mem_bytes: tuple[int, ...]
    static_bytes: tuple[int, ...]
    act_bytes: tuple[int, ...]  # per microbatch in flight
    # Recomputed layers per stage (global indices; ``dynpipe.planner.recompute``): their
    # re-forwards are in ``bwd_ms``, their savings in ``mem_bytes`` and ``act_bytes``.
    recompute: tuple[tuple[int, ...], ...] = ()

    @property
    def load_ms(self) -> tuple[float, ...]:
        """Per-microbatch busy time of each stage (forward + backward)."""
        return tuple(f + b for f, b in zip(self.fwd_ms, self.bwd_ms, strict=True))

    @property
    def bottleneck_ms(self) -> float:
        """The min–max objective: the busiest stage or link per microbatch."""
        return max(max(self.load_ms), max(self.comm_ms, default=0.0))


def memory_limits(memory_bytes: float | Sequence[float] | None, num_stages: int) -> np.ndarray:
    """Per-stage memory limits ``[S]`` in bytes (``inf`` = unlimited)."""
    if memory_bytes is None:
        return np.full(num_stages, np.inf)
    a = np.asarray(memory_bytes, dtype=np.float64)
    if a.ndim == 0:
        a = np.full(num_stages, float(a))
    if a.shape != (num_stages,):
        raise PlanError(
            f"{a.size} memory limits for {num_stages} stages; give one, or one per stage"
        )
    if np.any(a <= 0):
        raise PlanError(f"memory limits must be > 0 bytes, got {a.tolist()}")
    return a


def stage_costs(
    costs: CostModel,
    bounds: Sequence[tuple[int, int]],
    *,
    schedule: str = "1f1b",
    microbatches: int = 4,
    memory_bytes: float | Sequence[float] | None = None,
) -> StageCosts:
    """Per-stage costs of ``bounds`` (stage ``s`` on device ``s`` of ``costs``).

    memory_bytes: per-device limits (one, or one per stage): with ``costs.recompute`` auto,
        what decides which layers each stage recomputes.
    """
    from dynpipe.planner.recompute import choose_recompute, kept_bytes

    n = len(bounds)
    cm = costs.for_devices(n)
    if bounds[-1][1] != cm.num_layers or bounds[0][0] != 0:
        raise PlanError(
            f"partition covers layers {bounds[0][0]}–{bounds[-1][1] - 1} but the cost model has "
            f"{cm.num_layers}; use a cost model of the same model"
        )
    k = in_flight(schedule, num_stages=n, microbatches=microbatches)
    fwd, bwd, comm, send, mem, stat, act, rec = [], [], [], [], [], [], [], []
    static = cm.static_bytes
    lim = memory_limits(memory_bytes, n)
    kept = kept_bytes(cm)
    for s, (a, b) in enumerate(bounds):
        f, b_ = cm.stage_ms(s, a, b)
        st = float(static[a:b].sum())
        ac = float(cm.act_bytes[a:b].sum())
        peak = st + k[s] * ac
        if cm.recompute != "none":
            r = choose_recompute(cm, device=s, start=a, stop=b, in_flight=int(k[s]), limit=lim[s])
            rec.append(r.layers)
            b_ += r.extra_ms
            ac -= float((cm.act_bytes - kept)[list(r.layers)].sum())
            peak = r.peak_bytes
        fwd.append(f)
        bwd.append(b_)
        stat.append(int(st))
        act.append(int(ac))
        mem.append(int(peak))
        if s < n - 1:
            nb = float(cm.out_bytes[b - 1])
            send.append(int(nb))
            comm.append(float(transfer_ms(cm, s, nb)))
    return StageCosts(
        bounds=tuple((int(a), int(b)) for a, b in bounds),
        fwd_ms=tuple(fwd),
        bwd_ms=tuple(bwd),
        comm_ms=tuple(comm),
        send_bytes=tuple(send),
        mem_bytes=tuple(mem),
        static_bytes=tuple(stat),
        act_bytes=tuple(act),
        recompute=tuple(rec),
    )
