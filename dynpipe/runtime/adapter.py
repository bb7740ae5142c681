"""The adaptation loop of one rank: monitor, controller and live repartitioning.

Run by the training loop at every monitoring window with the window's gathered step
records. Every rank runs it with the same numbers; the decisions that change the plan are
still taken by one rank and broadcast, so ranks never act on different plans.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from dynpipe.planner.plan import Plan
from dynpipe.runtime.controller import Controller, Decision, Monitor
from dynpipe.runtime.engine import PipelineEngine
from dynpipe.runtime.health import Heartbeat
from dynpipe.runtime.runlog import RunLog
from dynpipe.runtime.topology import Topology

if TYPE_CHECKING:
    from dynpipe.runtime.config import TrainConfig

__all__ = ["Adapter", "median_step", "stage_medians", "stage_noise"]


class Adapter:
    """Monitor + controller + (restart or live) repartitioning, run at window boundaries.

    ``restart``: how the restart baseline applies a decision (checkpoint, then exit for a
    relaunch); the training loop supplies it, since it owns checkpoints.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        engine: PipelineEngine,
        topo: Topology,
        log: RunLog | None,
        restart: Callable[[Adapter, Plan, int, float], NoReturn] | None = None,
    ) -> None:
        from dynpipe.planner.costs import CostModel

        self.cfg, self.engine, self.topo, self.log = cfg, engine, topo, log
        self.restart = restart
        self.adapt = cfg.adapt
        self.initial_plan = engine.plan
        self.beat: Heartbeat | None = None
        plan = engine.plan
        if self.adapt.mode == "static":
            return
        mb = cfg.batch_size // plan.microbatches
        costs = CostModel.from_model(engine.model, microbatch_size=mb, num_devices=plan.num_stages)
        predictor = prepared = None
        if cfg.predictor and self.adapt.mode in ("adaptive", "restart"):
            from dynpipe.models.stats import layer_stats
            from dynpipe.predictor import load_predictor, prepare_layers

            predictor = load_predictor(cfg.predictor)
            if hasattr(predictor.estimator, "set_predict_threads"):
                predictor.estimator.set_predict_threads(1)
            prepared = prepare_layers(
                predictor, layer_stats(engine.model, batch_size=mb), batch_size=mb
            )
        self.controller = Controller(
            costs=costs, config=self.adapt, predictor=predictor, prepared_layers=prepared
        )
        self.monitor = Monitor(plan.num_stages, ewma=self.adapt.ewma, jump=self.adapt.jump)
        self.settle = self.adapt.settle_windows
        self._calib: list[dict] = []  # step records of the calibration windows so far
        self._calib_windows = 0
        self._last_repartition: dict | None = None  # to log the first step under a new plan
        # (step ms before the last move, its predicted gain, the plan it left)
        self._judge: tuple[float, float, Plan] | None = None
        warm_ms = None
        if self.adapt.mode in ("measured", "adaptive"):
            from dynpipe.runtime.migrate import warm_links

            # On GPUs also one message the size of the largest layer's state (capped).
            warm = int(min(costs.state_bytes.max(), 64 << 20)) if topo.is_cuda else 0
            warm_ms = round(warm_links(topo, warm_bytes=warm) * 1e3, 3)
        if log is not None:
            log.event(
                "adapt_mode",
                mode=self.adapt.mode,
                using=self.controller.mode_used,
                description=self.controller.describe(),
                links_warmed_ms=warm_ms,
            )

    def window(self, step: int, records: list[dict], tels: list[dict]) -> Decision | None:
        """Feed one window (ending after ``step``); repartition if the controller says so."""
        if self.adapt.mode == "static" or not records:
            return None
        if self._last_repartition is not None:
            self._log_first_step(records)
        if self.settle > 0:
            self.settle -= 1
            return None
        plan = self.engine.plan
        fwd, bwd = stage_medians(records, plan.num_stages)
        self.monitor.update(fwd, bwd)
        if not self.controller.calibrated:
            # Clean costs from the medians over several windows' steps: one window of a
            # GPU that is still ramping its clocks or tuning kernels would bias every later
            # slowdown estimate of that device.
            self._calib += records
            self._calib_windows += 1
            if self._calib_windows < self.adapt.calibrate_windows:
                return None
            self.controller.calibrate(plan, *stage_medians(self._calib, plan.num_stages))
            if self.log is not None:
                self.log.event("calibrated", step=step, steps=len(self._calib))
            self._calib = []
            return None
        if self.monitor.windows < 2:
            # One window under a new plan is too little to judge it by: a stage left with one
            # or two layers gives a noisy slowdown estimate, and acting on it makes plans flap.
            return None
        if self.controller.refit_pending:
            # The first trusted window under the new plan: with the one before the move it
            # measures two splits of the same layers, which fixes what the moved layers cost.
            info = self.controller.refit(plan, self.monitor.fwd, self.monitor.bwd)
            if self.log is not None:
                self.log.event("refit", step=step, **info)
        if self._judge is not None:
            revert = self._judge_move(step, records)
            if revert is not None:
                return None
        else:
            self.controller.quiet_window()
        t0 = time.perf_counter()
        telemetry = tels if self.controller.mode_used != "measured" else None
        decision = self.controller.decide(
            step=step + 1,
            plan=plan,
            fwd_step_ms=self.monitor.fwd,
            bwd_step_ms=self.monitor.bwd,
            telemetry=telemetry,
            noise=stage_noise(records, plan.num_stages) if self.adapt.noise_z > 0 else None,
        )
        new_plan = self._agree(decision.plan if decision.repartition else None)
        decide_ms = (time.perf_counter() - t0) * 1e3
        if self.log is not None:
            self.log.event("decision", **decision.to_dict())
        if new_plan is None:
            return decision
        predicted = round(1 - decision.proposed_ms / max(decision.current_ms, 1e-9), 4)
        before = median_step(records)
        self._apply(new_plan, step=step, before_ms=before, decide_ms=decide_ms)
        self._judge = (before, predicted, plan)
        return decision

    def _judge_move(self, step: int, records: list[dict]) -> Plan | None:
        """The new plan's first trusted window: did the last move pay, as measured?

        A move that made steps clearly slower is undone at once: the plan before it was
        measured to be better, whatever the speed model believed; the controller does not
        propose it again under the same conditions. Returns the plan reverted to, if any.
        """
        assert self._judge is not None
        before, predicted, previous = self._judge
        self._judge = None
        after = median_step(records)
        paid = self.controller.judge(before, after, predicted)
        worse = self.controller.slower(before, after)
        t0 = time.perf_counter()
        # Every rank holds the same gathered numbers; the writer's verdict is still broadcast.
        target = self._agree(previous if worse and self.adapt.mode != "restart" else None)
        if self.log is not None:
            self.log.event(
                "judged",
                step=step,
                before_ms=before,
                after_ms=after,
                predicted_gain=predicted,
                achieved_gain=round(1 - after / max(before, 1e-9), 4),
                paid=paid,
                reverted=target is not None,
                trust=round(self.controller.trust, 4),
            )
        if target is not None:
            self._apply(
                target, step=step, before_ms=after, decide_ms=(time.perf_counter() - t0) * 1e3
            )
        return target

    def _apply(self, new_plan: Plan, *, step: int, before_ms: float, decide_ms: float) -> None:
        """Move to ``new_plan`` after ``step`` (live, or by relaunch in restart mode);
        ``before_ms``: the median step of the window that decided it."""
        if self.adapt.mode == "restart":
            if self.restart is None:
                raise RuntimeError("restart mode needs the training loop's restart hook")
            self.restart(self, new_plan, step + 1, decide_ms)
        from dynpipe.runtime.migrate import repartition

        old = self.engine.plan
        stats = repartition(self.engine, new_plan, beat=self.beat)
        pause_ms = decide_ms + (stats.transfer_s + stats.rebuild_s) * 1e3
        self.controller.applied(step + 1, pause_ms)
        self.monitor.reset(new_plan.num_stages)
        self.settle = self.adapt.settle_windows
        moved = self._bytes(stats)  # collective: every rank takes part
        if self.log is not None:
            self.log.event(
                "repartition",
                step=step + 1,
                mode=self.controller.mode_used,
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
        self._last_repartition = {"step": step + 1, "before_ms": before_ms}

    def _log_first_step(self, records: list[dict]) -> None:
        """The first step under a new plan, next to the steps before and after it: what the
        repartition cost beyond its logged pause (new buffers, the schedule's first run)."""
        info, self._last_repartition = self._last_repartition, None
        first = next((r for r in records if r["step"] == info["step"]), None)
        if first is None or self.log is None:
            return
        rest = [r for r in records if r["step"] != info["step"]]
        self.log.event(
            "first_step",
            step=info["step"],
            first_step_ms=first["step_ms"],
            before_ms=info["before_ms"],
            after_ms=median_step(rest) if rest else None,
        )

    def _bytes(self, stats) -> int:
        # Every rank knows only what it sent; the sum over ranks is the bytes moved.
        t = torch.tensor([stats.bytes_sent], dtype=torch.int64, device=self.topo.device)
        if self.topo.world_size > 1:
            dist.all_reduce(t)
        return int(t.item())

    def _agree(self, plan: Plan | None) -> Plan | None:
        """The writer's decision, broadcast: ranks never act on different plans."""
        if self.topo.world_size == 1:
            return plan
        cur = self.engine.plan
        n = cur.num_stages
        t = torch.zeros(n + 2, dtype=torch.int64, device=self.topo.device)
        src = cur.stages[-1].rank
        if self.topo.rank == src and plan is not None:
            t[0] = 1
            t[1:] = torch.tensor([st.start for st in plan.stages] + [plan.num_layers])
        dist.broadcast(t, src=src)
        if int(t[0]) == 0:
            return None
        cuts = t[1:].tolist()
        if self.topo.rank == src and plan is not None:
            return plan
        return Plan.from_bounds(
            self.engine.model,
            list(itertools.pairwise(cuts)),
            ranks=cur.ranks,
            schedule=cur.schedule,
            microbatches=cur.microbatches,
            meta={**cur.meta, "method": f"controller:{self.controller.mode_used}"},
        )


def stage_medians(records: list[dict], num_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-stage median forward and backward ms over the steps of ``records``.

    Medians, not means: one step stalled by something else on the machine must not look
    like a slowed device.
    """
    fwd = [np.median([r["stages"][s]["fwd_ms"] for r in records]) for s in range(num_stages)]
    bwd = [np.median([r["stages"][s]["bwd_ms"] for r in records]) for s in range(num_stages)]
    return np.array(fwd), np.array(bwd)


def stage_noise(records: list[dict], num_stages: int) -> np.ndarray:
    """Per stage, the relative standard error of the median of its compute time per step
    over ``records``: 1.25 x the robust spread (1.48 x median absolute deviation) over the
    square root of the count, relative to the median."""
    out = np.zeros(num_stages)
    n = len(records)
    for s in range(num_stages):
        x = np.array([r["stages"][s]["fwd_ms"] + r["stages"][s]["bwd_ms"] for r in records])
        med = float(np.median(x))
        mad = float(np.median(np.abs(x - med)))
        out[s] = 1.253 * 1.4826 * mad / np.sqrt(max(n, 1)) / max(med, 1e-9)
    return out


def median_step(records: list[dict]) -> float:
    return round(float(np.median([r["step_ms"] for r in records])), 4)
