"""The per-rank pipeline engine: build a stage from a plan, run training steps on it.

One ``PipelineEngine`` per process. It owns this rank's ``StageModule``, its optimizer and
the torch pipelining stage and schedule, and can rebuild all of them for a new plan while
keeping the process group (live repartitioning hands it the moved layers and state).

Data x pipeline parallelism (``plan.dp > 1``, a ``Mesh`` of ``dp`` x ``pp`` ranks): every
replica runs the plan's stages on its own ranks over the mesh's ``pp`` group and takes its
share of each step's batch (``plan.replica_slice``). Each stage's gradients are summed
across its ``dp`` group by torch's ``DistributedDataParallel`` wrapped around the stage
module (``dataparallel.ReplicaReducer``, which says why DDP and not ``replicate`` or a
hand-written reduce), overlapped with the last microbatch's backward, then divided by the
step's microbatch count: with any batch shares the update is the full batch's. The loss
and the global gradient-norm clipping stay one small all-reduce over every rank: each
replica's last stage adds its microbatches' loss sum, and replica 0 alone fills the norm
slots (every replica holds the same averaged gradients after the reduce).

Evaluation (``evaluate``) runs held-out batches through the same stage and schedule with
torch's forward-only mode of that schedule, ``schedule.eval(...)`` (torch.distributed.
pipelining switches the schedule's backward off for the call, and its stage re-prepares
its receive buffers without ``requires_grad``), under ``torch.no_grad()`` and with every
layer in eval mode (BatchNorm statistics, no dropout), restored afterwards. Using the
schedule itself rather than a forward loop of our own keeps one P2P path for training and
evaluation, the same microbatches in the same order, and whatever stage the engine holds
after a repartition: the rebuilt schedule is the one evaluated. The last stage turns each
microbatch's output and loss into sums (``eval_sums``) that the single-process reference
computes the same way, so a pipelined evaluation is bit-identical to an unsplit one on CPU.

Elastic plans (one replica): a plan may leave ranks idle. An idle rank holds no layer and
no optimizer state, keeps its process and its place in the default group, and takes part
in every collective the step, the evaluation and the adaptation loop make (the loss and
norm all-reduce with zeros); on sampled steps it times one layer of the model on its
device (``probe``), so the controller can see when the device recovers. The active stages
talk over a process group of their own ranks (torch pipelining needs a group no larger
than its stage count), made once per set of ranks by every rank together.

Light ranks (one pipeline): a rank that holds layers but too little work for its timers to
read its device (an embedding alone: kernels short enough to run between an interferer's
on a time-sliced GPU) is told by the adaptation loop to probe as an idle rank does
(``probe_while_light``, the policy's ``light_probes``): on sampled steps it times one
microbatch of a heavy layer it does not hold, on a private copy, before its stage's part
of the step (see ``step``), and the reading comes back in ``StepResult.probe``.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from dynpipe.errors import UserError
from dynpipe.models.base import LayeredModel
from dynpipe.planner.costs import CostModel
from dynpipe.planner.plan import DELAYED_SCHEDULES, MULTI_SCHEDULES, Plan, check_batch
from dynpipe.runtime.compiled import compile_layers
from dynpipe.runtime.mesh import Mesh
from dynpipe.runtime.optim import OptimConfig, build_optimizer, export_state, import_state, lr_at
from dynpipe.runtime.scaler import LossScaler, ScalerConfig
from dynpipe.runtime.stage import StageModule, TimedPipelineStage, boundary_examples
from dynpipe.runtime.ties import (
    check_freeze,
    secondary_names,
    spread_ties,
    sum_tied_grads,
    tied_shapes,
)
from dynpipe.runtime.timing import LayerTiming, StageTimer, StepTiming, queue_ahead
from dynpipe.runtime.topology import Topology
from dynpipe.runtime.twobw import WeightVersions, split_newest

__all__ = [
    "EngineConfig",
    "EvalResult",
    "NonFiniteLoss",
    "PipelineEngine",
    "StepResult",
    "clip_coefficient",
    "eval_result",
    "eval_sums",
    "fill_grad_norms",
    "param_slots",
]

# 2bw runs 1F1B's order; what differs is its update (``dynpipe.runtime.twobw``).
_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "2bw": Schedule1F1B}
_IGNORE_INDEX = -100  # targets a loss leaves out (masked-LM positions that were not chosen)

Batch = tuple[torch.Tensor, torch.Tensor]


class NonFiniteLoss(UserError):
    """The loss became NaN or infinite: training stops rather than corrupting weights."""


@dataclass(frozen=True)
class EngineConfig:
    """How a stage runs (the plan says *what* it holds).

    batch_size: samples per optimizer step over all replicas, split into
        ``plan.total_microbatches`` microbatches.
    bf16: run layers under bfloat16 autocast (CUDA only) and send bf16 activations.
    timing: per-microbatch compute timers (cheap; off only to measure their cost).
    bucket_mb: data parallelism: DDP's gradient bucket size in MiB.
    fp16: run layers under float16 autocast (CUDA only), send fp16 activations, and scale
        the loss with one dynamic scale for the whole pipeline (``dynpipe.runtime.scaler``).
    loss_scale: the loss scale's schedule; given without ``fp16`` it scales a float32 run
        (its skips and scale changes are then testable on CPU).
    recompute: which layers this stage recomputes in its backward: ``none``, ``all``,
        ``auto`` (the planner's choice for the stage's layers under ``memory_bytes``, made
        again at every rebuild), or None: the plan's own list.
    memory_bytes: what this stage's device may hold (``--recompute auto``).
    compile: ``torch.compile`` backend each held layer is compiled with, in place and one
        layer at a time (``dynpipe.runtime.compiled``); None: eager.
    """

    batch_size: int
    optim: OptimConfig = field(default_factory=OptimConfig)
    bf16: bool = False
    timing: bool = True
    bucket_mb: float = 25.0
    compile: str | None = None
    fp16: bool = False
    loss_scale: ScalerConfig | None = None
    recompute: str | None = None
    memory_bytes: float | None = None

    @property
    def amp_dtype(self) -> torch.dtype | None:
        """The autocast dtype asked for (applied on CUDA only)."""
        return torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else None


@dataclass
class StepResult:
    """What one training step produced on this rank (loss is the global mean loss).

    ``end_time``: wall-clock time (``time.time()``) at which the step finished here.
    ``between_ms``: this rank's time from the end of its previous step to the start of this
    one (its batch, the adaptation loop's work between steps, a move's pause); 0 for the
    process's first step.
    ``probe``: ``(layer, fwd_ms, bwd_ms)`` of the probe this rank ran on the step (an idle
    rank's, or a light rank's: see ``PipelineEngine.step``), else None.
    """

    step: int
    loss: float
    lr: float
    grad_norm: float | None
    step_ms: float
    timing: StepTiming
    end_time: float = 0.0
    probe: tuple[int, float, float] | None = None
    between_ms: float = 0.0
    # With a loss scale: the scale the step's loss was multiplied by, and whether an inf or
    # NaN gradient on some rank made every rank skip its optimizer step.
    loss_scale: float | None = None
    skipped: bool = False


@dataclass(frozen=True)
class EvalResult:
    """A forward-only pass over held-out batches; every rank gets the same numbers.

    loss: mean loss per counted target: per sample for classification, per token for
        gpt/bert (masked-LM counts its chosen positions only).
    accuracy: top-1 accuracy over the counted targets (next-token or masked-token accuracy
        for gpt/bert); None for float (regression) targets.
    perplexity: ``exp(loss)`` for token models, else None.
    batches / samples / targets: what was evaluated; eval_ms: its wall time on this rank.
    """

    loss: float
    accuracy: float | None
    perplexity: float | None
    batches: int
    samples: int
    targets: int
    eval_ms: float

    def to_dict(self) -> dict:
        return asdict(self)


def eval_sums(
    outputs: list[torch.Tensor], targets: list[torch.Tensor], losses: list[torch.Tensor]
) -> tuple[float, int, int, int]:
    """Summed loss, correct top-1 predictions, counted targets and samples of the
    microbatches of one evaluated batch (outputs, targets and losses per microbatch).

    A model's loss is a mean over the targets it counts, so loss times count sums exactly
    over microbatches of any size. The sums are taken in microbatch order in double
    precision, the same way wherever they are computed.
    """
    loss_sum, correct, counted, samples = 0.0, 0, 0, 0
    for out, y, loss in zip(outputs, targets, losses, strict=True):
        if y.dtype.is_floating_point:
            n = y.numel()
        else:
            mask = y != _IGNORE_INDEX
            n = int(mask.sum())
            if out.shape[:-1] == y.shape:
                correct += int(((out.argmax(dim=-1) == y) & mask).sum())
        loss_sum += float(loss) * n
        counted += n
        samples += int(y.shape[0])
    return loss_sum, correct, counted, samples


def eval_result(
    sums: torch.Tensor, *, model: LayeredModel, batches: int, eval_ms: float
) -> EvalResult:
    """``EvalResult`` from ``[loss_sum, correct, counted, samples]``."""
    loss_sum, correct, counted, samples = sums.tolist()
    spec = model.input_spec
    classes = not spec.target_dtype.is_floating_point
    loss = loss_sum / counted if counted else float("nan")
    tokens = classes and len(spec.target_shape) > 0
    return EvalResult(
        loss=loss,
        accuracy=correct / counted if classes and counted else None,
        perplexity=(math.exp(loss) if loss < 700 else math.inf) if tokens else None,
        batches=batches,
        samples=int(samples),
        targets=int(counted),
        eval_ms=eval_ms,
    )


def param_slots(model: LayeredModel) -> dict[str, int]:
    """Global index of every parameter ``"<layer>.<param>"`` in model order.

    The global gradient norm is computed over a vector with one slot per parameter that every
    rank fills for the parameters it holds; summing it across ranks adds only zeros, so the
    norm is bit-identical to the one computed by a single process.
    """
    slots: dict[str, int] = {}
    copies = secondary_names(model)  # a tied parameter counts once in the norm
    for i, spec in enumerate(model.layers):
        for pname, _ in model.build_layer(i, device="meta").named_parameters():
            if f"{spec.name}.{pname}" not in copies:
                slots[f"{spec.name}.{pname}"] = len(slots)
    return slots


def fill_grad_norms(
    vec: torch.Tensor, named_params: dict[str, nn.Parameter], slots: dict[str, int]
) -> None:
    """Write each held parameter's gradient norm into its global slot of ``vec``."""
    names = [n for n, p in named_params.items() if p.grad is not None and n in slots]
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
    """This rank's stage of a pipeline, built from ``plan`` for ``model``.

    mesh: this rank's place among ``plan.dp`` replicas (default: one pipeline over the world,
        whose stages talk over ``group``, the default group if None).
    """

    def __init__(
        self,
        model: LayeredModel,
        plan: Plan,
        *,
        topo: Topology,
        config: EngineConfig,
        group: dist.ProcessGroup | None = None,
        layers: nn.ModuleDict | None = None,
        mesh: Mesh | None = None,
    ) -> None:
        self.model = model
        self.topo = topo
        self.config = config
        self.mesh = (
            mesh if mesh is not None else Mesh.single(rank=topo.rank, world_size=topo.world_size)
        )
        self._own_group = group  # one pipeline's group (a reshape may come back to it)
        self.group = self.mesh.pp_group if self.mesh.dp > 1 else group
        self.slots = param_slots(model)
        self._tie_shapes = tied_shapes(model) if model.ties else None
        self._tie_spread = False  # copies of a tied parameter on more than one stage
        self.timer = StageTimer(device=topo.device, enabled=config.timing)
        self._synced = False  # replicas' copies made identical by DDP's first build
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self.plan: Plan | None = None
        self.probe_layer: int = 0  # the layer an idle rank times (see ``_probe``)
        # The layer a light rank times (``probe_while_light``); None: it does not probe.
        self.light_probe: int | None = None
        self._probe_copy: tuple[int, nn.Module] | None = None  # (layer, private copy)
        # The host's time to issue one microbatch of the probe layer (``_probe``'s lead).
        self._probe_issue_ms = 0.0
        self.probing = True  # off for a rank handed back to its owner (``release``)
        # When this rank's last step ended (``perf_counter``; None before the first).
        self._last_end: float | None = None
        # --freeze: layers [0, frozen) train no more (see ``freeze``); with ``track_grads``
        # each step adds every held layer's squared gradient norm to ``grad_sq``.
        self.frozen = 0
        self.track_grads = False
        self.grad_sq = torch.zeros(len(model), dtype=torch.float64)
        self.grad_steps = 0
        self._index = {name: i for i, name in enumerate(model.layer_names)}
        # One loss scale for the pipeline; equal on every rank (``LossScaler``).
        self.scaler = LossScaler(config.loss_scale) if config.fp16 or config.loss_scale else None
        # Called after the backward, before unscaling (tests poison a gradient here).
        self.grad_hook: Callable[[PipelineEngine, int], None] | None = None
        self._mem_costs: CostModel | None = None
        self.recomputed: tuple[str, ...] = ()
        self._peak_bytes: float | None = None  # --recompute auto's, from its memory model
        self._peak_cache: tuple[Any, float | None] | None = None
        self._build(plan, layers=layers, opt_state=None)

    @property
    def predicted_peak_bytes(self) -> float | None:
        """This stage's predicted peak memory: under ``--recompute auto`` its memory model's
        (measured on a GPU); else the meta-trace estimate, made on first read (building a
        stage runs no measuring forward passes: ``predict_peak_bytes(measure=True)``)."""
        if self._peak_bytes is not None or self.stage_index is None:
            return self._peak_bytes
        if self._peak_cache is None or self._peak_cache[0] is not self.plan:
            self._peak_cache = (self.plan, self.predict_peak_bytes(measure=False))
        return self._peak_cache[1]

    def predict_peak_bytes(self, *, measure: bool) -> float | None:
        """This stage's predicted peak memory; ``measure``: on a GPU, with each distinct
        layer's saved activations measured there (``dynpipe.runtime.memory``)."""
        from dynpipe.runtime.memory import estimate_peak

        if self._peak_bytes is not None or self.stage_index is None:
            return self._peak_bytes
        return estimate_peak(
            self.model,
            self.plan,
            self.stage_index,
            mode=self.config.recompute,
            microbatches=self.microbatches or self.plan.microbatches,
            batch_size=self.config.batch_size,
            optimizer=self.config.optim.name,
            half=self.config.amp_dtype is not None,
            device=self.topo.device,
            measure=measure,
        )

    # ---- construction ------------------------------------------------------------------
    def _build(
        self,
        plan: Plan,
        *,
        layers: nn.ModuleDict | None,
        opt_state: dict[str, torch.Tensor] | None,
    ) -> None:
        plan.validate(self.model, self.topo.world_size, elastic=True)
        if plan.dp != self.mesh.dp:
            raise UserError(
                f"plan has {plan.dp} replicas but this run's mesh has {self.mesh.dp}; a run "
                "keeps its dp degree: resume from a checkpoint to change it"
            )
        check_batch(plan, self.config.batch_size)
        if plan.schedule in DELAYED_SCHEDULES and self.scaler is not None:
            raise UserError(
                f"schedule {plan.schedule} does not run with a loss scale (--fp16): a skipped "
                "update would have to hold both weight versions back; use --bf16 or 1f1b"
            )
        old, self.plan = self.plan, plan
        self._tie_spread = spread_ties(
            self.model, [set(self.model.layer_names[s.start : s.stop]) for s in plan.stages]
        )
        self.stage_index = plan.stage_of_rank(self.mesh.pp_rank)
        # Every stage this rank holds, in pipeline order (several: virtual stages).
        self.local_stages = plan.stages_of_rank(self.mesh.pp_rank)
        pipe_group = self._pipe_group(plan)
        if self.stage_index is None:
            if old is not None and old.stage_of_rank(self.mesh.pp_rank) is not None:
                # The layer it last held: its clean cost is known, so its time here now
                # reads as the device's slowdown.
                self.probe_layer = old.stages[old.stage_of_rank(self.mesh.pp_rank)].start
            self._build_idle()
            return
        replica = self.mesh.replica
        self.dropped = replica in plan.dropped
        # A dropped replica (partial reduce) computes nothing; it takes part in the reduce.
        self.microbatches = 0 if self.dropped else plan.replica_microbatches[replica]
        if layers is None:
            layers = nn.ModuleDict()
            for s in self.local_stages:
                st = plan.stages[s]
                layers.update(self.model.build_range(st.start, st.stop, device=self.topo.device))
        if self.config.compile is not None:
            # Kept layers stay compiled; received ones join them (compiled code is cached
            # by class and shapes, so a layer of a kind this rank already ran costs nothing).
            compile_layers(
                layers.values(), backend=self.config.compile, model_layers=len(self.model)
            )
        amp = self.config.amp_dtype if self.topo.is_cuda else None
        wire = amp or torch.float32
        is_last = self.stage_index == plan.num_stages - 1
        multi = plan.schedule in MULTI_SCHEDULES
        if multi:
            self._check_multi(plan)
            self.recomputed = tuple(n for s in self.local_stages for n in self._recompute(plan, s))
        else:
            self.recomputed = self._recompute(plan)
        self.module = StageModule(
            layers,
            autocast_dtype=amp,
            out_dtype=torch.float32 if is_last else wire,
            probe=self.timer.layers,
            recompute=frozenset(self.recomputed),
        )
        self.named_params = {
            f"{lname}.{pname}": p
            for lname, layer in self.module.layers.items()
            for pname, p in layer.named_parameters()
        }
        self._set_optimizer(opt_state)
        mb = self.config.batch_size // plan.total_microbatches
        inp, out = boundary_examples(
            self.model, plan, self.stage_index, microbatch_size=mb, wire_dtype=wire
        )
        if multi:
            self._stage_parts = (plan, self.module, inp, out, pipe_group)
            self._build_chunks(plan, amp=amp, wire=wire, mb=mb)
            self.reducer = None
            self.pipe_stage, self.schedule = self._new_schedule()
            self._trained = False
            return
        self.timer.set_probes(1)
        self.chunk_modules = [self.module]
        submod: nn.Module = self.module
        self.reducer = None
        # A stage whose layers are all frozen (--freeze) has no gradient to average (and
        # DDP refuses a module with none); its copies in the other replicas hold the same.
        if self.mesh.dp > 1 and any(p.requires_grad for p in self.named_params.values()):
            from dynpipe.runtime.dataparallel import ReplicaReducer

            _check_scale_grads()

            self.reducer = ReplicaReducer(
                self.module,
                mesh=self.mesh,
                timer=self.timer,
                init_sync=not self._synced,
                bucket_mb=self.config.bucket_mb,
            )
            self._synced = True
            submod = self.reducer.module
        self._stage_parts = (plan, submod, inp, out, pipe_group)
        self.pipe_stage, self.schedule = self._new_schedule()
        self._trained = False  # the schedule has yet to run a training step

    def _check_multi(self, plan: Plan) -> None:
        """What virtual stages do not run with, as one-line errors."""
        if self.config.recompute == "auto":
            raise UserError(
                f"--recompute auto plans one stage per rank, but {plan.schedule} gives this "
                "rank several; use --recompute all or none with virtual stages"
            )
        if plan.pp != self.topo.world_size:
            raise UserError(
                f"{plan.schedule} runs on every rank of the world ({self.topo.world_size}) "
                f"but the plan uses {plan.pp}; plans that leave ranks idle run gpipe or 1f1b"
            )

    def _build_chunks(self, plan: Plan, *, amp: torch.dtype | None, wire: torch.dtype, mb: int):
        """One ``StageModule`` per virtual stage over the held layers, each with its own
        layer probe, and the receive/send examples of each."""
        probes = self.timer.set_probes(len(self.local_stages))
        self.chunk_modules, self._chunk_io = [], []
        for v, s in enumerate(self.local_stages):
            st = plan.stages[s]
            names = self.model.layer_names[st.start : st.stop]
            self.chunk_modules.append(
                StageModule(
                    nn.ModuleDict({n: self.module.layers[n] for n in names}),
                    autocast_dtype=amp,
                    out_dtype=torch.float32 if s == plan.num_stages - 1 else wire,
                    probe=probes[v],
                    recompute=frozenset(self.recomputed) & frozenset(names),
                )
            )
            self._chunk_io.append(
                boundary_examples(self.model, plan, s, microbatch_size=mb, wire_dtype=wire)
            )

    def _recompute(self, plan: Plan, stage: int | None = None) -> tuple[str, ...]:
        """The layers this stage (or ``stage`` of this rank's) recomputes under ``plan``
        (``EngineConfig.recompute``); sets its predicted peak memory under ``auto``
        (``predicted_peak_bytes``)."""
        from dynpipe.runtime.memory import stage_layers

        names, self._peak_bytes, self._mem_costs = stage_layers(
            self.model,
            plan,
            self.stage_index if stage is None else stage,
            mode=self.config.recompute,
            limit=self.config.memory_bytes,
            microbatches=self.microbatches or plan.microbatches,
            batch_size=self.config.batch_size,
            optimizer=self.config.optim.name,
            half=self.config.amp_dtype is not None,
            device=self.topo.device,
            costs=self._mem_costs,
        )
        return names

    def _new_schedule(self) -> tuple[Any, Any]:
        """A pipeline stage and schedule over the built stage module (virtual stages: a
        ``StageGroup`` of one stage per chunk and torch's multi-stage schedule)."""
        plan, submod, inp, out, pipe_group = self._stage_parts
        if plan.schedule in MULTI_SCHEDULES:
            from dynpipe.runtime.multistage import StageGroup, schedule_class

            stages = [
                TimedPipelineStage(
                    module,
                    stage_index=s,
                    num_stages=plan.num_stages,
                    device=self.topo.device,
                    input_args=io[0],
                    output_args=io[1],
                    group=pipe_group,
                    timer=self.timer,
                    probe=module._probe,
                    local=v,
                )
                for v, (s, module, io) in enumerate(
                    zip(self.local_stages, self.chunk_modules, self._chunk_io, strict=True)
                )
            ]
            group = StageGroup(stages)
            group.keep_outputs = False
            return group, schedule_class(plan.schedule)(
                stages,
                n_microbatches=plan.microbatches,
                loss_fn=self._loss_fn(),
                scale_grads=False,
            )
        # Stage indices map to ranks through the plan; torch pipelining addresses peers by
        # stage index within the group, so the group ranks must follow pipeline order.
        stage = TimedPipelineStage(
            submod,
            stage_index=self.stage_index,
            num_stages=plan.num_stages,
            device=self.topo.device,
            input_args=inp,
            output_args=out,
            group=pipe_group,
            timer=self.timer,
        )
        stage.keep_outputs = False  # training reads the losses (evaluation turns it on)
        if self.mesh.dp == 1:
            # Gradients are divided once after the step by the engine (``_divide_grads``):
            # one foreach launch, where the schedule divides parameter by parameter.
            extra = {"scale_grads": False} if _HAS_SCALE_GRADS else {}
            return stage, _SCHEDULES[plan.schedule](
                stage, n_microbatches=plan.microbatches, loss_fn=self._loss_fn(), **extra
            )
        if not self.dropped:
            # Gradients are divided once, by the step's microbatches over all replicas.
            return stage, _SCHEDULES[plan.schedule](
                stage,
                n_microbatches=self.microbatches,
                loss_fn=self._loss_fn(),
                scale_grads=False,
            )
        return stage, None

    def _loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The loss the last stage's backward starts from: scaled by the pipeline's loss
        scale (read at each call, so the schedule need not be rebuilt when it changes)."""
        scaler, loss_fn = self.scaler, self.model.loss_fn
        if scaler is None:
            return loss_fn
        return lambda out, target: scaler.scale_loss(loss_fn(out, target))

    def _set_optimizer(self, opt_state: dict[str, torch.Tensor] | None) -> None:
        """An optimizer over the held parameters that train (frozen layers' stop requiring
        gradients and hold no state); None when none does."""
        for lname, layer in self.module.layers.items():
            if self._index[lname] < self.frozen:
                layer.requires_grad_(False)
        train = {n: p for n, p in self.named_params.items() if p.requires_grad}
        self.optimizer = build_optimizer(list(train.values()), self.config.optim) if train else None
        opt_state, newest = split_newest(opt_state or {})
        if newest and self.plan.schedule not in DELAYED_SCHEDULES:
            raise UserError(
                f"the state handed to this stage holds 2bw's second weight version but the "
                f"run's schedule is {self.plan.schedule}; resume it with --schedule 2bw"
            )
        # --schedule 2bw: the parameters hold the stashed version, this the newest.
        self.versions = (
            WeightVersions(train, newest) if self.plan.schedule in DELAYED_SCHEDULES else None
        )
        if opt_state and self.optimizer is not None:
            import_state(self.optimizer, train, opt_state)

    def load_optim_state(self, state: dict[str, torch.Tensor]) -> None:
        """Install optimizer state (``optim_state``'s keys, from a checkpoint) into this
        stage's optimizer, and under 2bw its newest weight version."""
        self._set_optimizer(state)

    def freeze(self, frozen: int) -> None:
        """Freeze layers ``[0, frozen)``: their parameters stop requiring gradients and their
        optimizer state is dropped (--freeze; changes what training computes). The caller
        keeps them inside the first stage, whose input needs no gradient, so autograd never
        runs their backward."""
        if frozen < self.frozen:
            raise UserError(f"frozen layers cannot thaw ({self.frozen} -> {frozen})")
        check_freeze(self.model, frozen)
        if not self.idle and self.stage_index == 0:
            assert self.plan.stages[0].stop > frozen, (
                "the frozen prefix must leave the first stage a layer to train"
            )
        elif not self.idle:
            assert self.plan.stages[self.stage_index].start >= frozen, (
                "frozen layers beyond the first stage"
            )
        keep = {
            k: v for k, v in self.optim_state().items() if self._index[k.split(".", 1)[0]] >= frozen
        }
        self.frozen = frozen
        for p in self.named_params.values():
            p.grad = None
        if self.mesh.dp > 1 and not self.idle:
            # DDP registered the parameters that required gradients when it was built; one
            # that no longer gets any would leave its bucket waiting: the stage is rebuilt
            # (every replica freezes at the same step, so the new reducers match).
            self._build(self.plan, layers=self.module.layers, opt_state=keep)
            return
        self._set_optimizer(keep)

    def take_grad_sq(self) -> tuple[torch.Tensor, int]:
        """Per layer, the squared gradient norms summed over the steps since the last call
        (zero for layers held elsewhere), and how many steps; then reset."""
        out, n = self.grad_sq, self.grad_steps
        self.grad_sq = torch.zeros_like(out)
        self.grad_steps = 0
        return out, n

    def _add_grad_sq(self) -> None:
        names = [n for n, p in self.named_params.items() if p.grad is not None]
        self.grad_steps += 1
        if not names:
            return
        norms = torch._foreach_norm([self.named_params[n].grad.detach() for n in names], 2)
        # On the device, no host synchronisation: read once per freeze check.
        if self.grad_sq.device != norms[0].device:
            self.grad_sq = self.grad_sq.to(norms[0].device)
        idx = torch.tensor([self._index[n.split(".", 1)[0]] for n in names], device=norms[0].device)
        self.grad_sq.index_add_(0, idx, torch.stack(norms).double() ** 2)

    def _pipe_group(self, plan: Plan) -> dist.ProcessGroup | None:
        """The group the plan's stages talk over: the run's own, or for a plan that leaves
        ranks idle a group of its ranks (collective: every rank calls it with the plan)."""
        if plan.dp > 1 or plan.pp == self.topo.world_size:
            return self.group
        key = tuple(plan.ranks)
        if key not in self._groups:
            from datetime import timedelta

            # Group ranks follow global rank order; validate() keeps stages in that order.
            self._groups[key] = dist.new_group(
                ranks=list(key), timeout=timedelta(seconds=self.topo.timeout_s)
            )
        return self._groups[key]

    def _build_idle(self) -> None:
        """Hold nothing: no layer, no optimizer state, no pipeline stage or schedule."""
        if self.mesh.dp > 1:
            raise UserError(
                f"rank {self.topo.rank} holds no stage in {self.plan!r}; with --dp > 1 every "
                "rank needs a stage (plans that leave ranks idle are for one pipeline)"
            )
        self.dropped = False
        self.microbatches = 0
        self.module = StageModule(nn.ModuleDict(), probe=self.timer.layers)
        self.chunk_modules = []
        self.local_stages = []
        self.named_params = {}
        self.optimizer = None
        self.versions = None
        self.reducer = None
        self.pipe_stage = None
        self.schedule = None
        if self.topo.is_cuda:
            # What the layers it sent held goes back to the device (the caching allocator
            # would keep it reserved); the process keeps only its CUDA context.
            torch.cuda.empty_cache()

    def release(self, released: bool) -> None:
        """A rank handed back to its owner stops probing its device and frees the probe's
        layer; a reclaimed one probes again while idle."""
        self.probing = not released
        if released:
            self._probe_copy = None
            if self.topo.is_cuda:
                torch.cuda.empty_cache()

    def probe_while_light(self, layer: int | None) -> None:
        """Probe ``layer`` on sampled steps while this rank holds layers (None: stop; the
        policy's ``light_probes`` decides, the adaptation loop tells each rank its own). The
        probe's copy is freed when a light rank stops probing (an idle rank keeps its own)."""
        self.light_probe = layer
        if layer is None and not self.idle and self._probe_copy is not None:
            self._probe_copy = None
            if self.topo.is_cuda:
                torch.cuda.empty_cache()

    @property
    def idle(self) -> bool:
        """This rank holds no stage under the current plan."""
        return self.stage_index is None

    def rebuild(
        self,
        plan: Plan,
        *,
        layers: nn.ModuleDict,
        opt_state: dict[str, torch.Tensor],
        mesh: Mesh | None = None,
    ) -> None:
        """Become the stage ``plan`` gives this rank, from the given layers and their state.

        The timer (and its emulated dilation) and the slot map stay; so does the process
        group, unless ``mesh`` (a reshape to ``plan.dp`` replicas, ``--autodp``) gives this
        rank its place in another shape, whose groups were made at start-up.
        """
        if mesh is not None:
            self.mesh = mesh
            self.group = mesh.pp_group if mesh.dp > 1 else self._own_group
            # Every replica's copies arrived checksummed from one source: they are
            # identical, so DDP need not broadcast them again.
            self._synced = True
        self._build(plan, layers=layers, opt_state=opt_state)

    def warm_compiled(self) -> float:
        """Under ``--compile``, run one microbatch's forward and backward through private
        copies of this stage's layers, so that whatever the stage's first step would compile
        (a layer of a kind new to this rank, a layer now at a stage boundary that receives
        the wire dtype) compiles now; returns the seconds it took (0 when eager or idle).

        A repartition calls it as part of its pause: a first compile takes seconds, and the
        controller prices a move by its pause. The copies are built from the model's specs
        without initialisation and share the real layers' compiled code (cached by class,
        structure and shapes, not by module), under a forked RNG: training state, BatchNorm
        statistics and gradients are untouched."""
        if self.config.compile is None or self.idle or self.dropped:
            return 0.0
        if len(self.chunk_modules) > 1:
            # Each virtual stage receives its own shapes; its first step compiles them.
            return 0.0
        t0 = time.perf_counter()
        dev = self.topo.device
        inp = self._stage_parts[2]
        mb = inp.shape[0]
        copies = nn.ModuleDict()
        for lname in self.module.layers:
            i = self._index[lname]
            layer = self.model.build_layer(i, device=dev, init=False)
            layer.requires_grad_(i >= self.frozen)
            copies[lname] = layer
        compile_layers(copies.values(), backend=self.config.compile, model_layers=len(self.model))
        stage = StageModule(
            copies,
            autocast_dtype=self.module.autocast_dtype,
            out_dtype=self.module.out_dtype,
            recompute=self.module.recompute,
        )
        stage.train(self.module.training)
        with torch.random.fork_rng(devices=[dev] if self.topo.is_cuda else []):
            if self.is_first:
                x, _ = self.model.input_spec.example(mb, device=dev)
            elif inp.is_floating_point():
                x = torch.randn(inp.shape, dtype=inp.dtype, device=dev, requires_grad=True)
            else:
                x = torch.zeros(inp.shape, dtype=inp.dtype, device=dev)
            out = stage(x)
            if out.requires_grad:
                out.float().sum().backward()
        if self.topo.is_cuda:
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    @property
    def is_first(self) -> bool:
        """This rank holds the pipeline's first stage (it reads the inputs)."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """This rank holds the pipeline's last stage (it reads the targets and the loss;
        under a V-shaped schedule the first rank holds it too)."""
        return self.stage_index is not None and self.plan.num_stages - 1 in self.local_stages

    # ---- training ----------------------------------------------------------------------
    def step(
        self,
        step: int,
        batch: tuple[torch.Tensor, torch.Tensor] | None,
        *,
        sample_layers: bool = False,
        while_device_runs: Callable[[], None] | None = None,
    ) -> StepResult:
        """One optimizer step over ``batch`` (the whole batch; split into microbatches here).

        Only the first stage reads the inputs and only the last the targets; a middle stage
        may pass ``None`` (it receives activations instead). With replicas, ``batch`` is
        still the whole step's batch: each replica takes its share here.
        ``sample_layers``: also time every layer this stage holds
        (``StepResult.timing.layers``).
        ``while_device_runs``: host work (the adaptation policy) run once the whole step is
        queued and before the step's one synchronisation, so on a GPU it overlaps the
        device's work instead of leaving the device idle between two steps; it must not
        touch the device or a collective. Its time counts in the step's ``step_ms`` as far
        as it outlasts the device.

        A light rank (``light_probe`` set) probes on sampled steps first, before its stage's
        part of the step: the device is idle then (the last step ended with its
        synchronisation), so the probe's time is the device's and no kernel of the stage
        mixes with it, and the stage's own layer timings start after it. It costs one
        microbatch of the probe layer's forward and backward once a window (plus one
        untimed run when the layer is new to the rank). Past the first stage it overlaps
        the wait for the first input (the upstream stages' first forwards), and costs the
        step only what it outlasts that wait by; the first stage's probe delays the
        pipeline's start by its whole time (at the step's end it would delay the next
        step's start the same: the other stages wait for its activations either way).
        Counted in this rank's ``step_ms``. Training is untouched: a private copy of the
        layer, under a forked RNG, on random input.
        """
        if self.idle:
            return self._idle_step(
                step, sample_layers=sample_layers, while_device_runs=while_device_runs
            )
        dev = self.topo.device
        x, y = batch if batch is not None else (None, None)
        dp = self.mesh.dp > 1
        if dp:
            x, y = self._share(x), self._share(y)
        t0 = time.perf_counter()
        between = self._between(t0)
        probed = None
        if sample_layers and self.config.timing and self.probing and self.light_probe is not None:
            # Three microbatches on a GPU, as an idle rank's: one layer's single microbatch
            # is short beside a time-sliced GPU's turns, and its median is less noisy.
            got = self._probe(self.light_probe, repeats=3 if self.topo.is_cuda else 1)
            if got is not None:
                probed = (self.light_probe, float(got.fwd_ms[0]), float(got.bwd_ms[0]))
        # The gradient all-reduce runs in the last microbatch's backward: not a layer's cost.
        self.timer.sample_layers(
            sample_layers, microbatches=self.microbatches, spare_last=self.reducer is not None
        )
        for p in self.named_params.values():
            p.grad = None
        losses: list[torch.Tensor] = []
        if self.dropped:
            assert self.reducer is not None
            self.reducer.shadow()
        elif self.is_first and self.is_last:
            self.schedule.step(
                x.to(dev, non_blocking=True), target=y.to(dev), losses=losses, **_NO_OUTPUTS
            )
        elif self.is_first:
            self.schedule.step(x.to(dev, non_blocking=True))
        elif self.is_last:
            self.schedule.step(target=y.to(dev, non_blocking=True), losses=losses, **_NO_OUTPUTS)
        else:
            self.schedule.step()
        self._trained = True
        t_sched = time.perf_counter()
        if dp:
            # The reduce summed every replica's microbatches: one division makes the mean.
            self._divide_grads(self.plan.counted_microbatches)
        elif _HAS_SCALE_GRADS:
            self._divide_grads(self.plan.microbatches)
        if self.model.ties:
            sum_tied_grads(
                self.model,
                self.named_params,
                spread=self._tie_spread,
                group=self._stage_parts[4],
                device=dev,
                shapes=self._tie_shapes,
            )
        found = None
        if self.scaler is not None:
            if self.grad_hook is not None:
                self.grad_hook(self, step)
            # Unscaled before the norms: clipping and the logs see the true gradient.
            grads = [p.grad for p in self.named_params.values() if p.grad is not None]
            found = self.scaler.unscale_(grads).to(dev)
        if self.track_grads:
            self._add_grad_sq()

        # One small all-reduce per step carries the loss (held by the last stage) and, when
        # clipping, every parameter's gradient norm in its global slot. Nothing here waits on
        # the host before the optimizer step is queued: a stage's update overlaps the other
        # stages' backward tails exactly as in a plain pipelining loop.
        clip = self.config.optim.clip_grad
        n = len(self.slots) if clip > 0 else 0
        vec = torch.zeros(n + 1 + 2 * (self.scaler is not None), dtype=torch.float32, device=dev)
        if found is not None:
            # Summed over the world: > 0 iff some stage of some replica saw an inf or NaN;
            # the scales' sum checks every rank scaled by the same number.
            vec[n + 1] = found
            vec[n + 2] = self.scaler.scale
        if clip > 0 and self.mesh.replica == 0:
            # Replicas hold the same averaged gradients: one of them fills the slots.
            fill_grad_norms(vec, self.named_params, self.slots)
        if self.is_last and not dp:
            vec[n] = torch.stack([loss.detach().float() for loss in losses]).mean()
        elif self.is_last and not self.dropped:
            vec[n] = torch.stack([loss.detach().float() for loss in losses]).sum()
        if self.scaler is not None and self.is_last:
            vec[n] = vec[n] / self.scaler.scale  # the schedule's losses are the scaled ones
        work = None
        if self.topo.world_size > 1:
            # Over every replica's stages: the default group when there are replicas.
            work = dist.all_reduce(vec, group=None if dp else self.group, async_op=True)
        total = None
        skipped, scale = False, None
        if self.scaler is not None:
            if work is not None:
                work.wait()
            scale = self.scaler.scale
            _same_scale(vec[n + 2], scale, group=None if dp else self.group, step=step)
            # Every rank reads the same reduced flag: all skip, or none does.
            skipped = self.scaler.update(bool(vec[n + 1] > 0))
        if clip > 0 and not skipped:
            if work is not None:
                work.wait()
            total, coef = clip_coefficient(vec[:n], clip)
            grads = [p.grad for p in self.named_params.values() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        lr = lr_at(step, self.config.optim)
        if self.optimizer is not None and not skipped:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            began = self.timer.mark()
            if self.versions is not None:
                self.versions.update(self.optimizer.step)
            else:
                self.optimizer.step()
            self.timer.update(began)
        if work is not None:
            work.wait()
        if while_device_runs is not None:
            while_device_runs()
        # The step's one host synchronisation: it also completes the timing events, which sit
        # on the same stream before it.
        loss = float(vec[n] / self.plan.counted_microbatches if dp else vec[n])
        t1 = time.perf_counter()
        # Under a loss scale an overflow skips the step everywhere (weights untouched) and
        # lowers the scale; only a non-finite loss on a step that updated the weights stops.
        if not math.isfinite(loss) and not skipped:
            raise NonFiniteLoss(
                f"loss is {loss} at step {step}; lower --lr (now {self.config.optim.lr}), "
                "enable --clip-grad, or check the data (weights of this step are discarded; "
                "resume from the last checkpoint)"
            )
        grad_norm = float(total) if total is not None else None
        timing = self.timer.collect((t_sched - t0) * 1e3)
        self._last_end = t1
        return StepResult(
            step=step,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            step_ms=(t1 - t0) * 1e3,
            timing=timing,
            end_time=time.time(),
            probe=probed,
            between_ms=between,
            loss_scale=scale,
            skipped=skipped,
        )

    def _divide_grads(self, k: int) -> None:
        """Divide every held gradient by ``k`` (the step's microbatches): the mean over the
        step. One foreach call, bit for bit the per-parameter ``div_``."""
        grads = [p.grad for p in self.named_params.values() if p.grad is not None]
        if grads and k != 1:
            torch._foreach_div_(grads, k)

    def _between(self, t0: float) -> float:
        """Milliseconds since this rank's last step ended (``StepResult.between_ms``)."""
        return 0.0 if self._last_end is None else (t0 - self._last_end) * 1e3

    def _idle_step(
        self,
        step: int,
        *,
        sample_layers: bool,
        while_device_runs: Callable[[], None] | None = None,
    ) -> StepResult:
        """An idle rank's part of a step: the probe on sampled steps, then the step's one
        all-reduce with zeros (it holds no loss and no gradient)."""
        t0 = time.perf_counter()
        between = self._between(t0)
        self.grad_steps += int(self.track_grads)  # every rank counts the same steps
        sampled = sample_layers and self.config.timing and self.probing
        # The rank has waited idle since its last step. On 4 x H100 (gpt 12x2048) its probe
        # read a block's forward 1.4-2.2 ms against 1.07 held, so a clean device read
        # 1.25-1.6x and the run never took it back. A light rank's probe read the same block
        # 1.4-1.7 ms on another 4 x H100 while its backward read 1.1x: the forward's reading
        # was the host's pace, which the probe's lead now takes out (``_probe``). The warm
        # run and the median of three cost the job nothing while shorter than the other
        # ranks' step.
        probe = self._probe(self.probe_layer, repeats=3, warm=True) if sampled else None
        clip = self.config.optim.clip_grad
        n = len(self.slots) if clip > 0 else 0
        vec = torch.zeros(
            n + 1 + 2 * (self.scaler is not None), dtype=torch.float32, device=self.topo.device
        )
        if self.scaler is not None:
            vec[n + 2] = self.scaler.scale
        if self.topo.world_size > 1:
            dist.all_reduce(vec, group=self.group)
        skipped, scale = False, None
        if self.scaler is not None:
            # Idle, it still follows the scale, so it is the world's when it holds a stage.
            scale = self.scaler.scale
            _same_scale(vec[n + 2], scale, group=self.group, step=step)
            skipped = self.scaler.update(bool(vec[n + 1] > 0))
        if while_device_runs is not None:
            while_device_runs()
        total = clip_coefficient(vec[:n], clip)[0] if clip > 0 and not skipped else None
        loss = float(vec[n])
        t1 = time.perf_counter()
        self._last_end = t1
        timing = StepTiming(fwd_ms=[], bwd_ms=[], schedule_ms=0.0)
        timing.layers = probe
        return StepResult(
            step=step,
            loss=loss,
            lr=lr_at(step, self.config.optim),
            grad_norm=float(total) if total is not None else None,
            step_ms=(t1 - t0) * 1e3,
            timing=timing,
            end_time=time.time(),
            probe=None
            if probe is None
            else (self.probe_layer, float(probe.fwd_ms[0]), float(probe.bwd_ms[0])),
            between_ms=between,
            loss_scale=scale,
            skipped=skipped,
        )

    def _probe(self, i: int, *, repeats: int = 1, warm: bool = False) -> LayerTiming | None:
        """Time one microbatch of layer ``i``'s forward and backward on this device (the
        median of ``repeats`` microbatches; ``warm``: after an untimed one, as on a layer's
        first probe), through the stage's layer probe (so emulated interference stretches it
        as it would a held layer). A private copy of the layer under a forked RNG: training
        state and random streams are untouched.

        On a GPU the reading is the device's time alone, as the estimates' clean costs
        are: the timed microbatches are queued behind a spin as long as the host took to
        issue them last time (``queue_ahead``), so the events see the kernels run back to
        back rather than the host's pace, and several microbatches span more of a
        time-sliced GPU's turns than one does."""
        dev = self.topo.device
        mb = self.config.batch_size // self.plan.total_microbatches
        # Under the stages' own autocast, so its time compares with theirs.
        amp = self.config.amp_dtype if self.topo.is_cuda else None
        with torch.random.fork_rng(devices=[dev] if self.topo.is_cuda else []):
            fresh = self._probe_copy is None or self._probe_copy[0] != i
            if fresh:
                copy = self.model.build_layer(i, device=dev)
                if self.config.compile is not None:
                    # Timed as the held layers run: compiled too.
                    compile_layers(
                        [copy], backend=self.config.compile, model_layers=len(self.model)
                    )
                self._probe_copy = (i, copy)
                self._probe_issue_ms = 0.0
            module = self._probe_copy[1]
            if i == 0:
                x, _ = self.model.input_spec.example(mb, device=dev)
            else:
                shape, dtype = self.model.trace_shapes(mb)[i - 1]
                x = (
                    torch.randn(shape, device=dev, dtype=dtype)
                    if dtype.is_floating_point
                    else torch.zeros(shape, device=dev, dtype=dtype)
                )
            probe = self.timer.layers
            was = probe.sampling

            def once(timed: bool, chunk: int = 0) -> None:
                probe.sampling, probe.chunk, probe.chunks = timed, chunk, None
                ctx = (
                    torch.autocast(device_type="cuda", dtype=amp)
                    if amp is not None
                    else contextlib.nullcontext()
                )
                with ctx:
                    # A leaf of its own each time: the probe's gradient hooks go on its
                    # input, and on one shared input every earlier microbatch's hook fired
                    # again on each later backward, so the median of three read a block's
                    # backward as itself plus two whole microbatches (5.3 ms for 2.2).
                    xi = x.detach().requires_grad_(x.is_floating_point())
                    out = probe.run([module], xi)
                probe.begin_backward(chunk)
                if out.requires_grad:
                    out.float().sum().backward()
                probe.end_backward(chunk)

            try:
                if fresh or warm:
                    t = time.perf_counter()
                    once(False)  # a first run's allocation and kernel choice are not speed
                    if not self._probe_issue_ms:
                        self._probe_issue_ms = (time.perf_counter() - t) * 1e3
                # Twice the host's last issue time: its pace varies from step to step.
                queue_ahead(dev, 2.0 * repeats * self._probe_issue_ms)
                t = time.perf_counter()
                for c in range(repeats):
                    once(True, c)
                self._probe_issue_ms = (time.perf_counter() - t) * 1e3 / repeats
                if self.topo.is_cuda:
                    torch.cuda.synchronize(dev)
            finally:
                probe.sampling = was
            module.zero_grad(set_to_none=True)
            got = probe.collect()
        if got is None:
            return None
        f, b, hf, hb, df, db = got
        if df is not None and db is not None:
            # Queued ahead, the device's own times (the longer-of rule prices layers that
            # a stage's host issues among others; the estimates' clean costs are device
            # times on a GPU).
            f, b = df, db
        return LayerTiming(
            fwd_ms=f,
            bwd_ms=b,
            stage_fwd_ms=float(f[0]),
            stage_bwd_ms=float(b[0]),
            launch_fwd_ms=hf,
            launch_bwd_ms=hb,
            device_fwd_ms=df,
            device_bwd_ms=db,
        )

    def _share(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """This replica's microbatches of the step's batch ``t``."""
        if t is None or self.dropped:
            return None
        a = self.plan.replica_slice(self.mesh.replica)[0]
        size = self.config.batch_size // self.plan.total_microbatches
        return t[a * size : (a + self.microbatches) * size]

    # ---- evaluation --------------------------------------------------------------------
    def evaluate(self, batches: Iterable[Batch | None]) -> EvalResult:
        """Forward-only pass of the pipeline over held-out ``batches``; no gradient, no update.

        Every rank passes the same number of entries, each a whole batch of the training
        batch size (the stage's P2P buffers have the training microbatch shapes); only the
        first stage reads inputs and only the last targets, so a middle stage passes Nones.
        Layers are in eval mode for the pass and get their modes back after it; the stage
        timers are off (an evaluation is not a training step's compute), but emulated
        interference still stretches it.
        """
        if self.idle:
            return self._idle_evaluate(batches)
        if not hasattr(self.schedule, "eval"):
            raise UserError(
                f"torch {torch.__version__} has no forward-only pipeline schedule "
                "(PipelineSchedule.eval); install a newer torch to evaluate"
            )
        dev = self.topo.device
        # A schedule's first step sets up its receive buffers, with gradients only if that
        # step has a backward; some torch releases (2.11) keep them so, and a training step
        # after an evaluation that came first (straight after a launch or a repartition)
        # found its received activations without gradients. Such an evaluation runs on a
        # schedule of its own, and the training schedule is set up by its first step.
        stage, schedule = (
            (self.pipe_stage, self.schedule) if self._trained else self._new_schedule()
        )
        stage.keep_outputs = True  # the sums read every microbatch's output
        modes = [(m, m.training) for m in self.module.modules()]
        timing, self.timer.enabled = self.timer.enabled, False
        sums = torch.zeros(4, dtype=torch.float64)
        count = 0
        t0 = time.perf_counter()
        self.module.eval()
        # 2bw: the model as trained so far is the newest version, not the stash.
        newest = self.versions.newest_in() if self.versions else contextlib.nullcontext()
        try:
            with torch.no_grad(), newest:
                for batch in batches:
                    self._eval_batch(schedule, batch, sums, dev)
                    count += 1
        finally:
            for m, mode in modes:
                m.train(mode)
            self.timer.enabled = timing
            stage.keep_outputs = False
        vec = sums.to(dev)
        if self.topo.world_size > 1:
            # The last stage holds the sums, the others zeros: adding them is exact. With
            # replicas, every replica's last stage holds the sums of its share.
            group = None if self.mesh.dp > 1 else self.group
            dist.all_reduce(vec, group=group)
        ms = (time.perf_counter() - t0) * 1e3
        return eval_result(vec.cpu(), model=self.model, batches=count, eval_ms=ms)

    def _idle_evaluate(self, batches: Iterable[Batch | None]) -> EvalResult:
        """An idle rank evaluates nothing; it adds zeros to the sums' all-reduce."""
        t0 = time.perf_counter()
        count = sum(1 for _ in batches)
        vec = torch.zeros(4, dtype=torch.float64, device=self.topo.device)
        if self.topo.world_size > 1:
            dist.all_reduce(vec, group=self.group)
        ms = (time.perf_counter() - t0) * 1e3
        return eval_result(vec.cpu(), model=self.model, batches=count, eval_ms=ms)

    def _eval_batch(
        self, schedule: Any, batch: Batch | None, sums: torch.Tensor, dev: torch.device
    ) -> None:
        x, y = batch if batch is not None else (None, None)
        for t in (x, y):
            if t is not None and t.shape[0] != self.config.batch_size:
                raise UserError(
                    f"an evaluation batch has {t.shape[0]} samples but the pipeline runs "
                    f"batches of {self.config.batch_size}; evaluate batches of the training "
                    "batch size"
                )
        if self.mesh.dp > 1:
            # Each replica evaluates its share of the batch (a replica partial reduce leaves
            # out evaluates nothing: the result is the mean over the samples evaluated).
            if self.dropped:
                return
            x, y = self._share(x), self._share(y)
        losses: list[torch.Tensor] = []
        if self.is_last:
            y = y.to(dev, non_blocking=True)
        if self.is_first and self.is_last:
            out = schedule.eval(x.to(dev), target=y, losses=losses)
        elif self.is_first:
            schedule.eval(x.to(dev, non_blocking=True))
        elif self.is_last:
            out = schedule.eval(target=y, losses=losses)
        else:
            schedule.eval()
        if self.is_last:
            m = self.microbatches if self.mesh.dp > 1 else self.plan.microbatches
            part = eval_sums(list(out.tensor_split(m)), list(y.tensor_split(m)), losses)
            sums += torch.tensor(part, dtype=torch.float64)

    # ---- state by name -----------------------------------------------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers of this stage, keyed ``<layer>.<name>``."""
        return {
            f"{lname}.{k}": v
            for lname, layer in self.module.layers.items()
            for k, v in layer.state_dict().items()
        }

    def optim_state(self) -> dict[str, torch.Tensor]:
        if self.optimizer is None:
            return {}  # an idle rank holds no state
        out = export_state(self.optimizer, self.named_params)
        if self.versions is not None:
            out.update(self.versions.state())
        return out


def _same_scale(total: torch.Tensor, scale: float, *, group, step: int) -> None:
    """Every rank of the reduce scaled by ``scale`` (their sum is ``scale`` x ranks): the
    loss scale is one number for the world, so a migration need not move it."""
    ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    if float(total) != scale * ranks:
        raise RuntimeError(
            f"loss scales differ across ranks at step {step}: this rank's is {scale:g}, the "
            f"{ranks} ranks' sum {float(total):g} (expected {scale * ranks:g})"
        )


# torch's schedules can leave dividing the gradients to their caller (``scale_grads``).
_HAS_SCALE_GRADS = "scale_grads" in inspect.signature(ScheduleGPipe).parameters
# A training step's last stage returns no merged output (see ``keep_outputs``).
_NO_OUTPUTS = (
    {"return_outputs": False}
    if "return_outputs" in inspect.signature(ScheduleGPipe.step).parameters
    else {}
)


def _check_scale_grads() -> None:
    """Replicas divide gradients once themselves; a schedule that always divides by its own
    microbatch count (torch before ``scale_grads``) would make uneven shares inexact."""
    if not _HAS_SCALE_GRADS:
        raise UserError(
            f"--dp > 1 needs torch's pipelining schedules with scale_grads (torch "
            f"{torch.__version__} lacks it); install torch 2.13 as the README says"
        )
