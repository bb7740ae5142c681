"""The schedule simulator: closed forms, dependencies, and the vectorised twin."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynpipe.planner.evaluate import in_flight
from dynpipe.planner.plan import PlanError
from dynpipe.planner.simulate import (
    Action,
    format_actions,
    simulate,
    stage_actions,
    step_times,
)

SCHEDULES = ("gpipe", "1f1b")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("micro", [1, 2, 3, 4, 8, 13])
def test_uniform_stages_match_closed_form(schedule: str, stages: int, micro: int) -> None:
    f, b = 1.5, 2.75
    res = simulate([f] * stages, [b] * stages, schedule=schedule, microbatches=micro)
    assert res.step_ms == pytest.approx((micro + stages - 1) * (f + b), rel=1e-12)
    bubble = (stages - 1) / (micro + stages - 1)
    assert res.bubble == pytest.approx(bubble, abs=1e-12)
    assert res.busy_ms == pytest.approx([micro * (f + b)] * stages)


def test_gpipe_with_comm_adds_the_fill_and_drain_latency() -> None:
    # With a link faster than compute, each boundary adds its transfer time once on the way
    # in (first forward) and once on the way back (last backward) and nothing else.
    s, m, f, b, c = 4, 8, 1.0, 2.0, 0.25
    res = simulate([f] * s, [b] * s, comm_ms=[c] * (s - 1), schedule="gpipe", microbatches=m)
    assert res.step_ms == pytest.approx((m + s - 1) * (f + b) + 2 * (s - 1) * c)
    # 1F1B alternates directions in steady state, so transfers also enter its cycle.
    res = simulate([f] * s, [b] * s, comm_ms=[c] * (s - 1), schedule="1f1b", microbatches=m)
    assert res.step_ms > (m + s - 1) * (f + b) + 2 * (s - 1) * c


def test_action_lists_follow_torch_pipelining() -> None:
    acts = stage_actions("1f1b", num_stages=3, microbatches=4)
    # Stage s warms up with min(M, S - s) forwards, then alternates B, F, then drains.
    assert acts[0] == [
        Action("F", 0),
        Action("F", 1),
        Action("F", 2),
        Action("B", 0),
        Action("F", 3),
        Action("B", 1),
        Action("B", 2),
        Action("B", 3),
    ]
    assert acts[2][:3] == [Action("F", 0), Action("B", 0), Action("F", 1)]
    gp = stage_actions("gpipe", num_stages=2, microbatches=2)
    assert [repr(a) for a in gp[1]] == ["F0", "F1", "B0", "B1"]
    assert format_actions(gp).splitlines()[0] == "s0: F0 F1 B0 B1"
    for s, row in enumerate(acts):
        assert sorted(map(repr, row)) == sorted(
            [f"F{i}" for i in range(4)] + [f"B{i}" for i in range(4)]
        ), s


def test_bad_input_is_refused() -> None:
    with pytest.raises(PlanError, match="schedule"):
        simulate([1.0], [1.0], schedule="zb", microbatches=2)
    with pytest.raises(PlanError, match="boundary transfer"):
        simulate([1.0, 1.0], [1.0, 1.0], comm_ms=[1.0, 2.0])
    with pytest.raises(PlanError, match="backward times"):
        simulate([1.0, 1.0], [1.0])


def _check_events(res, fwd, bwd, comm, stages, micro):
    ev = {(e.kind, e.stage, e.mb): e for e in res.events}
    assert len(ev) == len(res.events)
    for s in range(stages):
        # A stage runs one action at a time, each for its own duration.
        mine = sorted(
            (e for e in res.events if e.stage == s and e.kind in "FB"),
            key=lambda e: (e.start, e.end),
        )
        assert len(mine) == 2 * micro
        for a, b in itertools.pairwise(mine):
            assert b.start >= a.end - 1e-9
        for e in mine:
            dur = fwd[s] if e.kind == "F" else bwd[s]
            assert e.end - e.start == pytest.approx(dur)
        for m in range(micro):
            f, b = ev[("F", s, m)], ev[("B", s, m)]
            assert b.start >= f.end - 1e-9
            if s > 0:
                send = ev[("SF", s - 1, m)]
                assert send.start >= ev[("F", s - 1, m)].end - 1e-9
                assert send.end - send.start == pytest.approx(comm[s - 1])
                assert f.start >= send.end - 1e-9
            if s < stages - 1:
                back = ev[("SB", s + 1, m)]
                assert back.start >= ev[("B", s + 1, m)].end - 1e-9
                assert b.start >= back.end - 1e-9
    for kind in ("SF", "SB"):
        for link in range(stages):
            sends = sorted(
                (e for e in res.events if e.kind == kind and e.stage == link),
                key=lambda e: (e.start, e.end),
            )
            for a, b in itertools.pairwise(sends):
                assert b.start >= a.end - 1e-9  # one transfer at a time per direction


stage_times = st.lists(st.floats(0.0, 5.0), min_size=1, max_size=5)


@settings(max_examples=120, deadline=None)
@given(
    data=st.data(),
    stages=st.integers(1, 5),
    micro=st.integers(1, 7),
    schedule=st.sampled_from(SCHEDULES),
)
def test_events_respect_dependencies_and_vectorised_twin_agrees(data, stages, micro, schedule):
    t = st.floats(0.0, 5.0, allow_nan=False)
    fwd = data.draw(st.lists(t, min_size=stages, max_size=stages))
    bwd = data.draw(st.lists(t, min_size=stages, max_size=stages))
    comm = data.draw(st.lists(st.floats(0.0, 3.0), min_size=stages - 1, max_size=stages - 1))
    res = simulate(fwd, bwd, comm_ms=comm, schedule=schedule, microbatches=micro)
    _check_events(res, fwd, bwd, comm, stages, micro)
    assert res.step_ms == pytest.approx(max(e.end for e in res.events))
    # Lower bounds every schedule obeys (the planner's pruning relies on them).
    loads = [f + b for f, b in zip(fwd, bwd, strict=True)]
    for s in range(stages):
        assert res.step_ms >= micro * loads[s] + sum(loads[:s]) - 1e-9
    for c in comm:
        assert res.step_ms >= micro * c - 1e-9
    vec = step_times(
        np.array([fwd]),
        np.array([bwd]),
        np.array([comm]).reshape(1, -1),
        schedule=schedule,
        microbatches=micro,
    )
    assert vec[0] == pytest.approx(res.step_ms, rel=1e-12, abs=1e-12)


def test_step_times_evaluates_many_candidates_at_once() -> None:
    rng = np.random.default_rng(0)
    fwd, bwd, comm = (
        rng.uniform(0, 2, (50, 4)),
        rng.uniform(0, 4, (50, 4)),
        rng.uniform(0, 1, (50, 3)),
    )
    got = step_times(fwd, bwd, comm, schedule="1f1b", microbatches=6)
    want = [
        simulate(f, b, comm_ms=c, schedule="1f1b", microbatches=6).step_ms
        for f, b, c in zip(fwd, bwd, comm, strict=True)
    ]
    np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("stages", "micro"), [(4, 8), (4, 2), (3, 3), (6, 4)])
def test_memory_model_matches_simulated_activations_in_flight(schedule, stages, micro) -> None:
    # The memory model's in_flight(s) must be the most microbatches whose forward has run on
    # stage s and whose backward has not, in the simulated schedule.
    rng = np.random.default_rng(stages * 10 + micro)
    res = simulate(
        rng.uniform(0.5, 1.5, stages),
        rng.uniform(1, 3, stages),
        schedule=schedule,
        microbatches=micro,
    )
    want = in_flight(schedule, num_stages=stages, microbatches=micro)
    for s in range(stages):
        live, peak = 0, 0
        for e in sorted(
            (e for e in res.events if e.stage == s and e.kind in "FB"),
            key=lambda e: (e.start, e.end),
        ):
            live += 1 if e.kind == "F" else -1
            peak = max(peak, live)
        assert peak == want[s], (s, peak, want[s])


def test_result_is_plain_data() -> None:
    res = simulate([1.0, 2.0], [2.0, 4.0], comm_ms=[0.5], schedule="1f1b", microbatches=3)
    d = res.to_dict()
    assert d["step_ms"] == res.step_ms and len(d["events"]) == len(res.events)
    assert "step=" in repr(res) and "bubble=" in repr(res)
    assert repr(res.events[0]).startswith("F0@s0[")
