"""Per-layer forward and backward timing, with the layer's static features.

``LayerBench`` builds one model at one batch size on one device, runs it once to capture
every layer's real input, and then times any layer's forward (with autograd recording, as
in training) or backward (``retain_graph`` replays of the same graph) in isolation.

A timing *sample* averages ``k`` back-to-back iterations, with ``k`` chosen so the sample
lasts at least ``sample_ms``. Interferers are duty-cycled with a shorter period, so every
sample sees their average load rather than landing by chance in a burst or a pause; the
median over ``repeats`` samples then rejects outliers (a scheduler hiccup, a GC pause).
GPU samples are timed with CUDA events, CPU samples with ``time.perf_counter``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dynpipe.models.base import LayeredModel
from dynpipe.models.stats import layer_stats

__all__ = ["LayerBench", "LayerTiming", "TimingConfig", "dtype_of", "static_features"]

PHASES = ("fwd", "bwd")


def dtype_of(name: str | torch.dtype) -> torch.dtype:
    """``"float32"`` / ``"bfloat16"`` / ``torch.float16`` -> ``torch.dtype``."""
    if isinstance(name, torch.dtype):
        return name
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(
            f"dtype {name!r} is not a floating torch dtype; use float32, bfloat16 or float16"
        )
    return dt


@dataclass(frozen=True)
class TimingConfig:
    """How each (layer, phase) is timed.

    warmup:    untimed iterations first (allocator, cuDNN algorithm choice, caches).
    repeats:   timing samples; the row keeps their median, p10 and p90.
    sample_ms: minimum length of one sample; keep it >= the interferers' period.
    max_iters: cap on iterations per sample for layers far shorter than ``sample_ms``.
    """

    warmup: int = 3
    repeats: int = 5
    sample_ms: float = 25.0
    max_iters: int = 2000

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.repeats < 1 or self.sample_ms <= 0 or self.max_iters < 1:
            raise ValueError(
                f"timing config {self} needs warmup>=1, repeats>=1, sample_ms>0, max_iters>=1"
            )


@dataclass(frozen=True)
class LayerTiming:
    """The measured time of one layer's phase, in milliseconds per iteration."""

    index: int
    phase: str
    time_ms: float
    time_p10_ms: float
    time_p90_ms: float
    repeats: int
    iters_per_sample: int
    samples_ms: tuple[float, ...] = field(default=(), repr=False)


def static_features(
    model: LayeredModel, *, batch_size: int, dtype: str | torch.dtype = "float32"
) -> list[dict[str, Any]]:
    """Per-(layer, phase) static columns of the profile schema and the layer's work counts
    (``dynpipe.profiler.work``), computed on ``meta``."""
    from dynpipe.profiler.work import layer_work

    work = {
        (w["layer_index"], w["phase"]): w
        for w in layer_work(model, batch_size=batch_size, dtype=dtype_of(dtype))
    }
    rows = []
    for st in layer_stats(model, batch_size=batch_size, dtype=dtype_of(dtype)):
        for phase in PHASES:
            flops = float(st.fwd_flops if phase == "fwd" else st.bwd_flops)
            moved = st.param_bytes + st.in_bytes + st.out_bytes
            rows.append(
                {
                    "layer": st.name,
                    "layer_index": st.index,
                    "kind": st.kind,
                    "phase": phase,
                    "flops": flops,
                    "param_bytes": int(st.param_bytes),
                    "param_count": int(st.param_count),
                    "in_bytes": int(st.in_bytes),
                    "out_bytes": int(st.out_bytes),
                    "arith_intensity": flops / moved if moved else 0.0,
                    **{
                        k: v
                        for k, v in work[(st.index, phase)].items()
                        if k not in ("layer_index", "phase")
                    },
                }
            )
    return rows


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def __call__(self, fn: Callable[[], None], k: int) -> float:
        """Milliseconds per call of ``fn`` over ``k`` back-to-back calls."""
        if self.cuda:
            torch.cuda.synchronize()
            self.start.record()
            for _ in range(k):
                fn()
            self.end.record()
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / k
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        return (time.perf_counter() - t0) * 1e3 / k


class LayerBench:
    """One model at one batch size on one device, ready to time any layer in isolation."""

    def __init__(
        self,
        model: LayeredModel,
        *,
        batch_size: int,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
    ) -> None:
        self.model = model
        self.batch_size = int(batch_size)
        self.device = torch.device(device)
        self.dtype = dtype_of(dtype)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.layers = [
            model.build_layer(i, device=self.device).to(self.dtype).train()
            for i in range(len(model))
        ]
        x, _ = model.input_spec.example(self.batch_size, device=self.device)
        if x.is_floating_point():
            x = x.to(self.dtype)
        self.inputs: list[torch.Tensor] = []
        with torch.no_grad():
            for layer in self.layers:
                self.inputs.append(x)
                x = layer(x)
        self._timer = _Timer(self.device)

    def __len__(self) -> int:
        return len(self.layers)

    def _fwd(self, i: int) -> tuple[Callable[[], None], Callable[[], None]]:
        layer = self.layers[i]
        # Layer 0 takes data, which needs no gradient; every later layer's input does, so
        # its forward records the autograd graph exactly as in training.
        x = self.inputs[i].detach().requires_grad_(i > 0 and self.inputs[i].is_floating_point())

        def run() -> None:
            layer(x)

        return run, lambda: None

    def _bwd(self, i: int) -> tuple[Callable[[], None], Callable[[], None]] | None:
        layer = self.layers[i]
        x = self.inputs[i].detach().requires_grad_(i > 0 and self.inputs[i].is_floating_point())
        y = layer(x)
        if not y.requires_grad:
            return None  # nothing to differentiate: no parameters and a data input
        g = torch.randn_like(y)

        def run() -> None:
            y.backward(g, retain_graph=True)
            # The input gradient is sent upstream, not accumulated: keep it from adding up.
            x.grad = None

        def release() -> None:
            nonlocal y
            y = None  # type: ignore[assignment]
            for p in layer.parameters():
                p.grad = None

        return run, release

    def time(self, index: int, phase: str, config: TimingConfig) -> LayerTiming | None:
        """Time one layer's ``"fwd"`` or ``"bwd"``; ``None`` if it has no backward."""
        made = self._fwd(index) if phase == "fwd" else self._bwd(index)
        if made is None:
            return None
        run, release = made
        try:
            for _ in range(config.warmup):
                run()
            once = self._timer(run, 1)
            k = int(min(config.max_iters, max(1, math.ceil(config.sample_ms / max(once, 1e-6)))))
            samples = np.array([self._timer(run, k) for _ in range(config.repeats)])
        finally:
            release()
        return LayerTiming(
            index=index,
            phase=phase,
            time_ms=float(np.median(samples)),
            time_p10_ms=float(np.percentile(samples, 10)),
            time_p90_ms=float(np.percentile(samples, 90)),
            repeats=int(samples.size),
            iters_per_sample=k,
            samples_ms=tuple(float(x) for x in samples),
        )

    def time_all(self, config: TimingConfig) -> Iterator[LayerTiming]:
        """Every layer's forward then backward, in model order."""
        for i in range(len(self.layers)):
            for phase in PHASES:
                t = self.time(i, phase, config)
                if t is not None:
                    yield t
