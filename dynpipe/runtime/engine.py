"""The per-rank pipeline engine: build a stage from a plan, run training steps on it.

One ``PipelineEngine`` per process. It owns this rank's ``StageModule``, its optimizer and
the torch pipelining stage and schedule, and can rebuild all of them for a new plan while
keeping the process group (live repartitioning hands it the moved layers and state).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from dynpipe.errors import UserError
from dynpipe.models.base import LayeredModel
from dynpipe.planner.plan import Plan
from dynpipe.runtime.optim import OptimConfig, build_optimizer, export_state, import_state, lr_at
from dynpipe.runtime.stage import StageModule, TimedPipelineStage, boundary_examples
from dynpipe.runtime.timing import StageTimer, StepTiming
from dynpipe.runtime.topology import Topology

__all__ = [
    "EngineConfig",
    "NonFiniteLoss",
    "PipelineEngine",
    "StepResult",
    "check_batch",
    "clip_coefficient",
    "fill_grad_norms",
    "param_slots",
]

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class NonFiniteLoss(UserError):
    """The loss became NaN or infinite: training stops rather than corrupting weights."""


@dataclass(frozen=True)
class EngineConfig:
    """How a stage runs (the plan says *what* it holds).

    batch_size: samples per optimizer step, split into ``plan.microbatches`` microbatches.
    bf16: run layers under bfloat16 autocast (CUDA only) and send bf16 activations.
    timing: per-microbatch compute timers (cheap; off only to measure their cost).
    """

    batch_size: int
    optim: OptimConfig = field(default_factory=OptimConfig)
    bf16: bool = False
    timing: bool = True


@dataclass
class StepResult:
    """What one training step produced on this rank (loss is the global mean loss).

    ``end_time``: wall-clock time (``time.time()``) at which the step finished here.
    """

    step: int
    loss: float
    lr: float
    grad_norm: float | None
    step_ms: float
    timing: StepTiming
    end_time: float = 0.0


def param_slots(model: LayeredModel) -> dict[str, int]:
    """Global index of every parameter ``"<layer>.<param>"`` in model order.

    The global gradient norm is computed over a vector with one slot per parameter that every
    rank fills for the parameters it holds; summing it across ranks adds only zeros, so the
    norm is bit-identical to the one computed by a single process.
    """
    slots: dict[str, int] = {}
    for i, spec in enumerate(model.layers):
        for pname, _ in model.build_layer(i, device="meta").named_parameters():
            slots[f"{spec.name}.{pname}"] = len(slots)
    return slots


def fill_grad_norms(
    vec: torch.Tensor, named_params: dict[str, nn.Parameter], slots: dict[str, int]
) -> None:
    """Write each held parameter's gradient norm into its global slot of ``vec``."""
    names = [n for n, p in named_params.items() if p.grad is not None]
    if not names:
        return
    norms = torch._foreach_norm([named_params[n].grad.detach() for n in names], 2)
    idx = torch.tensor([slots[n] for n in names], device=vec.device)
    vec[idx] = torch.stack(norms).to(vec.dtype)


def clip_coefficient(norms: torch.Tensor, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Total norm of per-parameter norms and the factor that clips it to ``max_norm``."""
    total = torch.linalg.vector_norm(norms, 2)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return total, coef


class PipelineEngine:
    """This rank's stage of a pipeline, built from ``plan`` for ``model``."""

    def __init__(
        self,
        model: LayeredModel,
        plan: Plan,
        *,
        topo: Topology,
        config: EngineConfig,
        group: dist.ProcessGroup | None = None,
        layers: nn.ModuleDict | None = None,
    ) -> None:
        self.model = model
        self.topo = topo
        self.config = config
        self.group = group
        self.slots = param_slots(model)
        self.timer = StageTimer(device=topo.device, enabled=config.timing)
        self._build(plan, layers=layers, opt_state=None)

    # ---- construction ------------------------------------------------------------------
    def _build(
        self,
        plan: Plan,
        *,
        layers: nn.ModuleDict | None,
        opt_state: dict[str, torch.Tensor] | None,
    ) -> None:
        plan.validate(self.model, self.topo.world_size)
        check_batch(plan, self.config.batch_size)
        self.plan = plan
        self.stage_index = plan.stage_of_rank(self.topo.rank)
        if self.stage_index is None:
            raise UserError(
                f"rank {self.topo.rank} holds no stage in {plan!r}; give every rank a stage"
            )
        st = plan.stages[self.stage_index]
        if layers is None:
            layers = self.model.build_range(st.start, st.stop, device=self.topo.device)
        bf16 = self.config.bf16 and self.topo.is_cuda
        wire = torch.bfloat16 if bf16 else torch.float32
        is_last = self.stage_index == plan.num_stages - 1
        self.module = StageModule(
            layers,
            autocast_dtype=torch.bfloat16 if bf16 else None,
            out_dtype=torch.float32 if is_last else wire,
            probe=self.timer.layers,
        )
        self.named_params = {
            f"{lname}.{pname}": p
            for lname, layer in self.module.layers.items()
            for pname, p in layer.named_parameters()
        }
        self.optimizer = build_optimizer(list(self.named_params.values()), self.config.optim)
        if opt_state:
            import_state(self.optimizer, self.named_params, opt_state)
        mb = self.config.batch_size // plan.microbatches
        inp, out = boundary_examples(
            self.model, plan, self.stage_index, microbatch_size=mb, wire_dtype=wire
        )
        # Stage indices map to ranks through the plan; torch pipelining addresses peers by
        # stage index within the group, so the group ranks must follow pipeline order.
        self.pipe_stage = TimedPipelineStage(
            self.module,
            stage_index=self.stage_index,
            num_stages=plan.num_stages,
            device=self.topo.device,
            input_args=inp,
            output_args=out,
            group=self.group,
            timer=self.timer,
        )
        self.schedule = _SCHEDULES[plan.schedule](
            self.pipe_stage, n_microbatches=plan.microbatches, loss_fn=self.model.loss_fn
        )

    def rebuild(
        self, plan: Plan, *, layers: nn.ModuleDict, opt_state: dict[str, torch.Tensor]
    ) -> None:
        """Become the stage ``plan`` gives this rank, from the given layers and their state.

        The process group, the timer (and its emulated dilation) and the slot map stay.
        """
        self._build(plan, layers=layers, opt_state=opt_state)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.plan.num_stages - 1

    # ---- training ----------------------------------------------------------------------
    def step(
        self,
        step: int,
        batch: tuple[torch.Tensor, torch.Tensor] | None,
        *,
        sample_layers: bool = False,
    ) -> StepResult:
        """One optimizer step over ``batch`` (the whole batch; split into microbatches here).

        Only the first stage reads the inputs and only the last the targets; a middle stage
        may pass ``None`` (it receives activations instead). ``sample_layers``: also time
        every layer this stage holds (``StepResult.timing.layers``).
        """
        dev = self.topo.device
        x, y = batch if batch is not None else (None, None)
        self.timer.sample_layers(sample_layers)
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if self.is_first and self.is_last:
            self.schedule.step(x.to(dev, non_blocking=True), target=y.to(dev), losses=losses)
        elif self.is_first:
            self.schedule.step(x.to(dev, non_blocking=True))
        elif self.is_last:
            self.schedule.step(target=y.to(dev, non_blocking=True), losses=losses)
        else:
            self.schedule.step()
        t_sched = time.perf_counter()

        # One small all-reduce per step carries the loss (held by the last stage) and, when
        # clipping, every parameter's gradient norm in its global slot. Nothing here waits on
        # the host before the optimizer step is queued: a stage's update overlaps the other
        # stages' backward tails exactly as in a plain pipelining loop.
        clip = self.config.optim.clip_grad
        n = len(self.slots) if clip > 0 else 0
        vec = torch.zeros(n + 1, dtype=torch.float32, device=dev)
        if clip > 0:
            fill_grad_norms(vec, self.named_params, self.slots)
        if self.is_last:
            vec[n] = torch.stack([loss.detach().float() for loss in losses]).mean()
        work = None
        if self.topo.world_size > 1:
            work = dist.all_reduce(vec, group=self.group, async_op=True)
        total = None
        if clip > 0:
            if work is not None:
                work.wait()
            total, coef = clip_coefficient(vec[:n], clip)
            grads = [p.grad for p in self.named_params.values() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        lr = lr_at(step, self.config.optim)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if work is not None:
            work.wait()
        # The step's one host synchronisation: it also completes the timing events, which sit
        # on the same stream before it.
        loss = float(vec[n])
        t1 = time.perf_counter()
        if not math.isfinite(loss):
            raise NonFiniteLoss(
                f"loss is {loss} at step {step}; lower --lr (now {self.config.optim.lr}), "
                "enable --clip-grad, or check the data (weights of this step are discarded; "
                "resume from the last checkpoint)"
            )
        grad_norm = float(total) if total is not None else None
        timing = self.timer.collect((t_sched - t0) * 1e3)
        return StepResult(
            step=step,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            step_ms=(t1 - t0) * 1e3,
            timing=timing,
            end_time=time.time(),
        )

    # ---- state by name -----------------------------------------------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers of this stage, keyed ``<layer>.<name>``."""
        return {
            f"{lname}.{k}": v
            for lname, layer in self.module.layers.items()
            for k, v in layer.state_dict().items()
        }

    def optim_state(self) -> dict[str, torch.Tensor]:
        return export_state(self.optimizer, self.named_params)


def check_batch(plan: Plan, batch_size: int) -> None:
    """Batch/microbatch/schedule combinations that cannot run, as one-line errors."""
    if batch_size % plan.microbatches:
        raise UserError(
            f"batch size {batch_size} does not split into {plan.microbatches} equal microbatches; "
            f"use a batch size divisible by {plan.microbatches}"
        )
    if plan.schedule == "1f1b" and plan.microbatches < plan.num_stages:
        raise UserError(
            f"1F1B needs at least as many microbatches as stages ({plan.microbatches} < "
            f"{plan.num_stages}); use --microbatches {plan.num_stages} or more, or --schedule gpipe"
        )
