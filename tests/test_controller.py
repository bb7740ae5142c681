"""The controller's pure logic: monitoring, calibration, decisions and their guards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynpipe.models import get_model
from dynpipe.planner import Plan
from dynpipe.planner.costs import CostModel
from dynpipe.runtime.controller import AdaptConfig, Controller, Monitor

MODEL = {"depth": 8, "width": 64, "in_features": 64, "num_classes": 64}  # 10 similar layers
MB = 4  # microbatches


@pytest.fixture
def model():
    return get_model("mlp", **MODEL)


def _controller(model, **cfg) -> tuple[Controller, Plan]:
    plan = Plan.even(model, 2, schedule="1f1b", microbatches=MB)
    costs = CostModel.from_model(model, microbatch_size=8, num_devices=2)
    ctl = Controller(costs=costs, config=AdaptConfig(mode="measured", **cfg))
    ctl.calibrate(plan, np.array([8.0, 8.0]), np.array([16.0, 16.0]))
    return ctl, plan


def _decide(ctl: Controller, plan: Plan, slow: tuple[float, float], step: int = 100):
    s = np.asarray(slow)
    return ctl.decide(step=step, plan=plan, fwd_step_ms=8.0 * s, bwd_step_ms=16.0 * s)


def test_monitor_smooths_small_changes_and_jumps_to_large_ones() -> None:
    mon = Monitor(2, ewma=0.5, jump=0.25)
    assert not mon.ready
    mon.update(np.array([10.0, 10.0]), np.array([20.0, 20.0]))
    mon.update(np.array([11.0, 30.0]), np.array([22.0, 60.0]))
    assert mon.fwd[0] == pytest.approx(10.5)  # +10%: averaged
    assert mon.fwd[1] == 30.0 and mon.bwd[1] == 60.0  # 3x: taken at once
    assert mon.windows == 2 and mon.ready
    mon.reset(3)
    assert mon.windows == 0 and not mon.ready and len(mon.fwd) == 3


def test_clean_times_give_no_move_and_a_slow_stage_gives_layers_away(model) -> None:
    ctl, plan = _controller(model)
    d = _decide(ctl, plan, (1.0, 1.0))
    assert not d.repartition and d.reason == "current plan is best"
    assert d.slowdown == pytest.approx((1.0, 1.0))
    d = _decide(ctl, plan, (1.0, 3.0))
    assert d.repartition and d.plan is not None
    assert d.slowdown == pytest.approx((1.0, 3.0))
    # Stage 1 computes 3x slower: it keeps fewer layers, and the step gets faster.
    assert len(d.plan.stages[1]) < len(plan.stages[1])
    assert d.proposed_ms < d.current_ms and d.moved_bytes > 0


def test_modest_gains_need_two_windows_and_small_ones_none(model) -> None:
    ctl, plan = _controller(model, min_gain=0.05, confirm_below=0.5)
    first = _decide(ctl, plan, (1.0, 1.3))
    assert not first.repartition and "second window" in first.reason
    assert _decide(ctl, plan, (1.0, 1.3), step=105).repartition
    ctl, plan = _controller(model, min_gain=0.5)
    d = _decide(ctl, plan, (1.0, 1.3))
    assert not d.repartition and "below min" in d.reason
    # One noisy window in between does not reset the evidence; two do.
    ctl, plan = _controller(model, min_gain=0.05, confirm_below=0.5)
    assert "second window" in _decide(ctl, plan, (1.0, 1.3)).reason
    assert not _decide(ctl, plan, (1.0, 1.0), step=105).repartition
    assert _decide(ctl, plan, (1.0, 1.3), step=110).repartition
    ctl, plan = _controller(model, min_gain=0.05, confirm_below=0.5)
    assert "second window" in _decide(ctl, plan, (1.0, 1.3)).reason
    _decide(ctl, plan, (1.0, 1.0), step=105)
    _decide(ctl, plan, (1.0, 1.0), step=110)
    assert "second window" in _decide(ctl, plan, (1.0, 1.3), step=115).reason


def test_cooldown_and_the_pause_horizon_hold_moves_back(model) -> None:
    ctl, plan = _controller(model, cooldown_steps=10)
    ctl.applied(95, pause_ms=1.0)
    assert _decide(ctl, plan, (1.0, 3.0), step=100).reason == "cooldown"
    ctl, plan = _controller(model, horizon_steps=10)
    ctl.applied(0, pause_ms=1e6)  # a pause no gain over 10 steps pays back
    d = _decide(ctl, plan, (1.0, 3.0))
    assert not d.repartition and "does not pay" in d.reason


def test_moves_that_did_not_pay_discount_later_predictions_until_it_fades(model) -> None:
    ctl, plan = _controller(model, min_gain=0.05)
    assert ctl.trust == 1.0
    # Predicted 40%, measured 9% slower: the record says this model's gains are not real.
    assert not ctl.judge(before_ms=100.0, after_ms=109.0, predicted_gain=0.4)
    assert ctl.trust == pytest.approx(0.0)
    d = _decide(ctl, plan, (1.0, 3.0))
    assert not d.repartition and "after the track record" in d.reason
    for _ in range(7):  # quiet windows: doubt fades, a large predicted gain gets through
        ctl.quiet_window()
    assert 0.5 < ctl.trust < 0.6
    assert _decide(ctl, plan, (1.0, 3.0)).repartition
    # A move that delivered what it promised restores trust in the next one.
    assert ctl.judge(before_ms=100.0, after_ms=80.0, predicted_gain=0.4)  # half: kept
    assert ctl.trust == pytest.approx(0.5)  # mean of the record [0, 1], no quiet windows
    assert ctl.judge(before_ms=100.0, after_ms=90.0, predicted_gain=0.4)  # a quarter
    assert ctl.trust == pytest.approx(0.5)  # record [0, 1, 0.5]
    # The record travels with the restart baseline's checkpoint.
    other, _ = _controller(model)
    other.load_state(ctl.state())
    assert other.record == ctl.record


def test_a_move_measured_slower_is_not_proposed_again_until_conditions_change(model) -> None:
    ctl, plan = _controller(model, min_gain=0.05, confirm_below=0.0, cooldown_steps=0)
    d = _decide(ctl, plan, (1.0, 1.5))
    assert d.repartition
    # Measured 10% slower after the move (the model was wrong here): remembered...
    ctl.judge(before_ms=100.0, after_ms=110.0, predicted_gain=0.1)
    ctl.quiet_window()
    ctl.record = []  # ...independently of the track record's discount
    # One layer moved: the opposite one-layer move is probed once, by measurement alone.
    probe = _decide(ctl, plan, (1.0, 1.5), step=105)
    assert probe.repartition and "probe" in probe.reason
    shift = d.plan.stages[0].stop - plan.stages[0].stop
    assert abs(shift) == 1 and probe.plan.stages[0].stop == plan.stages[0].stop - shift
    ctl.judge(before_ms=100.0, after_ms=110.0, predicted_gain=0.0)  # slower too
    ctl.record = []
    again = _decide(ctl, plan, (1.0, 1.5), step=110)
    assert not again.repartition and "measured slower" in again.reason
    # A new situation (stage 1 now 2.5x slow, beyond ``jump`` of 1.5x) may try it again.
    assert _decide(ctl, plan, (1.0, 2.5), step=115).repartition
    # A move that did not make steps slower is not remembered.
    ctl, plan = _controller(model, min_gain=0.05, confirm_below=0.0)
    assert _decide(ctl, plan, (1.0, 1.5)).repartition
    ctl.judge(before_ms=100.0, after_ms=102.0, predicted_gain=0.1)
    assert ctl.refuted == [] and ctl.slower(100.0, 106.0) and not ctl.slower(100.0, 104.0)


def test_a_clean_baseline_taken_under_load_is_retaken(model) -> None:
    ctl, plan = _controller(model)
    d = _decide(ctl, plan, (0.5, 0.5))  # every device "faster than clean": once is noise
    assert d.slowdown == pytest.approx((0.5, 0.5))
    d = _decide(ctl, plan, (0.5, 0.5), step=105)  # twice: the baseline was taken under load
    assert not d.repartition
    assert d.slowdown == pytest.approx((1.0, 1.0))


def test_one_stage_faster_than_clean_two_windows_running_lowers_its_cost(model) -> None:
    # Stage 0 sped up by a quarter after calibration (clocks ramping, loaders settling).
    ctl, plan = _controller(model, min_gain=0.5)
    clean0 = ctl.clean_fwd[:5].sum() + ctl.clean_bwd[:5].sum()
    first = _decide(ctl, plan, (0.75, 1.0))
    assert first.slowdown == pytest.approx((0.75, 1.0))  # one window: could be noise
    d = _decide(ctl, plan, (0.75, 1.0), step=105)
    # The stages hold identical layers, so the fit shares the change between both devices;
    # stage 0's clean cost drops, and neither device is "faster than clean" any more.
    assert ctl.clean_fwd[:5].sum() + ctl.clean_bwd[:5].sum() < 0.95 * clean0
    assert d.slowdown[0] > 0.85 and d.slowdown[1] >= 1.0
    # A lone fast window between normal ones changes nothing; nor does a slow stage.
    ctl, plan = _controller(model, min_gain=0.5)
    for i, slow in enumerate([(0.75, 1.0), (1.0, 1.0), (0.75, 1.0), (1.0, 2.0), (1.0, 2.0)]):
        d = _decide(ctl, plan, slow, step=100 + 5 * i)
        assert d.slowdown == pytest.approx(slow)


def test_slowdowns_within_the_noise_do_not_move_layers(model) -> None:
    from dynpipe.runtime.controller import credible

    assert credible(1.3, 0.1) == pytest.approx(1.2)
    assert credible(0.8, 0.1) == pytest.approx(0.9)
    assert credible(1.05, 0.1) == 1.0
    ctl, plan = _controller(model, min_gain=0.05, confirm_below=0.0, noise_z=2.0)
    s = np.array([1.0, 1.3])
    quiet = np.array([0.01, 0.01])
    loud = np.array([0.01, 0.2])  # stage 1's median is uncertain by 20%: 30% is within 2 SE
    kw = dict(step=100, plan=plan, fwd_step_ms=8.0 * s, bwd_step_ms=16.0 * s)
    assert ctl.decide(**kw, noise=quiet).repartition
    d = ctl.decide(**kw, noise=loud)
    assert not d.repartition and d.slowdown == pytest.approx((1.0, 1.3))


def test_checksum_catches_flips_swaps_and_truncation() -> None:
    from dynpipe.runtime.migrate import checksum

    g = torch.Generator().manual_seed(0)
    buf = torch.randint(0, 256, (3 * 4096 + 7,), dtype=torch.uint8, generator=g)
    ref = checksum(buf)
    assert checksum(buf.clone()) == ref
    flipped = buf.clone()
    flipped[4097] ^= 0x10
    words = buf[:4096].clone().view(torch.int32)
    swapped = buf.clone()
    swapped[:4096] = words[[1, 0, *range(2, 1024)]].view(torch.uint8)
    rows = buf.clone()
    rows[:4096], rows[4096:8192] = buf[4096:8192], buf[:4096]
    for bad in (flipped, swapped, rows, buf[:-1]):
        assert checksum(bad) != ref


def test_identical_layers_get_one_calibrated_cost_and_stages_add_up() -> None:
    from dynpipe.runtime.controller import fit_layer_costs

    # embed, six identical blocks, head; the head's modelled cost is far off its real one.
    modelled = np.array([1.0] + [10.0] * 6 + [40.0])
    classes = np.array([0, 1, 1, 1, 1, 1, 1, 2])
    bounds = [(0, 4), (4, 8)]
    measured = np.array([31.0, 40.0])  # 1 + 3x10, and 3x10 + a head that costs 10
    fit = fit_layer_costs(modelled, classes, bounds, measured)
    assert [fit[a:b].sum() for a, b in bounds] == pytest.approx(measured, rel=1e-3)
    assert np.ptp(fit[1:7]) == pytest.approx(0.0, abs=1e-9)  # one cost for every block
    assert fit[1] == pytest.approx(10.0, rel=0.02) and fit[7] == pytest.approx(10.0, rel=0.05)


def test_two_splits_of_the_same_layers_fix_what_each_segment_costs() -> None:
    from dynpipe.runtime.controller import refit_segments

    # The model says ten equal layers; 5|5 measured 10 and 5, then 3|7 measured 6 and 9.
    costs = np.ones(10)
    out = refit_segments(costs, [(0, 5), (5, 10)], [10.0, 5.0], [(0, 3), (3, 10)], [6.0, 9.0])
    assert out[:3].sum() == pytest.approx(6.0) and out[3:5].sum() == pytest.approx(4.0)
    assert out[5:].sum() == pytest.approx(5.0)
    assert np.allclose(out[:3], 2.0) and np.allclose(out[5:], 1.0)  # shares kept inside
    # Noise is shared out (least squares), and no segment is made free by one bad stage.
    out = refit_segments(costs, [(0, 5), (5, 10)], [10.0, 5.0], [(0, 3), (3, 10)], [6.0, 5.5])
    assert out.min() >= 0.2 and out.sum() > 0


def test_a_clean_move_refits_the_costs_of_the_layers_it_moved(model) -> None:
    ctl, plan = _controller(model, min_gain=0.01, confirm_below=0.0, cooldown_steps=0)
    assert not ctl.refit_pending
    d = _decide(ctl, plan, (1.0, 1.2))  # within ``jump`` of clean, and worth one layer
    assert d.repartition and ctl.refit_pending
    new = d.plan
    # Under the new split stage 0 (one layer more) got 30% dearer, not the 20% the model
    # expects of one more of its equal layers, and stage 1 lost as much: the moved layer
    # costs more than its FLOPs say. The work adds up, so nothing changed speed.
    old_f, old_b = 8.0 * np.array([1.0, 1.2]), 16.0 * np.array([1.0, 1.2])
    moved = 0.3 * 8.0, 0.3 * 16.0
    f = np.array([old_f[0] + moved[0], old_f[1] - moved[0]])
    b = np.array([old_b[0] + moved[1], old_b[1] - moved[1]])
    info = ctl.refit(new, f, b)
    assert info["refit"] and not ctl.refit_pending
    for (a, z), t in zip(new.bounds, f + b, strict=True):
        got = (ctl.clean_fwd[a:z].sum() + ctl.clean_bwd[a:z].sum()) * MB
        assert got == pytest.approx(t, rel=0.05)
    after = ctl.decide(step=110, plan=new, fwd_step_ms=f, bwd_step_ms=b)
    assert after.slowdown == pytest.approx((1.0, 1.0), abs=0.05)


def test_no_refit_across_a_change_of_speed_or_from_an_interfered_start(model) -> None:
    ctl, plan = _controller(model, min_gain=0.01, confirm_below=0.0, cooldown_steps=0)
    d = _decide(ctl, plan, (1.0, 1.2))
    before = ctl.clean_fwd.copy()
    # Both stages 40% slower after the move: a device slowed down across it.
    info = ctl.refit(d.plan, 8.0 * 1.4 * np.array([1.2, 1.0]), 16.0 * 1.4 * np.array([1.2, 1.0]))
    assert not info["refit"] and "add up" in info["why"]
    assert np.array_equal(ctl.clean_fwd, before)
    ctl, plan = _controller(model, min_gain=0.01, confirm_below=0.0, cooldown_steps=0)
    d = _decide(ctl, plan, (1.0, 2.0))  # decided under interference: times are not clean
    info = ctl.refit(d.plan, np.array([9.6, 12.8]), np.array([19.2, 25.6]))
    assert not info["refit"] and "slowed" in info["why"]


def test_refit_on_a_recorded_h200_run_reads_clean_devices_as_clean() -> None:
    """vgg16 on 2 H200s (``analysis/logs/gpu-h200-vgg16b512-a``): the FLOP shares put too
    much of stage 0's time on its later layers, so after the clean move to 4|12 the device
    keeping the full-resolution convolutions reads as 1.6x slowed. Refitted from the stage
    times on both sides of the move, both devices read clean, and the `gemm` onset on stage
    1's GPU moves layers back towards stage 0."""
    from pathlib import Path

    from dynpipe.runtime.adapter import stage_medians
    from dynpipe.runtime.records import read_log

    log = Path(__file__).parents[1] / "analysis/logs/gpu-h200-vgg16b512-a/vgg16-gemm-adaptive.jsonl"
    # The adaptation loop reads steps as the plain dicts the training loop hands it.
    steps = {r.step: r.to_dict() for r in read_log(log).steps}

    def window(a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        return stage_medians([steps[s] for s in range(a, b)], 2)

    with torch.device("meta"):
        model = get_model("vgg16", image_size=224, num_classes=1000)
    even = Plan.even(model, 2, schedule="1f1b", microbatches=8)
    costs = CostModel.from_model(model, microbatch_size=64, num_devices=2)
    ctl = Controller(costs=costs, config=AdaptConfig(mode="measured", confirm_below=0.0))
    ctl.calibrate(even, *window(5, 20))
    d = ctl.decide(step=30, plan=even, fwd_step_ms=window(20, 30)[0], bwd_step_ms=window(20, 30)[1])
    assert d.repartition and d.plan.bounds == [(0, 4), (4, 16)]  # as the run did at step 30
    moved = d.plan
    clean_after = window(35, 60)  # 4|12, still clean
    unfitted = Controller(costs=costs, config=AdaptConfig(mode="measured"))
    unfitted.clean_fwd, unfitted.clean_bwd = ctl.clean_fwd.copy(), ctl.clean_bwd.copy()
    wrong = unfitted.decide(
        step=60, plan=moved, fwd_step_ms=clean_after[0], bwd_step_ms=clean_after[1]
    )
    assert wrong.slowdown[0] > 1.3  # the model's error, read as a slowed device
    assert ctl.refit(moved, *clean_after)["refit"]
    ctl.applied(60, 30.0)
    d = ctl.decide(step=60, plan=moved, fwd_step_ms=clean_after[0], bwd_step_ms=clean_after[1])
    assert d.slowdown == pytest.approx((1.0, 1.0), abs=0.03) and not d.repartition
    onset = window(61, 70)  # gemm on stage 1's GPU from step 60, still 4|12
    d = ctl.decide(step=70, plan=moved, fwd_step_ms=onset[0], bwd_step_ms=onset[1])
    assert d.slowdown[0] == pytest.approx(1.0, abs=0.05) and d.slowdown[1] > 1.5
    assert d.repartition and d.plan.stages[0].stop > 4
