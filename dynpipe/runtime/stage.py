"""One pipeline stage: its layers by stable name, and the torch pipelining stage around them."""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.utils.checkpoint import checkpoint

from dynpipe.models.base import LayeredModel
from dynpipe.planner.plan import Plan
from dynpipe.runtime.timing import LayerProbe, StageTimer

__all__ = ["StageModule", "TimedPipelineStage", "boundary_examples"]


class StageModule(nn.Module):
    """Layers ``[start, stop)`` of a model, held in a ``ModuleDict`` keyed by global name.

    Keys are the model's stable layer names, so parameters and optimizer state are addressed
    by name wherever a layer lives, and checkpoints load under any split.
    """

    def __init__(
        self,
        layers: nn.ModuleDict,
        *,
        autocast_dtype: torch.dtype | None = None,
        out_dtype: torch.dtype | None = None,
        probe: LayerProbe | None = None,
        recompute: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__()
        self.layers = layers
        # Layers that keep only their input and run their forward again in the backward
        # (so a timed backward of one includes its re-forward); not part of the state.
        self.recompute = frozenset(recompute)
        # Per-layer timing on sampled steps (and emulated interference); not a submodule.
        self._probe = probe
        self.autocast_dtype = autocast_dtype
        # Float activations leave the stage in one fixed dtype: the receiving stage's buffers
        # are allocated from static shapes, so the dtype on the wire must not depend on which
        # op happened to run last under autocast.
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = (
            torch.autocast(device_type=x.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        calls = self._calls()
        with ctx:
            if self._probe is not None and self._probe.active:
                x = self._probe.run(calls, x)
            else:
                for layer in calls:
                    x = layer(x)
        if self.out_dtype is not None and x.is_floating_point() and x.dtype != self.out_dtype:
            x = x.to(self.out_dtype)
        return x

    def _calls(self) -> list[Any]:
        if not self.recompute or not torch.is_grad_enabled():
            return list(self.layers.values())
        return [
            functools.partial(_recomputed, layer) if name in self.recompute else layer
            for name, layer in self.layers.items()
        ]


def _recomputed(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Non-reentrant: works with inputs that need no gradient and with hooks on the output;
    # the RNG state is restored for the re-forward, so dropout draws the same mask.
    return checkpoint(layer, x, use_reentrant=False, preserve_rng_state=True)


class TimedPipelineStage(PipelineStage):
    """``PipelineStage`` that times each microbatch's forward and backward compute.

    The schedule waits for its P2P receives before calling these methods, so the intervals
    hold compute only; everything else inside ``schedule.step`` is the stage's wait.
    """

    def __init__(
        self,
        *args: Any,
        timer: StageTimer,
        probe: LayerProbe | None = None,
        local: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.timer = timer
        # The layer probe of this (virtual) stage and its place among the rank's stages.
        self.probe = probe if probe is not None else timer.layers
        self.local = local
        # The last stage keeps every microbatch's output for the schedule to concatenate
        # and return after the step. Training reads only the losses: off, the outputs are
        # freed with each microbatch's backward. For gpt (32000-token vocabulary, 8 x 1024
        # tokens a microbatch) they are 1 GiB of float32 logits each, and the step's
        # concatenation copied 4 GiB more; evaluation turns them back on.
        self.keep_outputs = True

    def forward_one_chunk(self, *args: Any, **kwargs: Any):
        self.timer.layers.chunk = self.probe.chunk = _chunk(args, kwargs, "fwd_chunk_id")
        self.timer.start()
        kept = len(self.output_chunks)
        out = super().forward_one_chunk(*args, **kwargs)
        if not self.keep_outputs and len(self.output_chunks) > kept:
            # An empty stand-in of the same kind: the schedule's merge still finds one
            # chunk per microbatch (torch releases without ``step(return_outputs=...)``).
            last = self.output_chunks[-1]
            if isinstance(last, torch.Tensor):
                self.output_chunks[-1] = last.new_empty((0, *last.shape[1:]))
        self.timer.stop("fwd")
        return out

    def backward_one_chunk(self, *args: Any, **kwargs: Any):
        chunk = _chunk(args, kwargs, "bwd_chunk_id")
        full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
        self.timer.layers.chunk = self.probe.chunk = chunk
        self.timer.start()
        # A zero-bubble input part of the first stage computes nothing (its input needs no
        # gradient): its weight part runs the whole backward and carries the layer marks.
        marks = full or not self.is_first
        if marks:
            self.probe.begin_backward(chunk)
        out = super().backward_one_chunk(*args, **kwargs)
        if marks:
            self.probe.end_backward(chunk)
        self.timer.stop("bwd", key=(self.local, chunk))
        return out

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any):
        chunk = _chunk(args, kwargs, "bwd_chunk_id")
        self.timer.layers.chunk = self.probe.chunk = chunk
        self.timer.start()
        if self.is_first:
            self.timer.marked_in_weight((self.local, chunk))
            self.probe.begin_backward(chunk)
        began = time.perf_counter()
        out = super().backward_weight_one_chunk(*args, **kwargs)
        if self.is_first:
            self.probe.end_backward(chunk)
        else:
            self.probe.stretch(began)  # the hooks stretched the input part only
        self.timer.stop("bwd_w", key=(self.local, chunk))
        return out

    # A forward-only pass (``schedule.eval``) of a V-shaped schedule still walks its backward
    # actions, which skip their compute but hand gradients between the two adjacent stages
    # of one rank; torch asserts there (2.14). Without a backward there is nothing to hand.
    def get_local_bwd_output(self, mb_index: int):
        if not self.has_backward:
            return ()
        return super().get_local_bwd_output(mb_index)

    def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
        if not self.has_backward:
            return
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


def _chunk(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> int:
    return int(args[0]) if args else int(kwargs[name])


def boundary_examples(
    model: LayeredModel,
    plan: Plan,
    stage: int,
    *,
    microbatch_size: int,
    wire_dtype: torch.dtype,
    last_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta tensors describing what stage ``stage`` receives and sends per microbatch.

    Shapes come from tracing the model on the meta device, so no stage has to run a real
    forward (which would touch BatchNorm statistics) or exchange shapes at start-up.
    """
    shapes = model.trace_shapes(microbatch_size)
    st = plan.stages[stage]

    def meta(shape: tuple[int, ...], dtype: torch.dtype, wire: torch.dtype) -> torch.Tensor:
        dt = wire if dtype.is_floating_point else dtype
        return torch.empty(shape, dtype=dt, device="meta", requires_grad=dt.is_floating_point)

    if st.start == 0:
        x, _ = model.input_spec.example(microbatch_size, device="meta")
        inp = x
    else:
        shape, dtype = shapes[st.start - 1]
        inp = meta(shape, dtype, wire_dtype)
    shape, dtype = shapes[st.stop - 1]
    out = meta(shape, dtype, last_dtype if st.stop == plan.num_layers else wire_dtype)
    return inp, out
