"""The adaptation loop of one rank: hand each window to the policy, carry out its moves.

Run by the training loop once per monitoring window, with the window every rank gathered
(every rank holds the same numbers). The policy decides on every rank, but the plan is still
taken from one rank and broadcast, so ranks can never act on different plans; every rank
then builds the new plan from the same bounds in one place (``_plan``). A move is applied
live (``migrate.repartition``) or, in ``restart`` mode, by the training loop's restart hook
(checkpoint, exit, relaunch). The loop owns no decision logic: what a move was and how it
did lives in the policy's ``MoveRecord``; the loop reports what the move cost.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

from dynpipe.planner.plan import Plan
from dynpipe.runtime.adapt.policy import Decision, Policy
from dynpipe.runtime.adapt.record import Bounds
from dynpipe.runtime.adapt.window import Window
from dynpipe.runtime.engine import PipelineEngine
from dynpipe.runtime.health import Heartbeat
from dynpipe.runtime.runlog import RunLog
from dynpipe.runtime.topology import Topology

__all__ = ["Adapter", "RestartHook"]

# (adapter, new plan, first step under it, decide ms) -> never returns: the training loop's
# checkpoint-and-exit for the restart baseline.
RestartHook = Callable[["Adapter", Plan, int, float], NoReturn]


class Adapter:
    """Monitor windows -> policy -> (live or restart) repartition, on every rank.

    mode: the configured adaptation mode (``restart`` applies moves through ``restart``).
    """

    def __init__(
        self,
        *,
        policy: Policy,
        mode: str,
        engine: PipelineEngine,
        topo: Topology,
        log: RunLog | None,
        restart: RestartHook | None = None,
        warm_bytes: int = 0,
    ) -> None:
        self.policy, self.mode = policy, mode
        self.engine, self.topo, self.log = engine, topo, log
        self.restart = restart
        self.beat: Heartbeat | None = None
        self._first: dict | None = None  # the last move, to log its first step
        warm_ms = None
        if mode != "restart":
            from dynpipe.runtime.migrate import warm_links

            # Every pair of ranks exchanges a layer-sized message through the transfer path
            # now, so no repartition pays for setting up a link.
            warm_ms = round(warm_links(topo, warm_bytes=warm_bytes) * 1e3, 3)
        if log is not None:
            log.event(
                "adapt_mode",
                mode=mode,
                using=policy.mode_used,
                description=policy.describe(),
                links_warmed_ms=warm_ms,
            )

    def window(self, window: Window) -> Decision | None:
        """Feed one window (its last step is ``window.step``); move if the policy says so."""
        if self._first is not None:
            self._log_first_step(window)
        t0 = time.perf_counter()
        decision = self.policy.observe(window)
        if decision is None:
            return None
        bounds = self._agree(decision.bounds if decision.repartition else None)
        decide_ms = (time.perf_counter() - t0) * 1e3
        if self.log is not None:
            if decision.judged is not None:
                # ``move_step``: the move's first step; ``step``: the window that judged it.
                j = dict(decision.judged)
                self.log.event("judged", move_step=j.pop("step"), step=window.step, **j)
            d = decision.to_dict()
            d.pop("judged")
            self.log.event("decision", **d)
        if bounds is not None:
            self._apply(self._plan(bounds, decided_at=decision.step), window, decide_ms)
        return decision

    def _apply(self, new_plan: Plan, window: Window, decide_ms: float) -> None:
        step = window.step + 1  # the first step under the new plan
        if self.mode == "restart":
            if self.restart is None:
                raise RuntimeError("restart mode needs the training loop's restart hook")
            self.restart(self, new_plan, step, decide_ms)
        from dynpipe.runtime.migrate import repartition

        old = self.engine.plan
        stats = repartition(self.engine, new_plan, beat=self.beat)
        pause_ms = decide_ms + (stats.transfer_s + stats.rebuild_s) * 1e3
        moved = self._bytes(stats)  # collective: every rank takes part
        self.policy.applied(step=step, pause_ms=pause_ms, moved_bytes=moved)
        if self.log is not None:
            self.log.event(
                "repartition",
                step=step,
                mode=self.policy.mode_used,
                old_plan=old.to_dict(),
                new_plan=new_plan.to_dict(),
                transfers=[repr(t) for t in stats.transfers],
                bytes=moved,
                decide_ms=round(decide_ms, 3),
                transfer_ms=round(stats.transfer_s * 1e3, 3),
                rebuild_ms=round(stats.rebuild_s * 1e3, 3),
                pause_ms=round(pause_ms, 3),
                **{
                    f"{k}_ms": round(getattr(stats, f"{k}_s") * 1e3, 3)
                    for k in ("pack", "wire", "unpack", "build", "engine")
                },
            )
        self._first = {"step": step, "before_ms": window.median_step_ms}

    def _log_first_step(self, window: Window) -> None:
        """The first step under a new plan, next to the steps before and after it: what the
        repartition cost beyond its logged pause (new buffers, the schedule's first run)."""
        info, self._first = self._first, None
        first = window.step - len(window.step_ms) + 1
        if info is None or first != info["step"] or self.log is None:
            return
        rest = window.step_ms[1:]
        self.log.event(
            "first_step",
            step=info["step"],
            first_step_ms=round(float(window.step_ms[0]), 4),
            before_ms=round(info["before_ms"], 4),
            after_ms=round(float(np.median(rest)), 4) if len(rest) else None,
        )

    def _bytes(self, stats) -> int:
        # Every rank knows only what it sent; the sum over ranks is the bytes moved.
        t = torch.tensor([stats.bytes_sent], dtype=torch.int64, device=self.topo.device)
        if self.topo.world_size > 1:
            dist.all_reduce(t)
        return int(t.item())

    def _agree(self, bounds: Bounds | None) -> Bounds | None:
        """The last stage's rank's decision, broadcast: ranks never act on different plans."""
        if self.topo.world_size == 1:
            return bounds
        cur = self.engine.plan
        n = cur.num_stages
        t = torch.zeros(n + 2, dtype=torch.int64, device=self.topo.device)
        src = cur.stages[-1].rank
        if self.topo.rank == src and bounds is not None:
            t[0] = 1
            t[1:] = torch.tensor([a for a, _ in bounds] + [cur.num_layers])
        dist.broadcast(t, src=src)
        if int(t[0]) == 0:
            return None
        cuts = [int(x) for x in t[1:].tolist()]
        return tuple(itertools.pairwise(cuts))

    def _plan(self, bounds: Bounds, *, decided_at: int) -> Plan:
        """The one place a new plan is built, from the agreed bounds, on every rank."""
        cur = self.engine.plan
        return Plan.from_bounds(
            self.engine.model,
            list(bounds),
            ranks=cur.ranks,
            schedule=cur.schedule,
            microbatches=cur.microbatches,
            meta={
                **cur.meta,
                "method": f"controller:{self.policy.mode_used}",
                "decided_at": decided_at,
            },
        )

    def state(self) -> dict:
        return self.policy.state()

    def load_state(self, state: dict) -> None:
        self.policy.load_state(state)
