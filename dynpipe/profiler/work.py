"""What a layer's forward and backward *do*, counted from its operators: the predictor's
description of a layer, which names no model and no layer.

``layer_work`` runs every layer of a model on the ``meta`` device (no memory, no compute)
under a ``TorchDispatchMode`` that sees each ATen operator the layer's forward and its
backward launch, and sums, per (layer, phase):

- ``work_flops``: FLOPs, by ``torch.utils.flop_counter``'s formulas (matmuls, convolutions,
  attention; elementwise operators count zero FLOPs but move bytes);
- ``work_bytes``: bytes moved, each operator's input and output tensors read or written once
  (an upper bound for fused kernels, a lower bound for spills, the same rule for every layer);
- ``work_launches``: operators that launch a kernel (views and allocations do not);
- the share of bytes moved by each ``OP_KINDS`` kind (``work_bytes_<kind>``) and of FLOPs
  by the compute kinds (``work_flops_<kind>``): the kernel mix;
- ``work_max_op_bytes``: the largest single operator (what sets how well one kernel fills
  the device).

Scaled-dot-product attention is counted as one fused operator per phase (as the flash and
memory-efficient kernels run it on a GPU), not as the math decomposition the ``meta`` device
would otherwise trace; its FLOPs use the attention formulas of ``flop_counter``.

The counts describe any ``nn.Module``, so a layer of a model never profiled gets the same
description as one that was.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import (
    conv_flop_count,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

__all__ = [
    "FLOP_KINDS",
    "OP_KINDS",
    "WORK_COLUMNS",
    "WorkCounter",
    "add_work",
    "classify",
    "layer_work",
]

OP_KINDS: tuple[str, ...] = (
    "matmul",
    "conv",
    "conv_grouped",
    "attention",
    "norm",
    "elementwise",
    "other",
)
FLOP_KINDS: tuple[str, ...] = ("matmul", "conv", "conv_grouped", "attention")
WORK_COLUMNS: tuple[str, ...] = (
    "work_flops",
    "work_bytes",
    "work_launches",
    "work_max_op_bytes",
    *(f"work_bytes_{k}" for k in OP_KINDS),
    *(f"work_flops_{k}" for k in FLOP_KINDS),
)

_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "matmul", "linear",
           "_scaled_mm", "_int_mm"}  # fmt: skip
_CONV = {"convolution", "_convolution", "convolution_backward", "conv1d", "conv2d", "conv3d",
         "cudnn_convolution", "mkldnn_convolution", "_slow_conv2d_forward",
         "_slow_conv2d_backward", "conv_depthwise2d", "_conv_depthwise2d"}  # fmt: skip
_NORM_WORDS = ("norm",)  # native_layer_norm, native_batch_norm(_backward), group_norm, rms_norm
_OTHER = {"embedding", "embedding_dense_backward", "index", "index_select", "gather", "scatter",
          "scatter_add", "index_add", "index_put", "max_pool2d_with_indices",
          "max_pool2d_with_indices_backward", "avg_pool2d", "avg_pool2d_backward",
          "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward", "adaptive_max_pool2d",
          "sum", "mean", "amax", "max", "min", "var_mean", "cumsum", "sort", "topk",
          "nll_loss_forward", "nll_loss_backward", "cat", "stack", "_to_copy", "copy_",
          "clone", "constant_pad_nd", "repeat", "im2col", "col2im"}  # fmt: skip
# Operators that launch nothing: allocation only.
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
              "detach", "lift_fresh", "_local_scalar_dense", "sym_size", "sym_stride",
              "sym_numel", "sym_storage_offset", "is_same_size"}  # fmt: skip


def classify(name: str, *, args: Sequence[Any] = ()) -> str:
    """The ``OP_KINDS`` kind of an ATen operator by its packet name (``"addmm"``)."""
    if name in _MATMUL:
        return "matmul"
    if name in _CONV or "convolution" in name:
        # convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding,
        # groups); convolution_backward has groups at index 9.
        groups = 1
        idx = 9 if name == "convolution_backward" else 8
        if len(args) > idx and isinstance(args[idx], int):
            groups = args[idx]
        return "conv_grouped" if groups > 1 else "conv"
    if "attention" in name:
        return "attention"
    if any(w in name for w in _NORM_WORDS):
        return "norm"
    if name in _OTHER or "pool" in name or "index" in name:
        return "other"
    return "elementwise"


def _nbytes(values: Iterable[Any]) -> int:
    total = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


def _conv_backward_flops(args: Sequence[Any]) -> float:
    """FLOPs of ``convolution_backward``: one forward's worth per gradient it computes (input,
    weight). ``flop_counter``'s own formula ignores ``groups`` and counts a depthwise
    convolution's backward as if it were dense."""
    grad_out, inp, weight = args[0], args[1], args[2]
    transposed, mask = bool(args[7]), args[10]
    fwd = conv_flop_count(list(inp.shape), list(weight.shape), list(grad_out.shape), transposed)
    return float(fwd * (int(bool(mask[0])) + int(bool(mask[1]))))


class WorkCounter(TorchDispatchMode):
    """Sums FLOPs, bytes and launches per operator kind while active (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.reset()

    def reset(self) -> None:
        self.flops = dict.fromkeys(OP_KINDS, 0.0)
        self.bytes = dict.fromkeys(OP_KINDS, 0.0)
        self.launches = 0
        self.max_op_bytes = 0.0
        self.muted = 0  # > 0 inside a fused operator counted as a whole

    def record(self, kind: str, *, flops: float, nbytes: float) -> None:
        self.flops[kind] += flops
        self.bytes[kind] += nbytes
        self.launches += 1
        self.max_op_bytes = max(self.max_op_bytes, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.muted:
            return out
        packet = func._overloadpacket
        name = packet.__name__
        if func.is_view or name in _NO_KERNEL:
            return out
        flops = 0.0
        if name == "convolution_backward":
            flops = _conv_backward_flops(args)
        elif packet in flop_registry:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
        ins, _ = tree_flatten((args, kwargs))
        outs, _ = tree_flatten(out)
        # An in-place operator's output is its first input: counted once, read and written.
        self.record(classify(name, args=args), flops=flops, nbytes=_nbytes(ins) + _nbytes(outs))
        return out

    def as_row(self) -> dict[str, float]:
        total_b = sum(self.bytes.values())
        total_f = sum(self.flops.values())
        row = {
            "work_flops": total_f,
            "work_bytes": total_b,
            "work_launches": float(self.launches),
            "work_max_op_bytes": self.max_op_bytes,
        }
        for k in OP_KINDS:
            row[f"work_bytes_{k}"] = self.bytes[k] / total_b if total_b else 0.0
        for k in FLOP_KINDS:
            row[f"work_flops_{k}"] = self.flops[k] / total_f if total_f else 0.0
        return row


class _FusedAttention(TorchFunctionMode):
    """Counts ``scaled_dot_product_attention`` as one fused operator in each phase."""

    def __init__(self, counter: WorkCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        return _Attention.apply(self.counter, q, k, v)


class _Attention(torch.autograd.Function):
    # Meta tensors only: shapes matter, values do not exist.
    @staticmethod
    def forward(ctx, counter: WorkCounter, q, k, v):  # type: ignore[override]
        ctx.counter = counter
        ctx.shapes = (q.shape, k.shape, v.shape)
        ctx.save_for_backward(q, k, v)
        counter.muted += 1
        try:
            out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        finally:
            counter.muted -= 1
        flops = sdpa_flop_count(q.shape, k.shape, v.shape)
        counter.record("attention", flops=flops, nbytes=_nbytes((q, k, v, out)))
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v = ctx.saved_tensors
        counter: WorkCounter = ctx.counter
        counter.muted += 1
        try:
            gq, gk, gv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        finally:
            counter.muted -= 1
        flops = sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape)
        moved = _nbytes((grad, q, k, v, gq, gk, gv)) + grad.numel() * grad.element_size()
        counter.record("attention", flops=flops, nbytes=moved)
        return None, gq, gk, gv


def layer_work(
    model: Any, *, batch_size: int, dtype: torch.dtype | str = torch.float32
) -> list[dict[str, Any]]:
    """Work counts of every layer's forward and backward: one dict per (layer, phase) with
    ``layer_index``, ``phase`` and ``WORK_COLUMNS``. Runs on ``meta``: nothing is allocated.

    The backward of layer 0 leaves out the gradient of its input (data), as a pipeline does;
    a layer without a backward (no parameters, data input) gets zeros.
    """
    # Not profiler.layers.dtype_of: layers imports this module.
    dt = (
        dtype
        if isinstance(dtype, torch.dtype)
        else getattr(torch, str(dtype).removeprefix("torch."))
    )
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    x, _ = model.input_spec.example(batch_size, device="meta")
    if x.is_floating_point():
        x = x.to(dt)
    rows: list[dict[str, Any]] = []
    counter = WorkCounter()
    for i in range(len(model)):
        layer = model.build_layer(i, device="meta").to(dt)
        layer.train()
        inp = x.detach().requires_grad_(i > 0 and x.is_floating_point())
        counter.reset()
        with _FusedAttention(counter), counter:
            y = layer(inp)
        fwd = counter.as_row()
        counter.reset()
        if y.requires_grad:
            with counter:
                y.backward(torch.empty_like(y))
        bwd = counter.as_row()
        rows.append({"layer_index": i, "phase": "fwd", **fwd})
        rows.append({"layer_index": i, "phase": "bwd", **bwd})
        x = y.detach()
    return rows


def _commands(meta: dict[str, Any]) -> list[str]:
    return list(meta.get("commands") or [meta.get("command", "")])


def _models_of_command(command: str) -> dict[str, Any]:
    """The models a ``dynpipe profile`` command line built, by their dataset name."""
    import argparse
    import shlex

    from dynpipe.models import get_model
    from dynpipe.profiler.settings import model_configs

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model", action="append", default=[])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args, _ = parser.parse_known_args(shlex.split(command)[2:])  # drop "dynpipe profile"
    names = [n for item in args.model for n in item.split(",") if n]
    out = {}
    for name, cfg in model_configs(names, overrides=args.overrides):
        model = get_model(name, **cfg)
        out[model.name] = model
    return out


def add_work(df: Any) -> Any:
    """``df`` (profile rows) with ``WORK_COLUMNS`` filled in where they are missing.

    Profiles written before the profiler recorded work counts are completed from their
    metadata: the ``dynpipe profile`` command line each file keeps says which models, with
    which settings, were timed; each is rebuilt on ``meta`` and counted. Rows whose model
    cannot be rebuilt (a factory no longer importable) raise one line naming it.
    """
    import pandas as pd

    from dynpipe.errors import UserError

    have = all(c in df.columns for c in WORK_COLUMNS)
    if have and not df[list(WORK_COLUMNS)].isna().any().any():
        return df
    metas = df.attrs.get("dynpipe") or []
    if isinstance(metas, dict):
        metas = [metas]
    models: dict[str, Any] = {}
    for meta in metas:
        for command in _commands(meta):
            if command:
                try:
                    models.update(_models_of_command(command))
                except Exception as exc:  # a model no longer buildable: named below
                    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    models.setdefault(f"!{command}", first)
    keys = ["model", "batch_size", "dtype"]
    parts = []
    for (model, bs, dt), _ in df.groupby(keys, sort=False):
        built = models.get(str(model))
        if built is None:
            raise UserError(
                f"profile rows of model {model!r} carry no work counts and their metadata does "
                "not say how to rebuild it; re-profile it with this dynpipe (`dynpipe profile`), "
                "which records them"
            )
        work = pd.DataFrame(layer_work(built, batch_size=int(bs), dtype=str(dt)))
        parts.append(work.assign(model=model, batch_size=bs, dtype=dt))
    table = pd.concat(parts, ignore_index=True)
    base = df.drop(columns=[c for c in WORK_COLUMNS if c in df.columns])
    out = base.merge(table, on=[*keys, "layer_index", "phase"], how="left", validate="many_to_one")
    out.index = df.index
    out.attrs = dict(df.attrs)
    return out
