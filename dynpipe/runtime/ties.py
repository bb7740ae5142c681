"""Tied parameters across stages: one copy per owning layer, gradients summed every step.

A source model may use one parameter in two layers (GPT-2's token embedding is also its
output projection). Pipeline stages own disjoint layers, so each owning layer keeps its own
copy (``LayeredModel.ties``). Every step, after the microbatch gradients are complete and
before clipping and the optimizer, each copy's gradient is replaced by the sum over the
copies: the gradient the single shared parameter gets in the unsplit model. The copies
start equal (both are copies of one source tensor), get equal gradients and equal
optimizer updates (the optimizers are per-parameter and elementwise), so they stay equal
bit for bit; migration, checkpoints and data-parallel replicas treat each copy as the
ordinary parameter of its layer, with nothing else to keep in step.

When one stage holds every copy the sum is local. When copies live on different stages the
stages' sums are added with one all-reduce over the pipeline's group, to which a stage that
holds no copy contributes zeros: every stage takes part, so no group has to be made when a
repartition moves an owner, and adding zeros is exact, so two owners' ``a + b`` is the same
bits whichever order the reduce uses. The cost is one all-reduce of the tied tensors per
step over the pipeline's ranks.

The global gradient norm counts a tied parameter once: only the first name of each group
has a slot (``primary_names``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from dynpipe.errors import UserError
from dynpipe.models.base import LayeredModel

__all__ = [
    "check_freeze",
    "freeze_limit",
    "secondary_names",
    "spread_ties",
    "sum_tied_grads",
    "tied_shapes",
]


def secondary_names(model: LayeredModel) -> set[str]:
    """Every tied parameter name but the first of its group (left out of the norm's slots)."""
    return {name for group in model.ties for name in group[1:]}


def tied_shapes(model: LayeredModel) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each tie group's parameter (from a meta build)."""
    out = []
    for group in model.ties:
        lname, _, pname = group[0].partition(".")
        layer = model.build_layer(model.index(lname), device="meta")
        p = dict(layer.named_parameters())[pname]
        out.append((tuple(p.shape), p.dtype))
    return out


def _local_sums(
    model: LayeredModel, named_params: Mapping[str, nn.Parameter]
) -> list[torch.Tensor | None]:
    sums: list[torch.Tensor | None] = []
    for group in model.ties:
        total = None
        for name in group:  # in the group's order, as every holder adds them
            p = named_params.get(name)
            if p is None or p.grad is None:
                continue
            total = p.grad.clone() if total is None else total + p.grad
        sums.append(total)
    return sums


def sum_tied_grads(
    model: LayeredModel,
    named_params: Mapping[str, nn.Parameter],
    *,
    spread: bool,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    shapes: list[tuple[tuple[int, ...], torch.dtype]] | None = None,
) -> None:
    """Set every held copy's gradient to the sum of all copies' gradients.

    spread: copies of some tie live on more than one stage, so the stages' sums are added
        by an all-reduce over ``group`` (collective: every stage of the pipeline calls it,
        with the same ``spread``). ``shapes``: ``tied_shapes(model)``, for the zeros a stage
        without a copy sends.
    """
    if not model.ties:
        return
    sums = _local_sums(model, named_params)
    if spread:
        assert shapes is not None
        flat = [
            s if s is not None else torch.zeros(shape, dtype=dtype, device=device)
            for s, (shape, dtype) in zip(sums, shapes, strict=True)
        ]
        vec = torch.cat([t.reshape(-1).float() for t in flat])
        dist.all_reduce(vec, group=group)
        sums, at = [], 0
        for t in flat:
            sums.append(vec[at : at + t.numel()].view_as(t).to(t.dtype))
            at += t.numel()
    for group_names, total in zip(model.ties, sums, strict=True):
        if total is None:
            continue
        for name in group_names:
            p = named_params.get(name)
            if p is not None and p.requires_grad:
                p.grad = total.clone()


def spread_ties(model: LayeredModel, stage_layers: list[set[str]]) -> bool:
    """Whether some tie has copies on more than one stage (``stage_layers``: each stage's
    layer names)."""
    for group in model.ties:
        owners = {
            i for i, held in enumerate(stage_layers) for n in group if n.partition(".")[0] in held
        }
        if len(owners) > 1:
            return True
    return False


def freeze_limit(model: LayeredModel, frozen: int) -> int:
    """The longest frozen prefix, at most ``frozen`` layers, that freezes every copy of a tied
    parameter or none (the ``--freeze`` rule is capped to it)."""
    names = model.layer_names
    k = frozen
    changed = True
    while changed:
        changed = False
        for group in model.ties:
            idx = [names.index(n.partition(".")[0]) for n in group]
            if min(idx) < k <= max(idx):
                k, changed = min(idx), True
    return k


def check_freeze(model: LayeredModel, frozen: int) -> None:
    """Refuse a frozen prefix that holds one copy of a tied parameter but not another: the
    frozen copy would stop following the trained one."""
    names = model.layer_names
    for group in model.ties:
        idx = [names.index(n.partition(".")[0]) for n in group]
        if any(i < frozen for i in idx) and any(i >= frozen for i in idx):
            raise UserError(
                f"--freeze of layers 0..{frozen - 1} would freeze {group[0]} but not its tied "
                f"copy {group[1]}; the copies must train together: freeze fewer layers than "
                f"{min(idx) + 1} or untie them in the model config (tie_word_embeddings=False)"
            )
