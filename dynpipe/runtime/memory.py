"""A stage's memory at run time: its device's limit, the memory model, its recomputed layers.

The runtime and the planner price memory with the same model (``CostModel``: parameters,
gradients, optimizer state and buffers, plus ``act_bytes`` per microbatch in flight), so the
layers a stage recomputes under ``--recompute auto`` are the planner's choice for its range
(``dynpipe.planner.recompute``), made again whenever a plan gives the stage other layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from dynpipe.errors import UserError
from dynpipe.models.base import LayeredModel
from dynpipe.planner.costs import CostModel
from dynpipe.planner.evaluate import in_flight
from dynpipe.planner.plan import Plan
from dynpipe.planner.recompute import Recompute, choose_recompute, kept_bytes

__all__ = [
    "HEADROOM",
    "check_memory",
    "check_run_memory",
    "device_memory_bytes",
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
) -> CostModel:
    """The model's analytic cost model for one device, its memory as a stage holds it.

    Parameters, gradients and optimizer state are float32. Under bf16 / fp16 autocast on a
    GPU (``device``) the bytes autograd keeps per layer are measured there, one sample
    through each layer under the stage's own autocast (``saved_activation_bytes``), and
    scaled by the microbatch: the meta trace would price attention by its math fallback
    (a float32 ``heads x seq x seq`` matrix) where the GPU's flash kernel keeps none, and
    would miss the float32 copies that autocast's layer norms keep. Elsewhere the
    activations come from the meta trace in the run's dtype (``layer_stats``).
    """
    cm = CostModel.from_model(model, microbatch_size=microbatch_size, optimizer=optimizer)
    if half and device is not None and device.type == "cuda":
        act, out = saved_activation_bytes(model, device=device, dtype=torch.bfloat16)
        cm = dataclasses.replace(
            cm, act_bytes=act * microbatch_size, out_bytes=out * microbatch_size
        )
    elif half:
        lo = CostModel.from_model(
            model, microbatch_size=microbatch_size, optimizer=optimizer, dtype="bfloat16"
        )
        cm = dataclasses.replace(cm, act_bytes=lo.act_bytes, out_bytes=lo.out_bytes)
    return dataclasses.replace(cm, recompute=recompute)


def saved_activation_bytes(
    model: LayeredModel, *, device: torch.device, dtype: torch.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, the bytes autograd keeps for one sample (parameters excluded) and the bytes
    of its output, measured by running each layer once on ``device`` under ``dtype``
    autocast. Layers of one spec and input (a transformer's blocks) are measured once."""
    from torch.autograd.graph import saved_tensors_hooks

    n = len(model)
    act, out = np.zeros(n), np.zeros(n)
    x, _ = model.input_spec.example(1, device=device)
    seen: dict[tuple, tuple[float, float, torch.Tensor]] = {}
    # Dropout draws here must not move the run's random stream.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i in range(n):
            layer = model.build_layer(i, device=device)
            layer.train()
            key = (
                model.layers[i].kind,
                tuple(x.shape),
                x.dtype,
                tuple((k, tuple(p.shape)) for k, p in layer.named_parameters()),
            )
            if key in seen:
                act[i], out[i], x = seen[key]
                continue
            params = {p.untyped_storage()._cdata for p in layer.parameters()}
            kept: dict[int, int] = {}

            def pack(t: torch.Tensor, kept: dict[int, int] = kept, params: set = params):
                k = t.untyped_storage()._cdata
                if k not in params:
                    kept[k] = max(kept.get(k, 0), t.untyped_storage().nbytes())
                return t

            inp = x.detach().requires_grad_(x.is_floating_point())
            with (
                saved_tensors_hooks(pack, lambda t: t),
                torch.autocast(device_type=device.type, dtype=dtype),
            ):
                y = layer(inp)
            act[i] = float(sum(kept.values()))
            out[i] = float(y.numel() * y.element_size())
            x = y.detach()
            seen[key] = (act[i], out[i], x)
            del layer, y, inp
    return act, out


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
    held = float(np.where(mask, kept, act).sum())
    rebuilt = float((act - kept)[mask].max()) if mask.any() else 0.0
    peak = float(costs.static_bytes[a:b].sum()) + k * held + rebuilt
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
    peak bytes (None on CPU unless choosing) and the memory model it priced them with
    (``costs``, made here on first use and kept by the caller across rebuilds).

    mode: ``all``, ``none``, ``auto`` (the planner's choice under ``limit``; a stage that
    cannot fit raises a one-line ``UserError``), or None: the plan's own list.
    """
    st = plan.stages[stage]
    if mode in ("all", "none"):
        names = tuple(model.layer_names[st.start : st.stop]) if mode == "all" else ()
        stages = list(plan.stages)
        stages[stage] = dataclasses.replace(st, recompute=names)
        plan = dataclasses.replace(plan, stages=tuple(stages))
    cuda = device.type == "cuda"
    if not (cuda or mode == "auto"):
        return plan.stages[stage].recompute, None, costs  # no memory model needed
    if costs is None:
        costs = memory_costs(
            model,
            microbatch_size=batch_size // plan.total_microbatches,
            optimizer=optimizer,
            half=half and cuda,
            recompute="auto" if mode == "auto" else "none",
            device=device,
        )
    got = stage_recompute(costs, plan, stage, limit=limit, microbatches=microbatches)
    if mode == "auto" and not got.fits:
        assert limit is not None
        raise UserError(over_memory(costs, plan, [got], limit, stages=[stage]))
    return tuple(model.layer_names[i] for i in got.layers), got.peak_bytes, costs
