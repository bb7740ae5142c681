"""The adaptation loop of one rank: hand each window to the policy, carry out its moves.

Run by the training loop once per monitoring window, with the window every rank gathered
(every rank holds the same numbers, its step times included: one rank's clock, not each
rank's own). The policy decides on every rank and learns each move's cost as every rank
agreed it (``_cost``), so every rank's policy keeps the same state and decides the same;
the plan is still taken from one rank and broadcast, so that even a policy that strayed
could never make ranks act on different plans; every rank then builds the new plan from
the same bounds in one place (``_plan``).

The policy reads a window while the device runs the next step (``window`` keeps it,
``think`` runs in the engine's ``while_device_runs``, ``finish`` follows that step): a
decision takes a few milliseconds of host time, and made between two steps it left every
GPU idle for that long once a window (on 2 x H200, vgg16 at 51 ms a step, the step after a
window started 11 ms late against 2-3 ms in a static run). A move therefore starts one step
after the window that asked for it, which is the window the policy lets settle after a move
anyway; the steps before the move reach the log under the plan they ran. A move is applied
live (``migrate.repartition``) or, in ``restart`` mode, by the training loop's restart hook
(checkpoint, exit, relaunch). With pipeline replicas a decision may also change the batch
shares or the replicas partial reduce leaves out; a change of those alone moves no layer
and is logged as ``reshare``. The loop owns no decision logic: what a move was and how it
did lives in the policy's ``MoveRecord``; the loop reports what the move cost.

One pipeline's bounds travel as one range per rank of the world (``Plan.wide_bounds``),
an empty range for a rank the plan leaves idle, so a decision may change the number of
stages; a change of the idle ranks is logged as ``stage_count``, and a rank that goes idle
says so on its standard error.

Light ranks (one pipeline): after every window and every move the loop asks the policy
which ranks of the plan in force hold too little work for their timers to read their
devices (``light_probes``) and tells this rank's engine its own entry
(``PipelineEngine.probe_while_light``); a change of the set is logged as ``light_probes``.
No collective: every rank's policy holds the same state and answers the same, and each
probe comes back to every rank with the window's gather.

With replicas no rank can go idle: a release request is carried out by ``unreplicate``
(``--autodp``: back to one pipeline over the other ranks), or refused in one line.

With replicas a decision may also change the data x pipeline shape (``--reshape``): its
shares name the new replica count, its bounds the new stages. One pipeline over every rank
is one of those shapes, a run of one replica: under the replica policy it is handled as a
replicated run (``Adapter.replicated``: its windows carry its one replica, its shape moves
travel as any other, release requests go the replicated way). Such a decision travels in a
message of its own (``_agree_shape``, sized for any shape of the world) and is carried out
by ``reshape``, the training loop's live reshape (``migrate.reshape`` through
``AutoDP.apply``: copies, checksums, the vote, each rank rebuilt at its place in the new
shape's mesh, logged as ``reshape``); the policy stays the same object and takes up the new
shape from the next window.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from collections.abc import Callable
from pathlib import Path
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

__all__ = ["Adapter", "ReshapeHook", "RestartHook"]

# (adapter, new plan, first step under it, decide ms) -> never returns: the training loop's
# checkpoint-and-exit for the restart baseline.
RestartHook = Callable[["Adapter", Plan, int, float], NoReturn]
# (new plan of another shape, first step under it, reason, decide ms) -> (pause ms, bytes
# copied): the training loop's live reshape.
ReshapeHook = Callable[[Plan, int, str, float], tuple[float, int]]


@dataclasses.dataclass
class _Pending:
    """A window the policy has yet to read, and what it made of it."""

    window: Window
    plan: Plan  # the plan in force at the window's end
    policy: Policy
    thought: bool = False
    decision: Decision | None = None
    policy_ms: float = 0.0
    predict_ms: float | None = None  # of ``policy_ms``, the predictor's call (adaptive)
    error: BaseException | None = None


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
        requests: Path | None = None,
        request_rank: int = 0,
    ) -> None:
        self.policy, self.mode = policy, mode
        self.engine, self.topo, self.log = engine, topo, log
        self.restart = restart
        # Release / reclaim requests (``dynpipe.runtime.requests``): the run directory, known
        # on ``request_rank`` (the rank that writes the log), which broadcasts what it reads.
        self.requests, self.request_rank = requests, request_rank
        self.released: frozenset[int] = frozenset()
        self._requested_at: float | None = None  # the request file's time, where read
        self.beat: Heartbeat | None = None
        self._first: dict | None = None  # the last move, to log its first step
        # (released ranks, first step) -> whether the run left its replicas for one
        # pipeline without them (--autodp); None: requests while replicated are refused.
        self.unreplicate: Callable[[frozenset[int], int], bool] | None = None
        # The live reshape a replicated run's policy may ask for (None: shape moves vetoed).
        self.reshape: ReshapeHook | None = None
        self._refused: frozenset[int] = frozenset()
        self._pending: _Pending | None = None
        self._light: dict[int, int] | None = None  # the light ranks' probes told last
        warm_ms = None
        if mode != "restart":
            from dynpipe.runtime.migrate import warm_links

            # Every pair of ranks exchanges a layer-sized message through the transfer path
            # now, so no repartition pays for setting up a link.
            warm_ms = round(warm_links(topo, warm_bytes=warm_bytes) * 1e3, 3)
        if mode == "adaptive" and policy.mode_used != mode and topo.rank == 0:
            print(
                f"dynpipe train: --adapt adaptive plans as {policy.mode_used}: it needs "
                "--predictor (a fitted predictor, e.g. predictor/h200.json.gz)",
                file=sys.stderr,
                flush=True,
            )
        if log is not None:
            log.event(
                "adapt_mode",
                mode=mode,
                using=policy.mode_used,
                description=policy.describe(),
                links_warmed_ms=warm_ms,
            )
        self._light_probes(step=0)

    def window(self, window: Window) -> None:
        """Take one window (its last step is ``window.step``). Release and reclaim requests
        are acted on now; the policy reads the window in ``think``, during the next step."""
        if self._first is not None:
            self._log_first_step(window)
        self._pending = None
        t0 = time.perf_counter()
        if not self.replicated and self._requests(window, t0):
            self._light_probes(step=window.step + 1)
            return  # a release or reclaim moved layers: the next window is the policy's
        if self.replicated and self._replicated_requests(window):
            return  # the run left its replicas: the next window is the new policy's
        self._pending = _Pending(window=window, plan=self.engine.plan, policy=self.policy)

    def think(self) -> None:
        """The policy's verdict on the pending window: host work alone (no device, no
        collective), which the training loop runs while the device computes the next step.
        A window whose plan or policy has changed since (a freeze moved layers, a reshape)
        describes a plan that is gone: it is not read."""
        p = self._pending
        if p is None or p.thought:
            return
        p.thought = True
        if self.engine.plan is not p.plan or self.policy is not p.policy:
            return
        t0 = time.perf_counter()
        try:
            p.decision = self.policy.observe(p.window)
        except Exception as exc:  # raised in ``finish``, not as the step's failure
            p.error = exc
        p.policy_ms = (time.perf_counter() - t0) * 1e3
        p.predict_ms = getattr(self.policy, "predict_ms", None)

    def finish(
        self, step: int, *, before_move: Callable[[], object] | None = None
    ) -> Decision | None:
        """After step ``step`` (the one ``think`` ran in): agree on the pending decision and
        make its move, whose first step is ``step + 1``. ``before_move``: called on every
        rank just before layers move (the training loop logs the steps run so far, under the
        plan they ran)."""
        self.think()  # a loop that gave the engine no ``while_device_runs``
        p, self._pending = self._pending, None
        if p is None or p.decision is None:
            if p is not None and p.error is not None:
                raise p.error
            if p is not None:
                self._light_probes(step=step + 1)
            return None
        window, first = p.window, step + 1
        decision = dataclasses.replace(p.decision, step=first)
        t0 = time.perf_counter()
        if decision.repartition and self._vetoed(decision):
            if hasattr(self.policy, "pending"):
                self.policy.pending = None  # the move it recorded is not made
            decision = dataclasses.replace(
                decision,
                repartition=False,
                bounds=None,
                reason=f"{decision.reason}; not taken: it uses released ranks "
                f"{sorted(self.released)}, moves frozen layers off the first stage, or "
                "changes the shape of a run without a live reshape",
            )
        reshaping = decision.repartition and self._reshapes(decision)
        shape = None
        if self.reshape is not None and self.replicated:
            # Every window, on every rank: whether the deciding rank asks for another shape.
            shape = self._agree_shape(decision if reshaping else None)
        agreed = None
        if shape is None:
            ordinary = decision.repartition and not reshaping
            agreed = self._agree(decision if ordinary else None)
        agree_ms = (time.perf_counter() - t0) * 1e3
        if self.log is not None:
            if decision.judged is not None:
                # ``move_step``: the move's first step; ``step``: the window that judged it.
                j = dict(decision.judged)
                self.log.event("judged", move_step=j.pop("step"), step=window.step, **j)
            d = decision.to_dict()
            d.pop("judged")
            # Every window's own cost, not only a move's: the policy's host time (spent while
            # the device ran step ``first - 1``), the predictor's part of it where it ran, and
            # the agreement's (between two steps).
            if p.predict_ms is not None:
                d["predict_ms"] = round(p.predict_ms, 3)
            self.log.event(
                "decision",
                window_step=window.step,
                decide_ms=round(p.policy_ms, 3),
                agree_ms=round(agree_ms, 3),
                **d,
            )
        if agreed is not None:
            if before_move is not None:
                before_move()
            new_plan = self._plan(*agreed, decided_at=window.step + 1)
            self._apply(new_plan, window, first=first, exposed_ms=agree_ms, decide_ms=p.policy_ms)
        if shape is not None:
            if before_move is not None:
                before_move()
            new_plan = self._shape_plan(*shape, decided_at=window.step + 1)
            self._apply_shape(
                new_plan, window, first=first, exposed_ms=agree_ms, reason=decision.reason
            )
        self._light_probes(step=first)
        return decision

    def _light_probes(self, *, step: int) -> None:
        """Tell this rank's engine whether it probes as a light rank under the plan in force
        (the policy's ``light_probes``; none with replicas or a policy without them), and log
        the set when it changes. Runs on every rank at the same points (every window's
        ``finish`` once its move is made, after a request's move, at the start), so that
        every rank reads the same set."""
        ask = getattr(self.policy, "light_probes", None)
        plan = self.engine.plan
        world = self.topo.world_size
        light: dict[int, int] = {}
        if ask is not None and not self.replicated and plan.dp == 1:
            light = dict(ask(plan.wide_bounds(world)))
        self.engine.probe_while_light(light.get(self.topo.rank))
        if light != (self._light or {}) and self.log is not None:
            self.log.event(
                "light_probes",
                step=step,
                ranks={str(r): i for r, i in sorted(light.items())},
            )
        self._light = light

    @property
    def replicated(self) -> bool:
        """The run is in replicas, or its policy reads every replica's window
        (``per_replica``: the replica policy, whose shapes include one pipeline over every
        rank, a run of one replica to it); else one pipeline's controller, whose ranks may
        go idle."""
        return self.engine.plan.dp > 1 or bool(getattr(self.policy, "per_replica", False))

    def _reshapes(self, decision: Decision) -> bool:
        """A replicated run's decision for another data x pipeline shape."""
        cur = self.engine.plan
        if not self.replicated:
            return False
        other_dp = decision.shares is not None and len(decision.shares) != cur.dp
        other_pp = decision.bounds is not None and len(decision.bounds) != cur.num_stages
        return other_dp or other_pp

    def _agree_shape(self, decision: Decision | None) -> tuple[int, Bounds, tuple[int, ...]] | None:
        """The deciding rank's shape move, broadcast: ``(dp, bounds, shares)`` or None. The
        message fits any shape of the world, so every rank receives it whatever it decided."""
        cur = self.engine.plan
        world = self.topo.world_size
        t = torch.zeros(3 + (world + 1) + world, dtype=torch.int64)
        src = cur.stages[-1].rank  # as ``_agree``'s
        if self.topo.rank == src and decision is not None:
            assert decision.bounds is not None and decision.shares is not None
            bounds, shares = decision.bounds, decision.shares
            t[0], t[1], t[2] = 1, len(shares), len(bounds)
            cuts = [a for a, _ in bounds] + [bounds[-1][1]]
            t[3 : 3 + len(cuts)] = torch.tensor(cuts)
            t[4 + world : 4 + world + len(shares)] = torch.tensor(list(shares))
        t = t.to(self.topo.device)
        dist.broadcast(t, src=src)
        t = t.cpu()
        if int(t[0]) == 0:
            return None
        dp, pp = int(t[1]), int(t[2])
        cuts = [int(x) for x in t[3 : 4 + pp].tolist()]
        shares = tuple(int(x) for x in t[4 + world : 4 + world + dp].tolist())
        return dp, tuple(itertools.pairwise(cuts)), shares

    def _shape_plan(
        self, dp: int, bounds: Bounds, shares: tuple[int, ...], *, decided_at: int
    ) -> Plan:
        """The plan of another shape, built from the agreed move on every rank: the step's
        microbatches unchanged, ``shares`` kept unless even."""
        cur = self.engine.plan
        total = cur.total_microbatches
        plan = Plan.from_bounds(
            self.engine.model,
            list(bounds),
            schedule=cur.schedule,
            microbatches=total // dp,
            meta={
                **cur.meta,
                "method": f"controller:{self.policy.mode_used}",
                "decided_at": decided_at,
            },
        )
        even = len(set(shares)) == 1
        return dataclasses.replace(plan, dp=dp, shares=None if even else shares)

    def _apply_shape(
        self, new_plan: Plan, window: Window, *, first: int, exposed_ms: float, reason: str
    ) -> None:
        """Reshape to ``new_plan`` (another shape), whose first step is ``first``."""
        if self.mode == "restart":
            if self.restart is None:
                raise RuntimeError("restart mode needs the training loop's restart hook")
            self.restart(self, new_plan, first, exposed_ms)
        assert self.reshape is not None  # vetoed otherwise
        pause_ms, moved = self.reshape(new_plan, first, reason, exposed_ms)
        self.policy.applied(step=first, pause_ms=pause_ms, moved_bytes=moved)
        self._first = {"step": first, "before_ms": window.median_step_ms}

    def _poll(self) -> frozenset[int]:
        """The released ranks as the request rank reads them, on every rank (collective)."""
        from dynpipe.runtime.requests import read_released

        world = self.topo.world_size
        got = read_released(self.requests) if self.requests is not None else frozenset()
        self._requested_at = None
        if self.requests is not None:
            from dynpipe.runtime.requests import REQUEST_FILE

            path = self.requests / REQUEST_FILE
            self._requested_at = path.stat().st_mtime if path.is_file() else None
        if world == 1:
            return frozenset()  # one rank: nothing to hand back
        mask = torch.zeros(world, dtype=torch.int64)
        if self.topo.rank == self.request_rank:
            for r in got:
                if 0 <= r < world:
                    mask[r] = 1
        mask = mask.to(self.topo.device)
        dist.broadcast(mask, src=self.request_rank)
        return frozenset(int(r) for r in torch.nonzero(mask.cpu()).flatten().tolist())

    def _requests(self, window: Window, t0: float) -> bool:
        """Act on a change of the released ranks; True if layers moved."""
        want = self._poll()
        if want == self.released:
            return False
        world = self.topo.world_size
        cur = self.engine.plan
        gone, back = want - self.released, self.released - want
        ranks = tuple(sorted((set(cur.ranks) - want) | back))
        if not ranks:
            if self.log is not None:
                self.log.event(
                    "release",
                    step=window.step + 1,
                    ranks=sorted(gone),
                    reclaimed=sorted(back),
                    refused="it would leave no rank to train on",
                )
            return False  # keep the last active rank; the request stays pending
        self.released = want
        self.engine.release(self.topo.rank in want)
        if hasattr(self.policy, "excluded"):
            self.policy.excluded = want  # it proposes no plan that uses them
        if ranks == tuple(cur.ranks):
            return False  # released ranks that were idle already, or reclaimed and unused
        split = getattr(self.policy, "split_on", None)
        wide = split(window, ranks=ranks) if split is not None else None
        if wide is None:
            wide = _even(cur.num_layers, ranks, world)
        if self.engine.frozen:
            from dynpipe.runtime.freeze import keep_prefix_on_first

            wide = keep_prefix_on_first(wide, frozen=self.engine.frozen)
        # Like any decision, the split is taken from one rank and broadcast.
        request = Decision(
            step=window.step + 1,
            mode="request",
            slowdown=(),
            current_ms=0.0,
            proposed_ms=0.0,
            pause_ms=0.0,
            moved_bytes=0,
            repartition=True,
            reason="release/reclaim",
            bounds=wide,
        )
        agreed = self._agree(request)
        assert agreed is not None  # every rank proposed a move
        new_plan = self._plan(*agreed, decided_at=window.step + 1)
        new_plan = dataclasses.replace(
            new_plan, meta={**new_plan.meta, "method": "request:release/reclaim"}
        )
        decide_ms = (time.perf_counter() - t0) * 1e3
        if self.log is not None:
            # How long the request waited for this monitor point (the log's writer reads
            # the file, so it knows when it was written).
            at = self._requested_at
            self.log.event(
                "release",
                step=window.step + 1,
                ranks=sorted(gone),
                reclaimed=sorted(back),
                released=sorted(want),
                active=list(new_plan.ranks),
                waited_s=None if at is None else round(time.time() - at, 4),
            )
        self._apply(
            new_plan, window, first=window.step + 1, exposed_ms=decide_ms, decide_ms=decide_ms
        )
        return True

    def _replicated_requests(self, window: Window) -> bool:
        """Release requests while replicated: carried out by ``unreplicate``, else refused
        (once per request, in the log and on standard error). True if layers moved."""
        want = self._poll()
        gone = want - self.released
        if not gone:
            self.released = want  # reclaims of ranks that were never left
            return False
        cur = self.engine.plan
        if len(want) >= self.topo.world_size:
            why = "it would leave no rank to train on"
        elif self.unreplicate is None:
            why = (
                f"every rank is a stage of the {cur.dp} x {cur.num_stages} shape the replica "
                "policy holds; launch with --autodp to let the run go back to one pipeline "
                "over the other ranks, or restart on fewer ranks"
            )
        elif self.unreplicate(want, window.step + 1):
            self.released = want
            self.engine.release(self.topo.rank in want)
            if hasattr(self.policy, "excluded"):
                self.policy.excluded = want
            if self.log is not None:
                at = self._requested_at
                self.log.event(
                    "release",
                    step=window.step + 1,
                    ranks=sorted(gone),
                    reclaimed=[],
                    released=sorted(want),
                    active=list(self.engine.plan.ranks),
                    waited_s=None if at is None else round(time.time() - at, 4),
                    replicas_left=cur.dp,
                )
            return True
        else:
            why = "the run could not leave its replicas"
        if want != self._refused:
            self._refused = want
            if self.log is not None:
                self.log.event(
                    "release", step=window.step + 1, ranks=sorted(gone), reclaimed=[], refused=why
                )
            if self.topo.rank == self.request_rank:
                print(
                    f"dynpipe: release of ranks {sorted(gone)} refused at step "
                    f"{window.step + 1}: {why}",
                    file=sys.stderr,
                    flush=True,
                )
        return False

    def _vetoed(self, decision: Decision) -> bool:
        """A decision that would give a released rank layers, or take frozen layers (or the
        last layer that trains after them) out of the first stage (--freeze)."""
        if self._reshapes(decision) and (self.reshape is None or self.released):
            return True  # no live reshape in this run, or a shape would use released ranks
        if decision.bounds is None:
            return False
        bounds = decision.bounds
        frozen = self.engine.frozen
        if frozen and next(b for a, b in bounds if b > a) <= frozen:
            return True
        if not self.released:
            return False
        if len(bounds) != self.topo.world_size:
            return any(r in self.released for r in self.engine.plan.ranks)
        return any(bounds[r][1] > bounds[r][0] for r in self.released)

    def _apply(
        self, new_plan: Plan, window: Window, *, first: int, exposed_ms: float, decide_ms: float
    ) -> None:
        """Move to ``new_plan``, whose first step is ``first``. ``exposed_ms``: what deciding
        cost between two steps (part of the move's pause); ``decide_ms``: the policy's time
        (logged; spent while the device ran a step)."""
        step = first
        if self.mode == "restart":
            if self.restart is None:
                raise RuntimeError("restart mode needs the training loop's restart hook")
            self.restart(self, new_plan, step, exposed_ms)
        from dynpipe.runtime.migrate import repartition

        old = self.engine.plan
        stats = repartition(self.engine, new_plan, beat=self.beat)
        mine = exposed_ms + (stats.transfer_s + stats.rebuild_s) * 1e3
        moved, pause_ms = self._cost(stats, mine)  # collective: every rank takes part
        self.policy.applied(step=step, pause_ms=pause_ms, moved_bytes=moved)
        world = self.topo.world_size
        idle = new_plan.idle_ranks(world) if new_plan.dp == 1 else []
        if self.engine.idle and old.stage_of_rank(self.engine.mesh.pp_rank) is not None:
            print(
                f"dynpipe: rank {self.topo.rank} is idle from step {step}: it holds no layers "
                f"under {new_plan!r} and takes part in the run's collectives only",
                file=sys.stderr,
                flush=True,
            )
        if self.log is not None and idle != (old.idle_ranks(world) if old.dp == 1 else []):
            self.log.event(
                "stage_count",
                step=step,
                stages=new_plan.num_stages,
                old_stages=old.num_stages,
                active=new_plan.ranks,
                idle=idle,
            )
        if self.log is not None and new_plan.wide_bounds(world) == old.wide_bounds(world):
            self.log.event(
                "reshare",
                step=step,
                mode=self.policy.mode_used,
                old_plan=old.to_dict(),
                new_plan=new_plan.to_dict(),
                shares=list(new_plan.replica_microbatches),
                dropped=list(new_plan.dropped),
                partial=new_plan.partial,
                decide_ms=round(decide_ms, 3),
                rebuild_ms=round(stats.rebuild_s * 1e3, 3),
                pause_ms=round(pause_ms, 3),
            )
        elif self.log is not None:
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
                **stats.parts_ms(),
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
            # The job's whole stand between the last step before the move and the first
            # after it (the move's logged pause and whatever else it left to that gap).
            between_ms=None if window.between_ms is None else round(float(window.between_ms[0]), 4),
        )

    def _cost(self, stats, pause_ms: float) -> tuple[int, float]:
        """What a move cost the job, the same on every rank: the bytes moved (each rank
        knows what it sent: their sum) and the pause (each rank timed its own part: the
        slowest rank's, which the job waits for), in one all-reduce. Every rank's policy
        learns these, so they must not be any one rank's own."""
        world = self.topo.world_size
        if world == 1:
            return int(stats.bytes_sent), pause_ms
        # The maximum of one rank's slot and zeros is what that rank sent (exact in float64
        # below 2**53 bytes); the last slot is the slowest pause.
        t = torch.zeros(world + 1, dtype=torch.float64)
        t[self.topo.rank], t[world] = float(stats.bytes_sent), pause_ms
        t = t.to(self.topo.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        t = t.cpu()
        return int(t[:world].sum().item()), float(t[world])

    def _agree(
        self, decision: Decision | None
    ) -> tuple[Bounds, tuple[int, ...] | None, tuple[int, ...]] | None:
        """The last stage's rank's decision, broadcast: ranks never act on different plans
        (every rank's policy read the same window and decided the same; this is the net).

        Returns (bounds, batch shares, dropped replicas) of the plan to move to, or None.
        """
        cur = self.engine.plan
        dp = cur.dp
        world = self.topo.world_size
        if decision is not None:
            bounds = decision.bounds if decision.bounds is not None else tuple(cur.bounds)
            if dp == 1 and len(bounds) != world:
                # Bounds of the current plan's stages, on its ranks: as one per rank.
                bounds = Plan.from_bounds(
                    self.engine.model, list(bounds), ranks=cur.ranks
                ).wide_bounds(world)
            shares = decision.shares if decision.shares is not None else cur.shares
            dropped = decision.dropped if decision.dropped is not None else cur.dropped
        if self.topo.world_size == 1:
            return None if decision is None else (bounds, shares, tuple(dropped))
        # One pipeline: one range per rank of the world (empty for an idle rank), so a plan
        # of any number of stages travels in the same message.
        n = world if dp == 1 else cur.num_stages
        # [move?, cuts..., then with replicas: shares per replica (0: even), dropped flags]
        t = torch.zeros(n + 2 + (2 * dp if dp > 1 else 0), dtype=torch.int64)
        src = cur.stages[-1].rank  # replica 0's last stage, which writes the log
        if self.topo.rank == src and decision is not None:
            t[0] = 1
            t[1 : n + 2] = torch.tensor([a for a, _ in bounds] + [cur.num_layers])
            if dp > 1:
                t[n + 2 : n + 2 + dp] = torch.tensor(list(shares or (0,) * dp))
                t[n + 2 + dp :] = torch.tensor([int(r in dropped) for r in range(dp)])
        t = t.to(self.topo.device)
        dist.broadcast(t, src=src)
        t = t.cpu()
        if int(t[0]) == 0:
            return None
        cuts = [int(x) for x in t[1 : n + 2].tolist()]
        got_shares: tuple[int, ...] | None = None
        got_dropped: tuple[int, ...] = ()
        if dp > 1:
            raw = tuple(int(x) for x in t[n + 2 : n + 2 + dp].tolist())
            got_shares = None if not any(raw) else raw
            got_dropped = tuple(r for r in range(dp) if int(t[n + 2 + dp + r]))
        return tuple(itertools.pairwise(cuts)), got_shares, got_dropped

    def _plan(
        self,
        bounds: Bounds,
        shares: tuple[int, ...] | None,
        dropped: tuple[int, ...],
        *,
        decided_at: int,
    ) -> Plan:
        """The one place a new plan is built, from the agreed bounds, on every rank."""
        cur = self.engine.plan
        kw = {
            "schedule": cur.schedule,
            "microbatches": cur.microbatches,
            "meta": {
                **cur.meta,
                "method": f"controller:{self.policy.mode_used}",
                "decided_at": decided_at,
            },
        }
        if cur.dp == 1 and len(bounds) == self.topo.world_size:
            # One range per rank: empty ranges leave their ranks idle.
            return Plan.from_wide_bounds(self.engine.model, bounds, **kw)
        plan = Plan.from_bounds(self.engine.model, list(bounds), ranks=cur.ranks, **kw)
        if cur.dp > 1:
            even = shares is None or (len(set(shares)) == 1 and shares[0] == cur.microbatches)
            plan = dataclasses.replace(
                plan, dp=cur.dp, shares=None if even else shares, dropped=dropped
            )
        return plan

    def state(self) -> dict:
        return self.policy.state()

    def load_state(self, state: dict) -> None:
        self.policy.load_state(state)


def _even(num_layers: int, ranks: tuple[int, ...], world: int) -> Bounds:
    """Equal layer counts on ``ranks`` (earlier ones take the remainder), one range per
    rank of the world."""
    q, extra = divmod(num_layers, len(ranks))
    out, at = [], 0
    for r in range(world):
        n = (q + (1 if ranks.index(r) < extra else 0)) if r in ranks else 0
        out.append((at, at + n))
        at += n
    return tuple(out)
