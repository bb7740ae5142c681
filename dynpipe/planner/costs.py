"""``CostModel``: what every layer costs on every device — the planner's only input.

Plain data: per-device, per-layer forward and backward milliseconds for one microbatch
(numpy ``[D, L]``), per-layer parameter, buffer and activation bytes, an optimizer-state
multiplier, and the links between pipeline-adjacent devices. Device ``d`` is the device of
pipeline stage ``d``: row order is pipeline order.

Three sources fill it, all ending in the same type:

- a profile dataset (``from_profile``): measured times, condition ``none`` or any measured
  interference condition per device;
- the model's static layer statistics (``from_layer_stats`` / ``from_model``): an analytic
  roofline — the fallback until a device has been profiled;
- a slowdown vector or matrix on top of either (``with_slowdown``): what live measurement or
  the learned predictor says interference does to each device and layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from dynpipe.errors import UserError

if TYPE_CHECKING:
    import pandas as pd

    from dynpipe.models.base import LayeredModel

__all__ = ["OPTIMIZER_STATE", "CostModel", "gib", "host_factor", "parse_slowdown"]

# Optimizer state bytes per parameter byte: SGD keeps a momentum buffer, AdamW two moments.
OPTIMIZER_STATE = {"none": 0.0, "sgd": 1.0, "adamw": 2.0, "adam": 2.0}

_GIB = 1024**3


def _arr(x: Any, shape: tuple[int, ...], name: str, *, dtype: type = np.float64) -> np.ndarray:
    a = np.asarray(x, dtype=dtype)
    if a.ndim == 0:
        a = np.full(shape, a.item(), dtype=dtype)
    if a.shape != shape:
        raise UserError(f"cost model field {name} has shape {a.shape}, expected {shape}")
    if not np.all(np.isfinite(a)) or np.any(a < 0):
        raise UserError(
            f"cost model field {name} has negative or non-finite entries; fix its source"
        )
    a = a.copy()
    a.setflags(write=False)
    return a


def host_factor(device_ms: np.ndarray | float, host_ms: np.ndarray | float) -> np.ndarray:
    """How much longer than its device's time a stage takes because of its host: the
    host's issue time of a microbatch (forward and backward) over the device's, at least 1
    (``CostModel.host_fwd_ms``); 1 where the device's time is zero (an empty stage)."""
    device_ms, host_ms = np.asarray(device_ms, float), np.asarray(host_ms, float)
    safe = np.where(device_ms > 0, device_ms, 1.0)
    return np.where(device_ms > 0, np.maximum(1.0, host_ms / safe), 1.0)


@dataclass(frozen=True, eq=False)
class CostModel:
    """Costs of ``L`` layers on ``D`` pipeline-ordered devices, for one microbatch.

    fwd_ms, bwd_ms: ``[D, L]`` milliseconds of layer ``l`` on device ``d``.
    param_bytes: ``[L]`` parameter bytes (gradients take as much again).
    out_bytes: ``[L]`` bytes layer ``l`` hands to ``l + 1``: what crosses a stage boundary
        placed after ``l`` (the gradient coming back is the same size).
    act_bytes: ``[L]`` bytes layer ``l`` keeps for its backward, per microbatch in flight.
    opt_mult: ``[L]`` optimizer-state bytes per parameter byte (``OPTIMIZER_STATE``).
    buffer_bytes: ``[L]`` non-trainable state (batch-norm statistics), moved with the layer.
    bandwidth: ``[D - 1]`` bytes/s of the link between device ``d`` and ``d + 1``.
    latency_ms: ``[D - 1]`` per-transfer latency of those links.
    microbatch_size: samples per microbatch the times were measured or estimated for.
    stage_fwd_ms, stage_bwd_ms: ``[D]`` what a stage on device ``d`` costs per microbatch
        beyond its layers, whichever it holds (framework work around them: input casts, the
        loss); zeros unless measured.
    host_fwd_ms, host_bwd_ms: ``[D, L]`` what the host takes to issue layer ``l``'s work for
        device ``d`` (GPU; None where it is not known, and on a CPU, where issuing is the
        work). A stage then costs the longer of its device's time (its layers' ``fwd_ms``
        plus the stage's overhead) and its host's (the sum of these): the host issues a
        layer's kernels while the device still runs earlier ones, so a stage is bound by
        one sum or the other, not by the sum of each layer's longer time. On 4 x H200,
        vgg16's last nine layers took the host 4.9 ms a microbatch and the device 3.4; the
        stage ran 3.4 ms where it waited for its inputs anyway, and 6.3-6.9 ms with three
        more layers (host 5.4-6.1 ms, device 5.0), where it bounded the step. The sums are
        a microbatch's forward and backward together (``host_factor``): one host issues
        both in turn, so where it runs ahead of the device in the forward it has that
        time for the backward. On 2 x H200, resnet50's first nine layers at 128 images
        took the host 10.5 ms of forward and 31.3 of backward a microbatch against the
        device's 16.2 and 26.4; the stage ran its device's 42.6 ms, and pricing each phase
        at its longer time (47.5 ms) hid a 23% faster split.
    recompute: which layers a stage recomputes in its backward (``dynpipe.planner.recompute``):
        ``none``, ``all``, or ``auto`` (the cheapest that fit the stage in its device's
        memory). A recomputed layer keeps only its input and adds its forward to the
        stage's backward.
    """

    model: str
    layer_names: tuple[str, ...]
    fwd_ms: np.ndarray
    bwd_ms: np.ndarray
    param_bytes: np.ndarray
    out_bytes: np.ndarray
    act_bytes: np.ndarray
    opt_mult: np.ndarray
    buffer_bytes: np.ndarray
    bandwidth: np.ndarray
    latency_ms: np.ndarray
    microbatch_size: int = 1
    fingerprint: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    stage_fwd_ms: np.ndarray | None = None
    stage_bwd_ms: np.ndarray | None = None
    host_fwd_ms: np.ndarray | None = None
    host_bwd_ms: np.ndarray | None = None
    recompute: str = "none"

    def __post_init__(self) -> None:
        if self.recompute not in ("none", "all", "auto"):
            raise UserError(f"cost model recompute {self.recompute!r}; use one of none, all, auto")
        fwd = np.asarray(self.fwd_ms, dtype=np.float64)
        if fwd.ndim == 1:
            fwd = fwd[None, :]
        if fwd.ndim != 2:
            raise UserError(f"fwd_ms must be [devices, layers], got shape {fwd.shape}")
        d, n = fwd.shape
        if n != len(self.layer_names):
            raise UserError(
                f"cost model has times for {n} layers but {len(self.layer_names)} layer names"
            )
        if n < 1 or d < 1:
            raise UserError("cost model needs at least one device and one layer")
        bwd = np.asarray(self.bwd_ms, dtype=np.float64)
        if bwd.ndim == 1:
            bwd = bwd[None, :]
        set_ = object.__setattr__
        set_(self, "layer_names", tuple(self.layer_names))
        set_(self, "fwd_ms", _arr(fwd, (d, n), "fwd_ms"))
        set_(self, "bwd_ms", _arr(bwd, (d, n), "bwd_ms"))
        for name in ("param_bytes", "out_bytes", "act_bytes", "opt_mult", "buffer_bytes"):
            set_(self, name, _arr(getattr(self, name), (n,), name))
        for name in ("stage_fwd_ms", "stage_bwd_ms"):
            v = getattr(self, name)
            set_(self, name, _arr(0.0 if v is None else v, (d,), name))
        for name in ("host_fwd_ms", "host_bwd_ms"):
            v = getattr(self, name)
            if v is not None:
                v = np.asarray(v, dtype=np.float64)
                set_(self, name, _arr(v[None, :] if v.ndim == 1 else v, (d, n), name))
        if (self.host_fwd_ms is None) != (self.host_bwd_ms is None):
            raise UserError("cost model has host times for one phase only; give both or neither")
        links = max(d - 1, 0)
        set_(self, "bandwidth", _arr(self.bandwidth, (links,), "bandwidth"))
        set_(self, "latency_ms", _arr(self.latency_ms, (links,), "latency_ms"))
        if np.any(self.bandwidth <= 0):
            raise UserError(f"link bandwidth must be > 0 bytes/s, got {self.bandwidth.tolist()}")
        set_(self, "meta", dict(self.meta))

    # ---- views -------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return int(self.fwd_ms.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.fwd_ms.shape[1])

    @property
    def static_bytes(self) -> np.ndarray:
        """Per-layer resident bytes independent of microbatches: params, grads, optimizer, buffers."""
        return self.param_bytes * (2.0 + self.opt_mult) + self.buffer_bytes

    @property
    def state_bytes(self) -> np.ndarray:
        """Per-layer bytes a migration moves: parameters, optimizer state and buffers."""
        return self.param_bytes * (1.0 + self.opt_mult) + self.buffer_bytes

    def __repr__(self) -> str:
        src = self.meta.get("source", "?")
        return (
            f"CostModel({self.model} L={self.num_layers} D={self.num_devices} "
            f"mb={self.microbatch_size} src={src} "
            f"fwd+bwd={(self.fwd_ms + self.bwd_ms).sum(axis=1).round(2).tolist()}ms)"
        )

    @property
    def has_host(self) -> bool:
        """Whether host issue times bound stages (see ``host_fwd_ms``)."""
        return self.host_fwd_ms is not None

    def stage_ms(self, device: int, a: int, b: int) -> tuple[float, float]:
        """Forward and backward ms per microbatch of layers ``[a, b)`` as one stage on
        ``device``: its layers and overhead, or its host's issue time where that is longer."""
        f = float(self.fwd_ms[device, a:b].sum() + self.stage_fwd_ms[device])
        b_ = float(self.bwd_ms[device, a:b].sum() + self.stage_bwd_ms[device])
        if self.host_fwd_ms is not None and self.host_bwd_ms is not None:
            host = float(self.host_fwd_ms[device, a:b].sum() + self.host_bwd_ms[device, a:b].sum())
            k = float(host_factor(f + b_, host))
            f, b_ = f * k, b_ * k
        return f, b_

    # ---- transformations ---------------------------------------------------------------
    def for_devices(self, num_devices: int) -> CostModel:
        """This model on ``num_devices`` devices: a one-device model is repeated.

        The repeated model's links take ``meta["link_bandwidth"]`` / ``["link_latency_ms"]``
        (set by every constructor; 25 GB/s and 0 ms if absent).
        """
        if num_devices == self.num_devices:
            return self
        if self.num_devices != 1:
            raise UserError(
                f"cost model describes {self.num_devices} devices but {num_devices} stages were "
                f"asked for; plan {self.num_devices} stages or give one cost row per stage"
            )
        bw = self.meta.get("link_bandwidth", 25e9)
        lat = self.meta.get("link_latency_ms", 0.0)
        return replace(
            self,
            fwd_ms=np.repeat(self.fwd_ms, num_devices, axis=0),
            bwd_ms=np.repeat(self.bwd_ms, num_devices, axis=0),
            stage_fwd_ms=np.repeat(self.stage_fwd_ms, num_devices),
            stage_bwd_ms=np.repeat(self.stage_bwd_ms, num_devices),
            host_fwd_ms=_repeat(self.host_fwd_ms, num_devices),
            host_bwd_ms=_repeat(self.host_bwd_ms, num_devices),
            bandwidth=np.full(num_devices - 1, bw),
            latency_ms=np.full(num_devices - 1, lat),
        )

    def with_slowdown(
        self,
        slowdown: Sequence[float] | np.ndarray,
        *,
        bwd: Sequence[float] | np.ndarray | None = None,
    ) -> CostModel:
        """Times scaled by a per-device vector ``[D]`` or a per-layer matrix ``[D, L]``.

        ``slowdown[d] = 2.4`` means device ``d`` runs 2.4× slower (interference). ``bwd``
        gives a separate factor for backward (the predictor's per-phase output); it defaults
        to ``slowdown``.
        """
        f = self._factor(slowdown, "slowdown")
        b = f if bwd is None else self._factor(bwd, "bwd slowdown")
        meta = dict(self.meta)
        meta["slowdown"] = np.asarray(slowdown, dtype=float).round(4).tolist()
        return replace(self, fwd_ms=self.fwd_ms * f, bwd_ms=self.bwd_ms * b, meta=meta)

    def _factor(self, x: Sequence[float] | np.ndarray, what: str) -> np.ndarray:
        a = np.asarray(x, dtype=np.float64)
        d, n = self.fwd_ms.shape
        if a.ndim == 1 and a.shape[0] == d:
            a = a[:, None]
        elif a.shape != (d, n):
            raise UserError(
                f"{what} has shape {a.shape}; give one factor per device ({d}) or a "
                f"[{d}, {n}] per-layer matrix"
            )
        if not np.all(np.isfinite(a)) or np.any(a <= 0):
            raise UserError(f"{what} factors must be finite and > 0, got {a.ravel()[:8].tolist()}")
        return a

    # ---- plain-data form ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k in self.__dataclass_fields__:
            v = getattr(self, k)
            out[k] = (
                v.tolist()
                if isinstance(v, np.ndarray)
                else (list(v) if isinstance(v, tuple) else v)
            )
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        return cls(**d)

    # ---- constructors ------------------------------------------------------------------
    @classmethod
    def from_layer_stats(
        cls,
        stats: Sequence[Any],
        *,
        model: str,
        num_devices: int = 1,
        flops_per_s: float = 100e12,
        mem_bytes_per_s: float | None = 2e12,
        overhead_ms: float = 0.01,
        bandwidth: float = 25e9,
        latency_ms: float = 0.02,
        optimizer: str = "adamw",
        act_bytes: Sequence[float] | None = None,
        microbatch_size: int = 1,
        fingerprint: str | None = None,
    ) -> CostModel:
        """Analytic roofline from ``dynpipe.models.stats.layer_stats`` records.

        A layer's time is ``max(flops / flops_per_s, bytes / mem_bytes_per_s) + overhead``,
        bytes being its parameters plus input and output (backward touches them twice and
        also writes the weight gradient). Activations kept for backward are the records'
        ``saved_bytes`` (what autograd keeps, measured on meta), else input plus output.
        """
        if optimizer not in OPTIMIZER_STATE:
            raise UserError(
                f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATE)}"
            )
        if flops_per_s <= 0:
            raise UserError(f"device throughput must be > 0 FLOP/s, got {flops_per_s}")
        st = sorted(stats, key=lambda s: s.index)
        g = lambda attr: np.array([float(getattr(s, attr)) for s in st])  # noqa: E731
        pb, ib, ob = g("param_bytes"), g("in_bytes"), g("out_bytes")
        fwd_t = g("fwd_flops") / flops_per_s
        bwd_t = g("bwd_flops") / flops_per_s
        if mem_bytes_per_s:
            fwd_t = np.maximum(fwd_t, (pb + ib + ob) / mem_bytes_per_s)
            bwd_t = np.maximum(bwd_t, (3 * pb + 2 * ib + 2 * ob) / mem_bytes_per_s)
        fwd = fwd_t * 1e3 + overhead_ms
        bwd = bwd_t * 1e3 + 2 * overhead_ms
        n = len(st)
        if act_bytes is not None:
            acts = np.asarray(act_bytes, dtype=float)
        else:
            saved = np.array([float(getattr(s, "saved_bytes", 0) or 0) for s in st])
            acts = saved if saved.any() else ib + ob
        return cls(
            model=model,
            layer_names=tuple(s.name for s in st),
            fwd_ms=np.tile(fwd, (num_devices, 1)),
            bwd_ms=np.tile(bwd, (num_devices, 1)),
            param_bytes=pb,
            out_bytes=ob,
            act_bytes=acts,
            opt_mult=np.full(n, OPTIMIZER_STATE[optimizer]),
            buffer_bytes=g("buffer_bytes"),
            bandwidth=np.full(num_devices - 1, float(bandwidth)),
            latency_ms=np.full(num_devices - 1, float(latency_ms)),
            microbatch_size=microbatch_size,
            fingerprint=fingerprint,
            meta={
                "source": "analytic",
                "flops_per_s": flops_per_s,
                "mem_bytes_per_s": mem_bytes_per_s,
                "overhead_ms": overhead_ms,
                "optimizer": optimizer,
                "link_bandwidth": float(bandwidth),
                "link_latency_ms": float(latency_ms),
            },
        )

    @classmethod
    def from_model(
        cls,
        model: LayeredModel,
        *,
        microbatch_size: int,
        dtype: str = "float32",
        **kwargs: Any,
    ) -> CostModel:
        """Analytic costs of a zoo model (``from_layer_stats`` over ``layer_stats``)."""
        try:
            from dynpipe.models.stats import layer_stats
        except ModuleNotFoundError as exc:
            raise UserError(
                f"analytic costs need dynpipe.models.stats ({exc}); give a profile with "
                "--profile instead"
            ) from None
        import torch

        torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        stats = layer_stats(model, batch_size=microbatch_size, dtype=torch_dtype)
        cm = cls.from_layer_stats(
            stats,
            model=model.name,
            microbatch_size=microbatch_size,
            fingerprint=model.fingerprint(),
            **kwargs,
        )
        cm.meta["dtype"] = str(dtype)
        return cm

    @classmethod
    def from_profile(
        cls,
        profile: pd.DataFrame | str | Sequence[str],
        *,
        model: str,
        microbatch_size: int,
        conditions: Sequence[str] | str = "none",
        bandwidth: float = 25e9,
        latency_ms: float = 0.02,
        optimizer: str = "adamw",
        act_bytes: Sequence[float] | None = None,
        fingerprint: str | None = None,
    ) -> CostModel:
        """Measured costs from a profile dataset (columns in ``dynpipe.profiler.schema``).

        ``conditions[d]`` picks the measured condition for device ``d`` (``"none"`` = clean;
        e.g. ``["none", "gemm@0.5x2"]`` puts device 1 under that measured interference).
        A single string applies to one device (repeat with ``for_devices``). Times profiled at
        another batch size are scaled linearly from the nearest one, which ``meta`` records.
        """
        from dynpipe.planner.profile_costs import profile_times

        conds = [conditions] if isinstance(conditions, str) else list(conditions)
        t = profile_times(profile, model=model, microbatch_size=microbatch_size, conditions=conds)
        if optimizer not in OPTIMIZER_STATE:
            raise UserError(
                f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATE)}"
            )
        n = len(t.layer_names)
        d = len(conds)
        acts = (
            np.asarray(act_bytes, dtype=float)
            if act_bytes is not None
            else t.in_bytes + t.out_bytes
        )
        return cls(
            model=model,
            layer_names=t.layer_names,
            fwd_ms=t.fwd_ms,
            bwd_ms=t.bwd_ms,
            param_bytes=t.param_bytes,
            out_bytes=t.out_bytes,
            act_bytes=acts,
            opt_mult=np.full(n, OPTIMIZER_STATE[optimizer]),
            buffer_bytes=np.zeros(n),
            bandwidth=np.full(d - 1, float(bandwidth)),
            latency_ms=np.full(d - 1, float(latency_ms)),
            microbatch_size=microbatch_size,
            fingerprint=fingerprint,
            meta={
                "source": "profile",
                **t.meta,
                "conditions": conds,
                "optimizer": optimizer,
                "link_bandwidth": float(bandwidth),
                "link_latency_ms": float(latency_ms),
            },
        )


def _repeat(x: np.ndarray | None, n: int) -> np.ndarray | None:
    return None if x is None else np.repeat(x, n, axis=0)


def _num(text: str, whole: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UserError(
            f"cannot parse --slowdown {whole!r}; give factors like 1,2.4 or pairs like 1:2.4"
        ) from None


def parse_slowdown(text: str, num_devices: int) -> list[float]:
    """``"1,2.4"`` (one factor per device) or ``"1:2.4"`` (device:factor pairs) → ``[D]``."""
    out = [1.0] * num_devices
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if parts and all(":" in p for p in parts):
        for p in parts:
            dev, _, fac = p.partition(":")
            d = int(_num(dev, text))
            if not 0 <= d < num_devices:
                raise UserError(
                    f"--slowdown names device {d} but there are {num_devices} stages "
                    f"(devices 0–{num_devices - 1})"
                )
            out[d] = _num(fac, text)
    else:
        vals = [_num(p, text) for p in parts]
        if len(vals) != num_devices:
            raise UserError(
                f"--slowdown has {len(vals)} factors for {num_devices} stages; give one per "
                f"stage (e.g. {','.join(['1'] * (num_devices - 1) + ['2.4'])}) or "
                "device:factor pairs (e.g. 1:2.4)"
            )
        out = vals
    if any(not np.isfinite(v) or v <= 0 for v in out):
        raise UserError(f"--slowdown factors must be > 0, got {out}")
    return out


def gib(x: float) -> str:
    """Bytes as GiB text for messages and tables."""
    return f"{x / _GIB:.2f} GiB"
