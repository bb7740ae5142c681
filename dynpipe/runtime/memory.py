"""A stage's memory at run time: its device's limit, the memory model, its recomputed layers.

The runtime and the planner price memory with the same model (``CostModel``: parameters,
gradients, optimizer state and buffers, plus ``act_bytes`` per microbatch in flight), so the
layers a stage recomputes under ``--recompute auto`` are the planner's choice for its range
(``dynpipe.planner.recompute``), made again whenever a plan gives the stage other layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import numpy as np
import torch

from dynpipe.errors import UserError
from dynpipe.models.base import LayeredModel
from dynpipe.planner.costs import CostModel
from dynpipe.planner.evaluate import in_flight
from dynpipe.planner.plan import DELAYED_SCHEDULES, Plan
from dynpipe.planner.recompute import Recompute, choose_recompute, kept_bytes, stage_peak

__all__ = [
    "HEADROOM",
    "SavedBytes",
    "check_memory",
    "check_run_memory",
    "device_memory_bytes",
    "estimate_peak",
    "memory_costs",
    "over_memory",
    "saved_activation_bytes",
    "stage_layers",
    "stage_recompute",
]

# Of the device's free memory at start-up, the share a stage plans to fill: the rest is the
# allocator's fragmentation, cuBLAS/attention workspaces and the P2P receive buffers.
HEADROOM = 0.9

_GIB = 1024**3


def device_memory_bytes(device: torch.device, *, memory_gb: float | None) -> float | None:
    """Bytes a stage on ``device`` may plan to occupy: ``memory_gb`` if given, else
    ``HEADROOM`` of the CUDA device's free memory; None where neither is known (CPU)."""
    if memory_gb is not None:
        return float(memory_gb) * _GIB
    if device.type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(device)
        return float(free) * HEADROOM
    return None


def memory_costs(
    model: LayeredModel,
    *,
    microbatch_size: int,
    optimizer: str,
    half: bool,
    recompute: str,
    device: torch.device | None = None,
    weight_versions: int = 1,
) -> CostModel:
    """The model's cost model for one device, its memory as a stage holds it.

    Parameters, gradients and optimizer state are float32. Under bf16 / fp16 autocast on a
    GPU (``device``) the bytes autograd keeps per layer are measured there
    (``saved_activation_bytes``): the meta trace would price attention by its math fallback
    (a float32 ``heads x seq x seq`` matrix) where the GPU's flash kernel keeps none, and
    would miss the float32 copies that autocast's layer norms keep. A microbatch keeps the
    measured per-sample bytes times its size plus, once, autocast's bf16 copies of the
    weights (a transformer block's are larger than one sample's activations at width 2048).
    Elsewhere the activations come from the meta trace in the run's dtype (``layer_stats``).
    This runs each distinct layer forward twice on ``device``: only ``--recompute auto``
    and the planner's recompute pricing need it. ``weight_versions``: 2 under
    ``--schedule 2bw``, whose second copy of the weights is priced as optimizer state (it
    travels as such: ``dynpipe.runtime.twobw``).
    """
    cm = CostModel.from_model(model, microbatch_size=microbatch_size, optimizer=optimizer)
    if half and device is not None and device.type == "cuda":
        saved = saved_activation_bytes(model, device=device, dtype=torch.bfloat16)
        cm = dataclasses.replace(
            cm,
            act_bytes=saved.act_bytes(microbatch_size),
            out_bytes=saved.out * microbatch_size,
        )
    elif half:
        lo = CostModel.from_model(
            model, microbatch_size=microbatch_size, optimizer=optimizer, dtype="bfloat16"
        )
        cm = dataclasses.replace(cm, act_bytes=lo.act_bytes, out_bytes=lo.out_bytes)
    cm = dataclasses.replace(cm, opt_mult=cm.opt_mult + (weight_versions - 1))
    return dataclasses.replace(cm, recompute=recompute)


@dataclasses.dataclass(frozen=True)
class SavedBytes:
    """What autograd keeps per layer for its backward, measured (``saved_activation_bytes``).

    fixed: ``[L]`` bytes a microbatch keeps whatever its size: autocast's low-precision
        copies of the weights, which every microbatch's graph holds once.
    per_sample: ``[L]`` bytes each sample of a microbatch adds.
    out: ``[L]`` bytes of the layer's output per sample (what a recomputed next layer keeps).
    """

    fixed: np.ndarray
    per_sample: np.ndarray
    out: np.ndarray

    def act_bytes(self, microbatch_size: int) -> np.ndarray:
        """``[L]`` bytes each layer keeps for one microbatch of ``microbatch_size`` samples."""
        return self.fixed + microbatch_size * self.per_sample


def _saved_once(
    fn: Any,
    x: torch.Tensor,
    *,
    skip: set[int],
    device: torch.device,
    dtype: torch.dtype | None,
    grad_input: bool = True,
) -> tuple[float, float, torch.Tensor, float]:
    """One call ``fn(x)``: the bytes of the distinct storages autograd saves (storages in
    ``skip``, the parameters', not counted), of those the input's and the output's, and the
    output. ``grad_input``: whether ``x`` needs a gradient (not the model's data: the first
    layer then keeps no weight copy for an input gradient)."""
    from torch.autograd.graph import saved_tensors_hooks

    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip and st.nbytes():
            kept[st.data_ptr()] = max(kept.get(st.data_ptr(), 0), st.nbytes())
        return t

    inp = x.detach().requires_grad_(grad_input and x.is_floating_point())
    autocast = (
        torch.autocast(device_type=device.type, dtype=dtype)
        if dtype is not None
        else contextlib.nullcontext()
    )
    with saved_tensors_hooks(pack, lambda t: t), autocast:
        y = fn(inp)
    in_kept = kept.get(inp.untyped_storage().data_ptr(), 0)
    out_kept = kept.get(y.untyped_storage().data_ptr(), 0)
    return float(sum(kept.values())), float(in_kept), y.detach(), float(out_kept)


def saved_activation_bytes(
    model: LayeredModel, *, device: torch.device, dtype: torch.dtype | None
) -> SavedBytes:
    """Per layer, the bytes autograd keeps for its backward, measured on ``device`` under
    ``dtype`` autocast (None: the model's own dtype) by running the layer on one and on two
    samples under ``saved_tensors_hooks``: storages counted once, parameters not at all.

    The difference of the two runs is what a sample adds; the rest is what any microbatch
    keeps once (autocast's weight copies). A tensor that a layer saves as its output and the
    next saves as its input is counted in the first only, as autograd holds it once. Layers
    alike in structure and input (a transformer's blocks) are measured once. The last layer
    also holds the float32 output the loss reads and what the loss keeps (a language
    model's log-softmax over its vocabulary).
    """
    n = len(model)
    fixed, per, out = np.zeros(n), np.zeros(n), np.zeros(n)
    x, target = model.input_spec.example(2, device=device)
    seen: dict[tuple, tuple[float, float, float, float, float, torch.Tensor]] = {}
    prev_out = 0.0  # per sample: bytes of the previous layer's output that it saves itself
    # Dropout draws here must not move the run's random stream.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i in range(n):
            layer = model.build_layer(i, device=device)
            layer.train()
            # The module tree (pooling, strides) with the input's shape: vgg's blocks share
            # kinds and parameter shapes and differ in their pooling.
            key = (repr(layer), tuple(x.shape), x.dtype)
            if key not in seen:
                skip = {p.untyped_storage().data_ptr() for p in layer.parameters()}
                skip |= {b.untyped_storage().data_ptr() for b in layer.buffers()}
                # One sample in a storage of its own: a view would count both samples.
                run = dict(skip=skip, device=device, dtype=dtype, grad_input=i > 0)
                one = _saved_once(layer, x[:1].clone(), **run)
                two, in2, y, out2 = _saved_once(layer, x, **run)
                s = max(two - one[0], 0.0)
                o = y.numel() * y.element_size() / 2
                seen[key] = (max(one[0] - s, 0.0), s, in2 / 2, out2 / 2, o, y)
            f, s, in_s, out_s, o, y = seen[key]
            # Autograd holds a boundary tensor once: in the layer that saves its output.
            fixed[i], per[i], out[i] = f, s - min(in_s, prev_out), o
            prev_out, x = out_s, y
            del layer
        per[-1] += _loss_bytes(model, x, target, device=device) / 2
    return SavedBytes(fixed=fixed, per_sample=per, out=out)


def _loss_bytes(
    model: LayeredModel, y: torch.Tensor, target: torch.Tensor, *, device: torch.device
) -> float:
    """Bytes the last stage holds for the loss of output ``y``: the float32 output the
    schedule keeps for the backward and what the loss saves besides it."""
    y32 = y.float()
    got, _in, _loss, _out = _saved_once(
        lambda t: model.loss_fn(t, target), y32, skip=set(), device=device, dtype=None
    )
    return float(y32.numel() * y32.element_size()) + got - _in


def stage_recompute(
    costs: CostModel, plan: Plan, stage: int, *, limit: float | None, microbatches: int
) -> Recompute:
    """Stage ``stage``'s recomputed layers under ``costs.recompute`` (the plan's own list
    when it names one), its predicted peak bytes, and whether they fit ``limit``."""
    st = plan.stages[stage]
    k = int(in_flight(plan.schedule, num_stages=plan.num_stages, microbatches=microbatches)[stage])
    lim = float("inf") if limit is None else float(limit)
    if st.recompute:
        names = costs.layer_names
        return _priced(costs, {names.index(n) for n in st.recompute}, st.start, st.stop, k, lim)
    return choose_recompute(costs, device=0, start=st.start, stop=st.stop, in_flight=k, limit=lim)


def _priced(costs: CostModel, chosen: set[int], a: int, b: int, k: int, lim: float) -> Recompute:
    """A given set of recomputed layers of ``[a, b)``, priced as the planner prices one."""
    act, kept = costs.act_bytes[a:b], kept_bytes(costs)[a:b]
    mask = np.array([i in chosen for i in range(a, b)])
    peak = stage_peak(float(costs.static_bytes[a:b].sum()), act, kept, mask, k)
    return Recompute(
        layers=tuple(sorted(chosen)),
        extra_ms=float(costs.fwd_ms[0, a:b][mask].sum()),
        peak_bytes=peak,
        fits=peak <= lim,
    )


def over_memory(
    costs: CostModel,
    plan: Plan,
    choices: list[Recompute],
    limit: float,
    *,
    stages: list[int] | None = None,
) -> str:
    """One line: every stage's needed against available GiB, and what to lower."""
    stages = list(range(len(choices))) if stages is None else stages
    parts = ", ".join(
        f"stage {s} {c.peak_bytes / _GIB:.3g}/{limit / _GIB:.3g}"
        for s, c in zip(stages, choices, strict=True)
    )
    return (
        f"{plan.model} does not fit its devices with --recompute {costs.recompute}: "
        f"needed/available GiB {parts}; lower --batch-size or raise --microbatches "
        f"({costs.microbatch_size} samples a microbatch now), use more stages, or give the "
        "devices' real memory with --memory-gb"
    )


def check_memory(costs: CostModel, plan: Plan, *, limit: float | None) -> list[Recompute]:
    """Every stage's choice; a one-line ``UserError`` if one does not fit ``limit``."""
    choices = [
        stage_recompute(costs, plan, s, limit=limit, microbatches=plan.microbatches)
        for s in range(plan.num_stages)
    ]
    if limit is not None and not all(c.fits for c in choices):
        raise UserError(over_memory(costs, plan, choices, limit))
    return choices


def check_run_memory(cfg: Any, model: LayeredModel, plan: Plan, *, device: str) -> None:
    """One-line errors, before any process group, for a run's precision and memory: fp16 on
    CPU, ``--recompute auto`` with no memory to plan for, a plan that does not fit even
    recomputing (``cfg``: a ``TrainConfig``; ``device``: the run's resolved device)."""
    cpu = not str(device).startswith("cuda")
    if cfg.fp16 and cpu:
        raise UserError(
            "--fp16 needs a GPU: float16 autocast on CPU trains slowly with missing kernels and "
            "its loss scale has nothing to protect; drop --fp16 on CPU (float32), or run on "
            "--device cuda"
        )
    if cfg.recompute != "auto":
        return
    if cfg.memory_gb is None and cpu:
        raise UserError(
            "--recompute auto fits each stage into its device's memory, and no memory is "
            "known on CPU; give it with --memory-gb GB (or use --recompute all or none)"
        )
    if cfg.memory_gb is None:
        return  # each GPU worker reads its own free memory and checks its stage
    costs = memory_costs(
        model,
        microbatch_size=cfg.batch_size // plan.total_microbatches,
        optimizer=cfg.optim.name,
        half=(cfg.bf16 or cfg.fp16) and not cpu,
        recompute="auto",
        weight_versions=_versions(plan),
    )
    check_memory(costs, plan, limit=cfg.memory_gb * _GIB)


def stage_layers(
    model: LayeredModel,
    plan: Plan,
    stage: int,
    *,
    mode: str | None,
    limit: float | None,
    microbatches: int,
    batch_size: int,
    optimizer: str,
    half: bool,
    device: torch.device,
    costs: CostModel | None = None,
) -> tuple[tuple[str, ...], float | None, CostModel | None]:
    """What a running stage recomputes: the names of its recomputed layers, its predicted
    peak bytes (under ``auto`` only, else None: ``estimate_peak``) and the memory model it
    priced them with (``costs``, made here on first use and kept by the caller across
    rebuilds; only ``auto`` makes one, and on a GPU that measures each distinct layer).

    mode: ``all``, ``none``, ``auto`` (the planner's choice under ``limit``; a stage that
    cannot fit raises a one-line ``UserError``), or None: the plan's own list.
    """
    if mode != "auto":
        # No memory model, no measuring forward passes: ``estimate_peak`` prices the stage
        # when someone asks.
        return _fixed_recompute(model, plan, stage, mode=mode).stages[stage].recompute, None, costs
    cuda = device.type == "cuda"
    if costs is None:
        costs = memory_costs(
            model,
            microbatch_size=batch_size // plan.total_microbatches,
            optimizer=optimizer,
            half=half and cuda,
            recompute="auto",
            device=device,
            weight_versions=_versions(plan),
        )
    got = stage_recompute(costs, plan, stage, limit=limit, microbatches=microbatches)
    if not got.fits:
        assert limit is not None
        raise UserError(over_memory(costs, plan, [got], limit, stages=[stage]))
    return tuple(model.layer_names[i] for i in got.layers), got.peak_bytes, costs


def _fixed_recompute(model: LayeredModel, plan: Plan, stage: int, *, mode: str | None) -> Plan:
    """``plan`` with stage ``stage`` recomputing every layer (``all``), none (``none``), or
    its own list (None)."""
    if mode not in ("all", "none"):
        return plan
    st = plan.stages[stage]
    names = tuple(model.layer_names[st.start : st.stop]) if mode == "all" else ()
    stages = list(plan.stages)
    stages[stage] = dataclasses.replace(st, recompute=names)
    return dataclasses.replace(plan, stages=tuple(stages))


def estimate_peak(
    model: LayeredModel,
    plan: Plan,
    stage: int,
    *,
    mode: str | None,
    microbatches: int,
    batch_size: int,
    optimizer: str,
    half: bool,
    device: torch.device,
    measure: bool,
) -> float:
    """Stage ``stage``'s predicted peak bytes under ``mode`` (``all``, ``none`` or None: the
    plan's own list). ``measure``: on a GPU, with the activations measured there (each
    distinct layer runs forward twice; ``memory_costs``); else from the meta trace alone,
    which runs nothing."""
    cuda = device.type == "cuda"
    costs = memory_costs(
        model,
        microbatch_size=batch_size // plan.total_microbatches,
        optimizer=optimizer,
        half=half and cuda,
        recompute="none",
        device=device if measure else None,
        weight_versions=_versions(plan),
    )
    plan = _fixed_recompute(model, plan, stage, mode=mode)
    return stage_recompute(costs, plan, stage, limit=None, microbatches=microbatches).peak_bytes


def _versions(plan: Plan) -> int:
    """Weight versions a stage keeps under ``plan``'s schedule (2bw: two)."""
    return 2 if plan.schedule in DELAYED_SCHEDULES else 1
