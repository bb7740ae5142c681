"""Static per-layer statistics: FLOPs, parameter/activation bytes, shapes.

Everything is computed on the ``meta`` device, so no memory is allocated and a 12-block GPT
takes well under a second. FLOPs come from ``torch.utils.flop_counter.FlopCounterMode``
(matmuls, convolutions and attention; elementwise ops count as zero). Backward FLOPs are
measured by running a real backward on meta tensors, not estimated as 2x forward.

The planner uses these for cost and memory models, the profiler as static features, the
runtime for receive buffers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.flop_counter import FlopCounterMode

from dynpipe.models.base import LayeredModel

__all__ = ["LayerStats", "layer_stats"]


@dataclass(frozen=True)
class LayerStats:
    """What one layer costs for one batch of ``batch_size`` samples.

    ``in_bytes``/``out_bytes`` are the activation entering/leaving the layer (``out_bytes``
    is what crosses a stage boundary placed after it). ``saved_bytes`` is what autograd keeps
    from the forward until the backward (activations, not parameters): the memory a stage
    holds per in-flight microbatch. Backward FLOPs of layer 0 exclude the gradient of the
    input, which a pipeline never computes.
    """

    name: str
    index: int
    kind: str
    fwd_flops: int
    bwd_flops: int
    param_bytes: int
    param_count: int
    in_bytes: int
    out_bytes: int
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    buffer_bytes: int
    saved_bytes: int = 0

    def as_dict(self) -> dict:
        """JSON/parquet-friendly copy (dtype as a string such as ``"float32"``)."""
        d = asdict(self)
        d["out_shape"] = list(self.out_shape)
        d["out_dtype"] = str(self.out_dtype).removeprefix("torch.")
        return d


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def layer_stats(
    model: LayeredModel, *, batch_size: int, dtype: torch.dtype = torch.float32
) -> list[LayerStats]:
    """Per-layer stats of ``model`` for a batch of ``batch_size``, parameters in ``dtype``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    x, _ = model.input_spec.example(batch_size, device="meta")
    if x.is_floating_point():
        x = x.to(dtype)
    out: list[LayerStats] = []
    for i, spec in enumerate(model.layers):
        layer = model.build_layer(i, device="meta").to(dtype)  # casts floating tensors only
        layer.train()
        params = list(layer.parameters())
        param_storages = {p.untyped_storage()._cdata for p in params}
        # The pipeline's first input is data and needs no gradient; every later input does.
        inp = x.detach().requires_grad_(i > 0 and x.is_floating_point())
        saved: dict[int, int] = {}

        def pack(
            t: torch.Tensor, saved: dict[int, int] = saved, params: set[int] = param_storages
        ) -> torch.Tensor:
            key = t.untyped_storage()._cdata
            if key not in params:
                saved[key] = max(saved.get(key, 0), _nbytes(t))
            return t

        with FlopCounterMode(display=False) as fwd, saved_tensors_hooks(pack, lambda t: t):
            y = layer(inp)
        bwd_flops = 0
        if y.requires_grad:
            with FlopCounterMode(display=False) as bwd:
                y.backward(torch.empty_like(y))
            bwd_flops = bwd.get_total_flops()
        out.append(
            LayerStats(
                name=spec.name,
                index=i,
                kind=spec.kind,
                fwd_flops=fwd.get_total_flops(),
                bwd_flops=bwd_flops,
                param_bytes=sum(_nbytes(p) for p in params),
                param_count=sum(p.numel() for p in params),
                in_bytes=_nbytes(inp),
                out_bytes=_nbytes(y),
                out_shape=tuple(y.shape),
                out_dtype=y.dtype,
                buffer_bytes=sum(_nbytes(b) for b in layer.buffers()),
                saved_bytes=sum(saved.values()),
            )
        )
        x = y.detach()
    return out
