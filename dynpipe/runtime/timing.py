"""Compute timers for a stage: per microbatch always, per layer on sampled steps.

``StageTimer`` times every microbatch's forward and backward of the stage (a pair of CUDA
events resolved once per step, after the step's own synchronisation, or a ``perf_counter``
pair on CPU). Time the stage spends in its schedule that is not forward or backward compute
is its wait: P2P receives and pipeline bubbles. With data parallelism the last backward of a
step also waits for the gradient all-reduce across replicas (which waits for the slowest
replica): the reduce hook marks when the last gradient bucket was handed over, and the rest
of that backward counts as the step's reduce time, not as compute.

``LayerProbe`` times every layer the stage holds, forward and backward, on the steps the
training loop asks it to sample. Stage totals cannot say how a stage's time splits among its
layers (full-resolution convolutions take far longer per FLOP than later ones; a vocabulary
projection less than its FLOPs suggest), so the controller plans from these per-layer
measurements instead of FLOP shares. Forward: a mark between consecutive layers. Backward: a
hook on every boundary tensor's gradient; the gradient of layer ``j``'s output arrives when
its backward starts, the gradient of its input when its backward ends. The hooks return
nothing, so they never change what is computed.

On a GPU a layer costs the longer of two times: what the device takes to run its kernels
and what the host takes to issue them (Python, autograd and the launches). The events time
the first only where the device is the stage's limit; on a stage whose host runs ahead of
its device they see the kernels alone, on a stage the host holds back they see the gaps
between launches. A transformer block at a small microbatch runs in 0.26 ms on an H100 and
takes 0.6-1.0 ms to issue: which stage is the host-bound one then decides what its layers
seem to cost, and a controller that read the events alone moved layers to the stage whose
host had slack and found it slower (gpt 12 x 768, 8 x 512 tokens per microbatch). So on a
GPU the probe also takes host times (``perf_counter`` at the same marks: forward around
each layer, backward in the same gradient hooks, which autograd calls as it issues each
layer's backward), and a layer's cost is the longer of the two.

A sampled step times every layer on a few of its microbatches (``SAMPLED_MICROBATCHES``,
spread over the step), not all of them: each mark costs the host an event record, a clock
read and a gradient hook, and on a stage whose host barely keeps ahead of its device (vgg16
at 16 images per microbatch on an H200: a layer runs in 0.1 ms) marking every layer of every
microbatch made the sampled step 8 ms longer. Every microbatch of a step runs the same
layers on the same shapes, so the median of three says what the median of eight says.
Events come from a pool that lives as long as the timer, so a step creates none.

Zero-bubble schedules (torch's ``zb``, ``zbv``, ``dualpipev``) split a microbatch's backward
into an input-gradient part (``I``) and a weight-gradient part (``W``) that run at different
times. Both are timed: a stage's backward of a microbatch is ``I + W`` (``StepTiming.bwd_ms``;
the W parts alone in ``bwd_w_ms``). The layer marks are taken in the part that runs the
autograd graph through the layers' boundaries (``I``; on the first stage, whose input needs no
gradient, ``W`` runs the whole backward), and each layer's backward is scaled by the stage's
``(I + W) / marked part`` over the same microbatches: the weight-gradient time is spread over
the layers in proportion to their marked backward (weight- and input-gradient costs of dense
layers are of one size; the stage total is exact).

A rank holding several virtual stages has one ``LayerProbe`` per virtual stage
(``StageTimer.probes``, in pipeline order): their per-layer readings join in layer order.

Emulated interference (tests, CPU demos without a real interferer) stretches every layer's
forward and backward to ``dilation`` times its length, so the per-layer timings see it where a
real interferer would put it: in the layers, not in the stage's overhead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

__all__ = [
    "SAMPLED_MICROBATCHES",
    "LayerProbe",
    "LayerTiming",
    "StageTimer",
    "StepTiming",
    "queue_ahead",
    "sampled_chunks",
]

# Microbatches of a sampled step whose layers are timed (see the module docstring).
SAMPLED_MICROBATCHES = 3


@dataclass
class LayerTiming:
    """Per-layer compute of one sampled step on one stage, per microbatch (median over the
    step's microbatches), in ms; ``stage_fwd_ms``/``stage_bwd_ms`` are the stage timer's
    medians over the same microbatches (what the stage spent beyond its layers is overhead).
    With data parallelism the backward that ran the gradient all-reduce is left out of
    ``stage_bwd_ms`` where another is left: its layers are not timed (``sampled_chunks``'s
    ``spare_last``), and its time beyond theirs is the reduce's, not the stage's overhead."""

    fwd_ms: list[float]
    bwd_ms: list[float]
    stage_fwd_ms: float = float("nan")
    stage_bwd_ms: float = float("nan")
    # GPU: the host's time to issue each layer (``fwd_ms``/``bwd_ms`` already take the
    # longer of it and the device's); None on CPU, where the two are one time.
    launch_fwd_ms: list[float] | None = None
    launch_bwd_ms: list[float] | None = None
    # GPU: the device's time alone (the events), for the planner's stage model: a stage is
    # bound by its layers' device times or by its host's issue times, whichever sum is
    # longer (``CostModel.host_fwd_ms``). None on CPU.
    device_fwd_ms: list[float] | None = None
    device_bwd_ms: list[float] | None = None


@dataclass
class StepTiming:
    """One step of one stage, in milliseconds."""

    fwd_ms: list[float] = field(default_factory=list)
    bwd_ms: list[float] = field(default_factory=list)
    schedule_ms: float = 0.0
    layers: LayerTiming | None = None
    reduce_ms: float = 0.0  # data parallelism: the gradient all-reduce's tail and wait
    # The optimizer's update of the stage's parameters (device time on a GPU): it runs
    # after the step's last backward and grows with the parameters a rank holds, which
    # the shape decides (every parameter in DP only, a quarter in a 4-stage pipeline).
    update_ms: float = float("nan")
    # Zero-bubble schedules: the weight-gradient parts of the backwards (already counted in
    # ``bwd_ms``, which holds each microbatch's input- plus weight-gradient time).
    bwd_w_ms: list[float] = field(default_factory=list)

    @property
    def fwd_total(self) -> float:
        return float(sum(self.fwd_ms))

    @property
    def bwd_total(self) -> float:
        return float(sum(self.bwd_ms))

    @property
    def wait_ms(self) -> float:
        return max(0.0, self.schedule_ms - self.fwd_total - self.bwd_total - self.reduce_ms)


class _EventPool:
    """Timing events recorded in order and handed out again after ``reset``: a step's marks
    are read (``elapsed_time``) before the next step records over them."""

    def __init__(self) -> None:
        self._events: list[torch.cuda.Event] = []
        self._next = 0

    def mark(self) -> torch.cuda.Event:
        if self._next == len(self._events):
            self._events.append(torch.cuda.Event(enable_timing=True))
        ev = self._events[self._next]
        self._next += 1
        ev.record()
        return ev

    def reset(self) -> None:
        self._next = 0


def _marker(cuda: bool):
    """A mark function (a pooled CUDA event, or ``perf_counter`` on CPU) and its pool."""
    if cuda:
        pool = _EventPool()
        return pool.mark, pool
    return time.perf_counter, None


def sampled_chunks(
    microbatches: int, k: int = SAMPLED_MICROBATCHES, *, spare_last: bool = False
) -> frozenset[int]:
    """The microbatches of a step whose layers are timed: ``k`` spread evenly over the step
    (its middle, where 1F1B runs steady, rather than its first warm-up forwards), all of
    them when there are no more than ``k``.

    ``spare_last``: leave the step's last microbatch out where another one is left to time.
    With pipeline replicas the gradient all-reduce runs during that microbatch's backward
    (``dataparallel``), and its kernels share the device with the backward's: gpt 12 x 2048
    as DP only on 4 x H200 (two microbatches of 4 a replica, both timed) read a block's
    backward at 2.30 ms before the interferer came, against 2.00 in one pipeline at the
    same microbatch size, which reduces nothing. A shape priced from those costs carried
    the reduce twice: in its layers, and as the reduce's own tail."""
    if spare_last and microbatches > 1:
        got = sampled_chunks(microbatches, k)
        return got if microbatches - 1 not in got else sampled_chunks(microbatches - 1, k)
    if microbatches <= k:
        return frozenset(range(microbatches))
    return frozenset(round((i + 1) * microbatches / (k + 1)) for i in range(k))


# Device cycles per millisecond of ``torch.cuda._sleep``, per device index (``queue_ahead``).
_SLEEP_CYCLES_PER_MS: dict[int, float] = {}
# The longest lead ``queue_ahead`` gives: a probe's host issue time is a few milliseconds; a
# first run's (allocation, kernel choice) can read far more, and the lead costs device time.
_MAX_LEAD_MS = 100.0


def queue_ahead(device: torch.device, ms: float) -> None:
    """Keep a CUDA ``device`` busy for about ``ms`` so that the kernels the host issues next
    queue up behind it and then run back to back (nothing on other devices).

    Events around kernels time the device only where it runs ahead of its host's issue. A
    probe times one layer alone on a device with nothing else queued: each kernel runs as
    soon as it is issued and the events read the host's pace instead (4 x H100, gpt
    12 x 2048: a block's forward probed at 1.3-1.8 ms on a clean, idle GPU against 0.94 ms
    held in a stage, so the clean device read 1.2-1.8x slow and a dropped GPU was never
    taken back). A spin of ``ms`` issued first lets the host queue the probe's kernels;
    the events then see what a stage's timers see. The spin's cycles per millisecond are
    measured once per device."""
    if device.type != "cuda" or ms <= 0:
        return
    idx = device.index if device.index is not None else torch.cuda.current_device()
    rate = _SLEEP_CYCLES_PER_MS.get(idx)
    if rate is None:
        with torch.cuda.device(idx):
            torch.cuda._sleep(1000)  # the spin kernel's first launch (module load)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            cycles = 2_000_000
            a.record()
            torch.cuda._sleep(cycles)
            b.record()
            b.synchronize()
            rate = _SLEEP_CYCLES_PER_MS[idx] = cycles / max(a.elapsed_time(b), 1e-3)
    with torch.cuda.device(idx):
        torch.cuda._sleep(int(rate * min(ms, _MAX_LEAD_MS)))


def _elapsed_ms(cuda: bool, a, b) -> float:
    return a.elapsed_time(b) if cuda else (b - a) * 1e3


class LayerProbe:
    """Marks layer boundaries of one stage in forward and backward, per microbatch.

    The pipeline stage tells it which microbatch runs (``chunk``) and when a backward begins
    and ends; ``run`` executes the layers. Idle (no sampling, no dilation) it costs nothing:
    the stage runs its layers directly.
    """

    def __init__(self, *, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._device_mark, self._pool = _marker(self.cuda)
        self.sampling = False
        # The microbatches a sampled step times (None: every one).
        self.chunks: frozenset[int] | None = None
        self.dilation = 1.0
        self.chunk = 0
        # Per microbatch: forward marks [n + 1]; backward marks by boundary index; the
        # backward's begin and end marks (see ``_mark``).
        self._fwd: dict[int, list] = {}
        self._bwd: dict[int, dict[int, object]] = {}
        self._bwd_edges: dict[int, tuple[object, object]] = {}
        self._n = 0
        self._t_last = 0.0  # host time of the last backward mark (dilation)
        # Data parallelism: gradients went to the all-reduce, so what follows in this
        # backward is waiting for other replicas, which emulation must not stretch.
        self._handed = False
        # The mark where a timed backward's last gradient bucket went to the all-reduce.
        self._handed_mark: object | None = None
        self.in_backward = False

    def _mark(self) -> object:
        """A boundary mark: ``perf_counter`` on CPU; on a GPU an event and the host's
        ``perf_counter`` together (the device's and the host's time, from the same marks)."""
        if self.cuda:
            return self._device_mark(), time.perf_counter()
        return self._device_mark()

    @property
    def active(self) -> bool:
        return self.sampling or self.dilation > 1.0

    def _timed(self, chunk: int) -> bool:
        return self.sampling and (self.chunks is None or chunk in self.chunks)

    def _stretch(self, since: float) -> float:
        """Emulated interference: sleep (dilation - 1) x the time since ``since``."""
        now = time.perf_counter()
        if self.dilation > 1.0:
            # A sleep overshoots by ~0.1 ms, as long as a small layer's whole forward: sleep
            # for all but the last millisecond, then spin to the deadline.
            deadline = now + (now - since) * (self.dilation - 1.0)
            if deadline - now > 2e-3:
                time.sleep(deadline - now - 1e-3)
            while time.perf_counter() < deadline:
                pass
            now = time.perf_counter()
        return now

    def stretch(self, since: float) -> float:
        """Emulated interference on work the layer marks do not see (a zero-bubble
        schedule's weight-gradient part): stretch what ran since ``since``."""
        return self._stretch(since)

    def run(self, layers: Iterable[nn.Module], x: torch.Tensor) -> torch.Tensor:
        layers = list(layers)
        self._n = len(layers)
        chunk = self.chunk
        rec = self._timed(chunk)
        if not rec and self.dilation <= 1.0:
            for layer in layers:  # a microbatch the sampled step does not time
                x = layer(x)
            return x
        fmarks = [self._mark()] if rec else None
        bmarks: dict[int, object] = {}
        if rec:
            self._fwd[chunk], self._bwd[chunk] = fmarks, bmarks  # type: ignore[assignment]
        self._hook(x, 0, bmarks, rec)
        t = time.perf_counter()
        for j, layer in enumerate(layers):
            x = layer(x)
            t = self._stretch(t)
            if fmarks is not None:
                fmarks.append(self._mark())
            self._hook(x, j + 1, bmarks, rec)
        return x

    def _hook(self, x: object, boundary: int, bmarks: dict[int, object], rec: bool) -> None:
        if not (isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled()):
            return

        def on_grad(_grad: torch.Tensor) -> None:
            self._t_last = self._stretch(self._t_last)
            if rec:
                bmarks[boundary] = self._mark()

        x.register_hook(on_grad)

    def begin_backward(self, chunk: int) -> None:
        self._t_last = time.perf_counter()
        self._handed = False
        self._handed_mark = None
        self.in_backward = True
        if self._timed(chunk):
            self._bwd_edges[chunk] = (self._mark(), None)

    def handed_to_reduce(self) -> None:
        """Gradients went to the data-parallel all-reduce: the compute since the last mark
        is stretched now, before the reduce starts, as a slowed device would delay it.

        The last call of a timed backward also ends its compute: what the backward does
        after it is the all-reduce and its wait for the slowest replica, which a first
        layer whose input takes no gradient would otherwise be charged with (its backward
        ends where the stage's does). On 4 x H200, gpt 12x2048 in DP only, the embedding's
        backward read 1.0-4.5 ms clean and 45 ms with one replica slowed, against 0.19 ms
        as the first stage of one pipeline, and the planner priced every shape that put
        the embedding alone at that wait."""
        self._t_last = self._stretch(self._t_last)
        self._handed = True
        if self._timed(self.chunk):
            self._handed_mark = self._mark()

    def end_backward(self, chunk: int) -> None:
        # The first layer's backward ends with the stage's (its input may need no gradient).
        if not self._handed:
            self._t_last = self._stretch(self._t_last)
        handed, self._handed_mark = self._handed_mark, None
        self._handed = self.in_backward = False
        if self.sampling and chunk in self._bwd_edges:
            end = handed if handed is not None else self._mark()
            self._bwd_edges[chunk] = (self._bwd_edges[chunk][0], end)

    def collect(
        self,
    ) -> tuple[list[float], list[float], list | None, list | None, list | None, list | None] | None:
        """Per-layer (fwd, bwd) costs, medians over the sampled microbatches, and on a GPU
        the host's (fwd, bwd) times to issue them and the device's (fwd, bwd) times alone
        (else None), then reset. On a GPU a cost is the longer of the device's time and the
        host's (see the module docstring); NaN (an untimed backward) stays NaN."""
        fwd, bwd, edges, n = self._fwd, self._bwd, self._bwd_edges, self._n
        self._fwd, self._bwd, self._bwd_edges = {}, {}, {}
        if self._pool is not None:
            # Handed out again from the next mark on; the marks below keep their times until
            # recorded over, which no step does before this one's are read.
            self._pool.reset()
        if not fwd:
            return None
        if not self.cuda:
            f, b = self._medians(fwd, bwd, edges, n, lambda a, b: (b - a) * 1e3)
            return f, b, None, None, None, None
        f, b = self._medians(fwd, bwd, edges, n, lambda a, b: a[0].elapsed_time(b[0]))
        hf, hb = self._medians(fwd, bwd, edges, n, lambda a, b: (b[1] - a[1]) * 1e3)
        longer = lambda d, h: [max(x, y) if x == x else x for x, y in zip(d, h, strict=True)]  # noqa: E731
        return longer(f, hf), longer(b, hb), hf, hb, f, b

    @staticmethod
    def _medians(fwd: dict, bwd: dict, edges: dict, n: int, ms) -> tuple[list, list]:
        f_rows, b_rows = [], []
        for chunk, marks in fwd.items():
            f_rows.append([ms(marks[j], marks[j + 1]) for j in range(n)])
            begin, end = edges.get(chunk, (None, None))
            if begin is None or end is None:
                continue
            # Boundary n's gradient arrives when the backward starts (the loss, or the next
            # stage's gradient, is handed in). Boundary 0's: when its hook saw the input's
            # gradient, or (an input that needs none) when the backward's compute ends (with
            # data parallelism where its last gradient bucket went to the all-reduce, see
            # ``handed_to_reduce``; else the backward's end). Not the end
            # where the hook fired: what the stage does after the input's gradient is not the
            # first layer's (on 2 x H200, gpt's last stage ended its backward 6 ms after its
            # first block's gradient while the stage before it was slowed, and the block
            # seemed to cost 8.3 ms instead of 2).
            bm = {n: begin, **{k: v for k, v in bwd[chunk].items() if 0 <= k < n}}
            bm.setdefault(0, end)
            missing = [j for j in range(1, n) if j not in bm]
            if missing == list(range(1, len(missing) + 1)):
                # No gradient reached the first boundaries: the leading layers need none
                # (frozen, or nothing before them trains), so their backward takes no time.
                bm.update(dict.fromkeys(missing, end))
            if len(bm) == n + 1:
                b_rows.append([ms(bm[j + 1], bm[j]) for j in range(n)])
        f = np.median(np.array(f_rows), axis=0).tolist()
        b = np.median(np.array(b_rows), axis=0).tolist() if b_rows else [float("nan")] * n
        return _readable(f), _readable(b)


class StageTimer:
    """Records forward/backward intervals of one stage during one schedule step, and owns
    the stage's ``LayerProbe``."""

    def __init__(self, *, device: torch.device, enabled: bool = True) -> None:
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self._mark, self._pool = _marker(self.cuda)
        self.layers = LayerProbe(device=device)
        # One probe per virtual stage the rank holds, in pipeline order (``set_probes``).
        self.probes: list[LayerProbe] = [self.layers]
        self._device = device
        # Zero-bubble: per backward interval its key (virtual stage, microbatch); the
        # weight-gradient intervals by key; the keys whose layer marks were taken in the
        # weight part (a first stage) rather than the input part.
        self._bwd_keys: list[tuple[int, int] | None] = []
        self._bwd_w: dict[tuple[int, int], tuple[object, object]] = {}
        self._marked_in_w: set[tuple[int, int]] = set()
        self._fwd: list = []
        self._bwd: list = []
        self._reduce: list = []
        self._update: tuple[object, object] | None = None
        self._open: object | None = None
        self._handed: object | None = None  # when the last gradient bucket was handed over
        # Per interval of ``_fwd`` / ``_bwd``: whether its layers were marked (see
        # ``_discount_marks``).
        self._fwd_timed: list[bool] = []
        self._bwd_timed: list[bool] = []
        # Per interval of ``_bwd``: whether gradient buckets went to the all-reduce in it.
        self._bwd_reduced: list[bool] = []
        self._open_timed = False

    @property
    def dilation(self) -> float:
        """Emulated interference factor on this stage's layers (1: none). CPU only."""
        return self.layers.dilation

    @dilation.setter
    def dilation(self, factor: float) -> None:
        for p in self.probes:
            p.dilation = factor

    def set_probes(self, count: int) -> list[LayerProbe]:
        """``count`` layer probes, one per virtual stage (the first is ``layers``); the
        others share its settings."""
        while len(self.probes) < count:
            extra = LayerProbe(device=self._device)
            extra.dilation = self.layers.dilation
            self.probes.append(extra)
        del self.probes[max(count, 1) :]
        return list(self.probes)

    def sample_layers(
        self, on: bool, *, microbatches: int | None = None, spare_last: bool = False
    ) -> None:
        """Time every layer during the next step (only when the timers are enabled), on
        ``sampled_chunks(microbatches, spare_last=spare_last)`` of its microbatches (every
        one if None)."""
        self.layers.sampling = on and self.enabled
        if self.layers.sampling:  # read only while sampling: nothing to work out otherwise
            self.layers.chunks = (
                None
                if microbatches is None
                else sampled_chunks(microbatches, spare_last=spare_last)
            )
        for p in self.probes[1:]:
            p.sampling, p.chunks = self.layers.sampling, self.layers.chunks

    def start(self) -> None:
        """A microbatch's forward or backward begins (``layers.chunk`` names it)."""
        if self.enabled:
            self._open = self._mark()
            self._open_timed = self.layers._timed(self.layers.chunk)

    def stop(self, phase: str, key: tuple[int, int] | None = None) -> None:
        """``phase``: "fwd", "bwd" (a whole backward, or a zero-bubble input part) or "bwd_w"
        (a zero-bubble weight part); ``key``: (virtual stage, microbatch) of a backward."""
        if not self.enabled or self._open is None:
            return
        end = self._mark()
        if phase == "bwd_w":
            if key is not None:
                self._bwd_w[key] = (self._open, end)
            self._open = None
            return
        if phase == "bwd":
            self._bwd_keys.append(key)
        if phase == "bwd" and self._handed is not None:
            # Compute ended when the last bucket went to the all-reduce; the rest waited.
            self._bwd.append((self._open, self._handed))
            self._reduce.append((self._handed, end))
        else:
            (self._fwd if phase == "fwd" else self._bwd).append((self._open, end))
        if phase == "bwd":
            self._bwd_reduced.append(self._handed is not None)
        (self._fwd_timed if phase == "fwd" else self._bwd_timed).append(self._open_timed)
        self._open = self._handed = None

    def marked_in_weight(self, key: tuple[int, int]) -> None:
        """The layer marks of backward ``key`` were taken in its weight part (a first stage
        under a zero-bubble schedule: its input part computes nothing)."""
        self._marked_in_w.add(key)

    def handed_to_reduce(self) -> None:
        """A gradient bucket went to the data-parallel all-reduce (the reduce hook calls
        this; the last call of a backward marks the end of its compute)."""
        if not self.layers.in_backward:
            return  # no backward around it (a replica shadowing the reduce)
        self.layers.handed_to_reduce()
        if self.enabled and self._open is not None:
            self._handed = self._mark()

    def reduce_interval(self, start: object) -> None:
        """A reduce with no backward around it (a replica whose share is dropped)."""
        if self.enabled:
            self._reduce.append((start, self._mark()))

    def mark(self) -> object | None:
        return self._mark() if self.enabled else None

    def update(self, start: object | None) -> None:
        """The optimizer's update began at ``start`` (a ``mark``) and has just been issued."""
        if self.enabled and start is not None:
            self._update = (start, self._mark())

    def collect(self, schedule_ms: float) -> StepTiming:
        """Resolve this step's intervals (call after the step has synchronised) and reset."""

        def ms(pairs: list) -> list[float]:
            return [_elapsed_ms(self.cuda, a, b) for a, b in pairs]

        bwd = ms(self._bwd)
        split = {k: _elapsed_ms(self.cuda, *v) for k, v in self._bwd_w.items()}
        part = list(bwd)  # each backward's part that carried the layer marks
        for i, k in enumerate(self._bwd_keys):
            if k is not None and k in split:
                part[i] = split[k] if k in self._marked_in_w else bwd[i]
                bwd[i] += split[k]
        out = StepTiming(
            fwd_ms=ms(self._fwd),
            bwd_ms=bwd,
            bwd_w_ms=list(split.values()),
            schedule_ms=schedule_ms,
            reduce_ms=float(sum(ms(self._reduce))),
            update_ms=(
                _elapsed_ms(self.cuda, *self._update) if self._update is not None else float("nan")
            ),
        )
        per_layer = self._collect_layers(out.bwd_ms, part)
        if per_layer is not None:
            f, b, hf, hb, df, db = per_layer
            # The backwards that ran no all-reduce: the others share the device with it.
            keep = [i for i, r in enumerate(self._bwd_reduced) if not r] or range(len(out.bwd_ms))
            bwd_ms = [out.bwd_ms[i] for i in keep]
            bwd_timed = [self._bwd_timed[i] for i in keep]
            f, hf = _discount_marks(f, hf, out.fwd_ms, self._fwd_timed)
            b, hb = _discount_marks(b, hb, bwd_ms, bwd_timed)
            out.layers = LayerTiming(
                fwd_ms=f,
                bwd_ms=b,
                stage_fwd_ms=float(np.median(out.fwd_ms)) if out.fwd_ms else float("nan"),
                stage_bwd_ms=float(np.median(bwd_ms)) if bwd_ms else float("nan"),
                launch_fwd_ms=hf,
                launch_bwd_ms=hb,
                device_fwd_ms=df,
                device_bwd_ms=db,
            )
        for p in self.probes:
            p.sampling = False
        self._bwd_keys, self._bwd_w, self._marked_in_w = [], {}, set()
        self._fwd, self._bwd, self._reduce = [], [], []
        self._update = None
        self._fwd_timed, self._bwd_timed, self._bwd_reduced = [], [], []
        if self._pool is not None:
            self._pool.reset()
        return out

    def _collect_layers(self, bwd_ms: list[float], part_ms: list[float]) -> tuple | None:
        """The probes' per-layer readings joined in layer order, each virtual stage's
        backward scaled by its whole backward over the part its marks were taken in (1 for
        schedules that do not split the backward)."""
        got = [p.collect() for p in self.probes]
        if all(g is None for g in got):
            return None
        if any(g is None for g in got):
            return None  # a virtual stage ran no sampled microbatch: nothing comparable
        joined: list[list[float] | None] = [[] for _ in range(6)]
        for v, g in enumerate(got):
            keys = [i for i, k in enumerate(self._bwd_keys) if k is not None and k[0] == v]
            whole = [bwd_ms[i] for i in keys if self._bwd_timed[i]]
            part = [part_ms[i] for i in keys if self._bwd_timed[i]]
            scale = 1.0
            if whole and part and float(np.median(part)) > 0:
                scale = float(np.median(whole)) / float(np.median(part))
            for j, vals in enumerate(g):
                if vals is None or joined[j] is None:
                    joined[j] = None
                    continue
                k = j % 2 == 1  # the backward lists (bwd, launch bwd, device bwd)
                joined[j] += [x * scale for x in vals] if k else list(vals)
        return tuple(joined)


def _readable(ms: list[float]) -> list[float]:
    """Per-layer readings as the controller may take them: a layer that hands on its input
    tensor itself (``Identity``, ``Dropout(0)``) has its two boundary hooks on one tensor,
    which fire in registration order, so its backward reads as a small negative interval;
    it did no work, and reads 0. A reading that is not finite says nothing: NaN, as an
    untimed backward."""
    return [max(x, 0.0) if math.isfinite(x) else float("nan") for x in ms]


def _discount_marks(
    cost: list[float], launch: list[float] | None, stage_ms: list[float], timed: list[bool]
) -> tuple[list[float], list[float] | None]:
    """Layer costs less what the probe's own marks cost the host.

    Each mark is an event record, a clock read and (backward) a gradient hook: tens of
    microseconds of host time. Where the device waits on the host, that time lands in the
    marked layers: on 2 x H200, vgg16's last nine layers (0.1-0.3 ms each at 16 images)
    summed to 1.38 ms a forward on the marked microbatches while the stage's unmarked ones
    took 0.95, and the planner, believing them, kept layers off that stage. The stage timer
    sees both kinds of microbatch in the same step: the difference of their medians is what
    the marks cost, taken back in equal parts from the layers whose cost is the host's
    (every layer on CPU; on a GPU those whose issue time is their cost), at most half of
    each. Nothing changes where the host kept ahead of the device (no difference), or where
    every microbatch was marked (nothing to compare with)."""
    on = [ms for ms, t in zip(stage_ms, timed, strict=True) if t]
    off = [ms for ms, t in zip(stage_ms, timed, strict=True) if not t]
    if not on or not off:
        return cost, launch
    extra = float(np.median(on) - np.median(off))
    host = [
        j for j, c in enumerate(cost) if c == c and c > 0 and (launch is None or launch[j] >= c)
    ]
    if not extra > 0 or not host:
        return cost, launch
    each = extra / len(host)
    cost = list(cost)
    launch = None if launch is None else list(launch)
    for j in host:
        cut = min(each, 0.5 * cost[j])
        cost[j] -= cut
        if launch is not None:
            launch[j] -= cut
    return cost, launch
