"""Stage and layer timers: what a layer is taken to cost.

On a GPU a layer costs the longer of its device time (events) and the host's time to
issue it (``runtime/timing.py``). The device half is stood in for by fake events that
report a fixed device time, so the rule runs on any machine.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from dynpipe.runtime.timing import (
    SAMPLED_MICROBATCHES,
    StageTimer,
    _discount_marks,
    sampled_chunks,
)


class _Event:
    """A CUDA event stand-in: ``elapsed_time`` is a fixed device time per interval."""

    device_ms = 0.0

    def elapsed_time(self, _other: _Event) -> float:
        return self.device_ms


class _Busy(nn.Module):
    """A layer whose forward and backward keep the host busy for ``ms`` each."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.ms = ms
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Spin.apply(x * self.w, self.ms)


class _Spin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, ms: float) -> torch.Tensor:
        ctx.ms = ms
        _spin(ms)
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        _spin(ctx.ms)
        return g, None


def _spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def _timed_step(device_ms: float, layer_ms: list[float]):
    timer = StageTimer(device=torch.device("cpu"))
    probe = timer.layers
    # Pretend to be a GPU stage: events whose elapsed time is the device's.
    _Event.device_ms = device_ms
    timer.cuda = probe.cuda = True
    timer._mark = probe._device_mark = _Event
    layers = [_Busy(ms) for ms in layer_ms]
    timer.sample_layers(True)
    for chunk in range(3):
        _microbatch(timer, layers, chunk)
    return timer.collect(schedule_ms=1.0).layers


def _microbatch(timer: StageTimer, layers: list[nn.Module], chunk: int) -> None:
    """One microbatch's forward and backward as the pipeline stage runs them."""
    probe = timer.layers
    probe.chunk = chunk
    timer.start()
    out = probe.run(layers, torch.ones(4, requires_grad=True))
    timer.stop("fwd")
    timer.start()
    probe.begin_backward(chunk)
    out.sum().backward()
    probe.end_backward(chunk)
    timer.stop("bwd")


def test_host_bound_layers_cost_their_issue_time():
    lt = _timed_step(device_ms=0.01, layer_ms=[2.0, 6.0])
    assert lt.launch_fwd_ms is not None and lt.launch_bwd_ms is not None
    # The host took at least 2 and 6 ms per layer, each way (a spin overshoots on a busy
    # machine, never undershoots); the device 0.01 ms: the host's time is the cost.
    for got in (lt.fwd_ms, lt.bwd_ms, lt.launch_fwd_ms, lt.launch_bwd_ms):
        assert got[0] >= 2.0 and got[1] >= 6.0
    assert lt.fwd_ms == lt.launch_fwd_ms and lt.bwd_ms == lt.launch_bwd_ms


def test_device_bound_layers_cost_their_device_time():
    lt = _timed_step(device_ms=5000.0, layer_ms=[1.0, 1.0])
    assert lt.fwd_ms == [5000.0, 5000.0] and lt.bwd_ms == [5000.0, 5000.0]
    assert all(1.0 <= x < 5000.0 for x in lt.launch_fwd_ms + lt.launch_bwd_ms)


def test_cpu_stage_has_one_time():
    timer = StageTimer(device=torch.device("cpu"))
    timer.sample_layers(True)
    timer.layers.chunk = 0
    timer.start()
    timer.layers.run([nn.Linear(4, 4)], torch.ones(2, 4))
    timer.stop("fwd")
    lt = timer.collect(schedule_ms=1.0).layers
    assert lt.launch_fwd_ms is None and lt.launch_bwd_ms is None
    assert len(lt.fwd_ms) == 1 and lt.fwd_ms[0] > 0


def test_sampled_chunks_spread_over_the_step():
    assert sampled_chunks(8) == {2, 4, 6}
    assert sampled_chunks(4) == {1, 2, 3}
    assert sampled_chunks(3) == {0, 1, 2} and sampled_chunks(1) == {0}
    assert sampled_chunks(0) == frozenset()
    for m in range(1, 40):
        got = sampled_chunks(m)
        assert len(got) == min(m, SAMPLED_MICROBATCHES) and got <= set(range(m))


def test_sampled_chunks_spare_the_reduced_last_microbatch():
    """With replicas the last backward carries the gradient all-reduce: it is left out
    wherever another microbatch is left to time."""
    assert sampled_chunks(4, spare_last=True) == {0, 1, 2}
    assert sampled_chunks(2, spare_last=True) == {0}
    assert sampled_chunks(1, spare_last=True) == {0}  # nothing else to time
    assert sampled_chunks(8, spare_last=True) == sampled_chunks(8) == {2, 4, 6}
    for m in range(2, 40):
        got = sampled_chunks(m, spare_last=True)
        assert m - 1 not in got and got and got <= set(range(m - 1))
        assert len(got) == min(m - 1, SAMPLED_MICROBATCHES)


def test_a_sampled_step_times_only_its_sampled_microbatches():
    """Layers are marked on the sampled microbatches alone; the others run unmarked (no
    forward marks, no backward hooks), and the stage timer still sees every one."""
    timer = StageTimer(device=torch.device("cpu"))
    probe = timer.layers
    layers = [_Busy(1.0), _Busy(3.0)]
    timer.sample_layers(True, microbatches=8)
    for chunk in range(8):
        _microbatch(timer, layers, chunk)
        marked = set(probe._fwd)
        assert marked == {c for c in sampled_chunks(8) if c <= chunk}
    timing = timer.collect(schedule_ms=1.0)
    assert len(timing.fwd_ms) == 8 and len(timing.bwd_ms) == 8
    lt = timing.layers
    assert all(x > 0 for x in lt.fwd_ms + lt.bwd_ms), lt
    # The next step samples nothing unless asked again.
    assert not probe.sampling and timer.collect(schedule_ms=1.0).layers is None


def test_what_the_marks_cost_the_host_is_taken_back_from_host_bound_layers():
    # Marked microbatches 0.45 ms longer than unmarked ones: the three host-bound layers
    # (cost == issue time) give back 0.15 ms each; the device-bound one keeps its cost.
    cost, launch = [2.0, 0.4, 0.3, 0.5], [0.3, 0.4, 0.3, 0.5]
    stage = [3.2, 3.2, 3.65, 3.2, 3.65, 3.2, 3.65, 3.2]
    timed = [False, False, True, False, True, False, True, False]
    got, got_launch = _discount_marks(cost, launch, stage, timed)
    assert got == pytest.approx([2.0, 0.25, 0.15, 0.35])
    assert got_launch == pytest.approx([0.3, 0.25, 0.15, 0.35])
    # At most half of a layer's cost; CPU (no issue times): every layer is the host's.
    got, none = _discount_marks([1.0, 0.1], None, [5.0, 4.0], [True, False])
    assert got == pytest.approx([0.5, 0.05]) and none is None
    # Marked microbatches no slower, or every microbatch marked: nothing changes.
    assert _discount_marks(cost, launch, [3.1, 3.2], [True, False]) == (cost, launch)
    assert _discount_marks(cost, launch, [3.2, 3.6], [True, True]) == (cost, launch)


@pytest.mark.timing
def test_the_first_layers_backward_ends_where_its_gradients_go_to_the_all_reduce():
    """With data parallelism the last microbatch's backward ends after the gradient
    all-reduce and its wait for the slowest replica. A first layer whose input takes no
    gradient ends its backward with the stage's compute, so the wait is not its cost."""
    wait_ms = 30.0
    got = []
    for reduce in (False, True):
        timer = StageTimer(device=torch.device("cpu"))
        probe = timer.layers
        layers = [_Busy(2.0), _Busy(2.0)]
        # DDP's comm hook fires when the last bucket (the first layer's gradient) is ready.
        layers[0].w.register_post_accumulate_grad_hook(lambda _p, t=timer: t.handed_to_reduce())
        timer.sample_layers(True, microbatches=1)
        probe.chunk = 0
        timer.start()
        out = probe.run(layers, torch.ones(4))
        timer.stop("fwd")
        timer.start()
        probe.begin_backward(0)
        out.sum().backward()
        if reduce:
            _spin(wait_ms)  # the all-reduce, waiting for another replica
        probe.end_backward(0)
        timer.stop("bwd")
        got.append(timer.collect(schedule_ms=1.0).layers.bwd_ms)
    for bwd in got:
        assert bwd[0] == pytest.approx(2.0, abs=1.5), got


def test_the_backward_that_ran_the_all_reduce_is_not_the_stage_overhead():
    """DP only at two microbatches a replica: the first is timed, the second runs the
    gradient all-reduce beside its backward (``spare_last``). Its slower backward is the
    reduce's: were it in the stage's median (the mean of two), the stage would read an
    overhead beyond its layers that one pipeline, which reduces nothing, would be priced
    with on every microbatch of every stage."""
    timer = StageTimer(device=torch.device("cpu"))
    probe = timer.layers
    layers = [_Busy(2.0), _Busy(2.0)]
    timer.sample_layers(True, microbatches=2, spare_last=True)
    _microbatch(timer, layers, 0)
    probe.chunk = 1
    timer.start()
    out = probe.run(layers, torch.ones(4, requires_grad=True))
    timer.stop("fwd")
    timer.start()
    probe.begin_backward(1)
    out.sum().backward()
    _spin(20.0)  # the all-reduce's kernels beside the backward's
    timer.handed_to_reduce()  # called by the comm hook inside a backward
    probe.end_backward(1)
    timer.stop("bwd")
    timing = timer.collect(schedule_ms=1.0)
    lt = timing.layers
    assert timing.bwd_ms[1] > timing.bwd_ms[0] + 15.0, timing.bwd_ms  # the step sees it
    # The stage's backward is the microbatch that ran no reduce: its layers and little more.
    assert lt.stage_bwd_ms == pytest.approx(timing.bwd_ms[0])
    assert lt.stage_bwd_ms < sum(lt.bwd_ms) + 10.0, (lt.stage_bwd_ms, lt.bwd_ms)


def test_the_optimizer_update_is_timed():
    timer = StageTimer(device=torch.device("cpu"))
    began = timer.mark()
    _spin(5.0)
    timer.update(began)
    got = timer.collect(schedule_ms=1.0)
    assert got.update_ms >= 5.0
    # Not timed on a step: NaN (a rank with no optimizer, an idle one), not zero.
    assert timer.collect(schedule_ms=1.0).update_ms != timer.collect(schedule_ms=1.0).update_ms


def _train_two_stages(rank: int, world: int, log: str) -> list[dict]:
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.optim import OptimConfig
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    cfg = TrainConfig(
        model="mlp",
        model_args={"depth": 4, "width": 64},
        steps=6,
        batch_size=16,
        microbatches=2,
        optim=OptimConfig(name="adamw", lr=1e-3),
        progress=False,
        log=log,
        log_every=3,
    )
    train(cfg, topo=Topology.from_env(device="cpu"))
    return []


def test_step_records_carry_every_stages_update_time(tmp_path):
    """The update grows with the parameters a rank holds, which the shape decides: the
    records carry it per stage, measured, for the shape's price."""
    from distutil import run_ranks

    from dynpipe.runtime.records import read_dicts

    log = tmp_path / "log.jsonl"
    run_ranks(_train_two_stages, 2, str(log))
    steps = [r for r in read_dicts(log) if r["type"] == "step"]
    assert len(steps) == 6
    for r in steps:
        assert len(r["stages"]) == 2
        assert all(s["update_ms"] is not None and s["update_ms"] > 0 for s in r["stages"]), r
