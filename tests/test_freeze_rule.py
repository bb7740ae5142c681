"""``--freeze``'s rule on synthetic windows (pure logic: no model, no process group).

Each window is (mean training loss, per-layer RMS gradient norms), as ``Freezer.check``
feeds them. The shapes follow what a small gpt trained from scratch on ``pystdlib`` under
warm-up and cosine decay showed (``bench/freeze_rule.py``): the loss falls fast, then
slowly and steadily until the schedule ends, while every layer's gradient norm moves by a
few percent from window to window, up and down, with no trend to speak of.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dynpipe.errors import UserError
from dynpipe.runtime.freeze import FreezeHistory, FreezeRule, frozen_prefix, loss_plateaued

LAYERS = 8
RULE = FreezeRule(every=20, threshold=0.05, alpha=0.5, patience=10, warmup=30)


def _run(losses, norms, *, rule: FreezeRule = RULE) -> list[tuple[int, int]]:
    """Feed the windows in order, freezing as the rule says: [(window, frozen)] per growth."""
    history, frozen, out = FreezeHistory(), 0, []
    for w, (loss, g) in enumerate(zip(losses, norms, strict=True)):
        history.add(loss=loss, norms=np.asarray(g), rule=rule)
        k = frozen_prefix(history, frozen=frozen, rule=rule)
        assert k >= frozen
        if k > frozen:
            out.append((w, k))
            frozen = k
    return out


def _noisy_norms(windows: int, *, seed: int, noise: float = 0.05, drift: float = 0.01):
    """Per-layer norms of no trend beyond a slow drift, ``noise`` relative from window to
    window (as measured): the old window-to-window test passes on these by chance."""
    gen = np.random.default_rng(seed)
    base = np.linspace(1.0, 0.1, LAYERS)
    return [
        base * (1 + drift * w) * (1 + noise * gen.standard_normal(LAYERS)) for w in range(windows)
    ]


def _scratch_losses(windows: int, *, seed: int, noise: float = 0.012) -> list[float]:
    """A loss trained from scratch to the end of a decaying schedule, as measured (gpt 6 x
    128, 20-step windows): a fast fall (0.1-0.2 a window) after warm-up, then 0.01-0.02 a
    window to the end, with about 1% noise between windows."""
    gen = np.random.default_rng(seed)
    out, loss = [], 3.4
    for w in range(windows):
        loss -= 0.25 * math.exp(-w / 2) + 0.013
        out.append(loss * (1 + noise * gen.standard_normal()))
    return out


def test_a_model_still_learning_under_a_decaying_rate_freezes_nothing() -> None:
    # The old rule froze on such sequences: each layer's norm changed by < 5% since the
    # last window in most windows. The loss still falls at > 5% of its fastest rate.
    for seed in range(20):
        losses = _scratch_losses(40, seed=seed)
        assert _run(losses, _noisy_norms(40, seed=seed)) == [], seed


def test_a_converged_model_freezes_its_flat_prefix_alpha_at_a_time() -> None:
    # Fast fall, then flat with noise: the loss has stopped falling.
    gen = np.random.default_rng(0)
    losses = [3.0 - 0.3 * min(w, 5) + 0.005 * gen.standard_normal() for w in range(30)]
    norms = _noisy_norms(30, seed=1, drift=0.0)
    got = _run(losses, norms)
    assert got, "a converged model must freeze"
    # Alpha 0.5 caps each check: 4 of 8, then 2 of 4, then 1 of 2; the last layer trains.
    assert [k for _, k in got] == [4, 6, 7], got
    # Not before the fall (windows 0-5) has left most of the fitted span (11 windows).
    assert got[0][0] >= 13, got


def test_a_layer_whose_norm_still_moves_stops_the_prefix() -> None:
    losses = [1.0] * 3 + [1.0 - 1e-4 * w for w in range(10)]
    losses[1] = 2.0  # one fast fall, then flat: the loss has plateaued
    norms = [np.ones(LAYERS) for _ in losses]
    for w, g in enumerate(norms):
        g[2] = 1.0 + 0.2 * w  # layer 2's gradient still grows: it, and all after it, train
    got = _run(losses, norms, rule=FreezeRule(every=20, threshold=0.05, alpha=1.0, patience=3))
    assert got and all(k == 2 for _, k in got), got


def test_the_plateau_needs_a_full_span_and_is_measured_against_the_fastest_fall() -> None:
    rule = FreezeRule(patience=3)
    h = FreezeHistory()
    for loss in (4.0, 3.0, 2.0):
        h.add(loss=loss, norms=np.ones(4), rule=rule)
        assert not loss_plateaued(h, rule=rule)  # fewer than patience + 1 windows
    for loss in (1.0, 1.0, 1.0, 1.0):
        h.add(loss=loss, norms=np.ones(4), rule=rule)
    assert h.best_rate == pytest.approx(1.0) and loss_plateaued(h, rule=rule)
    # Rising loss is not progress either.
    h.add(loss=1.5, norms=np.ones(4), rule=rule)
    assert loss_plateaued(h, rule=rule)
    # Still falling at a tenth of the fastest: not a plateau at threshold 0.05.
    h = FreezeHistory()
    for loss in (4.0, 3.0, 2.0, 1.0, 0.9, 0.8, 0.7, 0.6):
        h.add(loss=loss, norms=np.ones(4), rule=rule)
    assert not loss_plateaued(h, rule=rule)
    # A loss that never fell has stopped only if it does not fall now.
    h = FreezeHistory()
    for loss in (2.0, 2.1, 2.2, 2.3):
        h.add(loss=loss, norms=np.ones(4), rule=rule)
    assert h.best_rate == 0 and loss_plateaued(h, rule=rule)
    h.add(loss=1.0, norms=np.ones(4), rule=rule)
    assert h.best_rate > 0 and not loss_plateaued(h, rule=rule)


def test_noise_that_hides_the_trend_decides_nothing() -> None:
    # Falling at a sixth of the fastest rate, under noise larger than the fall: the fit's
    # value dips under 5% of the fastest in 27 of these 200 draws, its upper bound in none.
    rule = FreezeRule(patience=10)
    gen = np.random.default_rng(0)
    dips = 0
    for _ in range(200):
        h = FreezeHistory(best_rate=0.03)
        for w in range(11):
            h.add(loss=2.0 - 0.005 * w + 0.03 * gen.standard_normal(), norms=np.ones(4), rule=rule)
        slope = np.polyfit(np.arange(11), h.losses, 1)[0]
        dips += -slope <= rule.threshold * h.best_rate
        assert not loss_plateaued(h, rule=rule)
    assert dips > 10  # the draws do test the bound


def test_nonfinite_norms_stop_the_walk_and_a_layer_without_gradient_passes() -> None:
    rule = FreezeRule(threshold=1e9, alpha=1.0, patience=1)
    h = FreezeHistory()
    h.add(loss=2.0, norms=np.array([0.0, 1.0, np.nan, 1.0]), rule=rule)
    h.add(loss=1.0, norms=np.array([0.0, 1.0, 1.0, 1.0]), rule=rule)
    assert frozen_prefix(h, frozen=0, rule=rule) == 2


def test_with_patience_one_and_no_threshold_it_freezes_at_the_second_window() -> None:
    # The exactness tests' setting: every layer "converged", as fast as alpha allows.
    rule = FreezeRule(threshold=1e9, alpha=0.5, patience=1)
    got = _run([3.0, 2.9, 2.8, 2.7, 2.6], [np.ones(LAYERS)] * 5, rule=rule)
    assert got == [(1, 4), (2, 6), (3, 7)]


def test_history_round_trips_and_decides_the_same() -> None:
    losses = [3.0 - 0.3 * min(w, 5) for w in range(12)]
    norms = _noisy_norms(12, seed=3, drift=0.0)
    h = FreezeHistory()
    for loss, g in zip(losses, norms, strict=True):
        h.add(loss=loss, norms=np.asarray(g), rule=RULE)
    back = FreezeHistory.from_dict(h.to_dict())
    assert back == h
    assert len(h.losses) == RULE.patience + 1  # only the span is kept
    assert frozen_prefix(back, frozen=0, rule=RULE) == frozen_prefix(h, frozen=0, rule=RULE)


def test_windows_in_the_warm_up_do_not_count_and_bad_settings_are_refused() -> None:
    rule = FreezeRule(every=20, warmup=30)
    assert [s for s in range(19, 100, 20) if rule.counts(s)] == [59, 79, 99]
    assert FreezeRule(every=5).counts(4)
    with pytest.raises(UserError, match="--freeze-patience >= 1"):
        FreezeRule(patience=0)
