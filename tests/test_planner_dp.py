"""The partition DP against brute force, memory limits, migration cost, baselines."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynpipe.errors import UserError
from dynpipe.planner.baselines import even_bounds, parameter_bounds
from dynpipe.planner.costs import CostModel
from dynpipe.planner.dp import plan_partition, solve_bottleneck
from dynpipe.planner.evaluate import stage_costs
from dynpipe.planner.make import make_plan
from dynpipe.planner.plan import Plan, PlanError, StagePlan
from dynpipe.planner.problem import Problem, memory_limits, range_min
from dynpipe.planner.simulate import simulate


def random_costs(
    rng: np.random.Generator, layers: int, devices: int, *, comm: bool = True
) -> CostModel:
    """A random instance: per-device times (some devices slower), bytes, links."""
    base_f = rng.uniform(0.05, 2.0, layers)
    slow = rng.choice([1.0, 1.0, 1.7, 3.0], size=devices)
    noise = rng.uniform(0.8, 1.25, (devices, layers))
    fwd = base_f[None, :] * slow[:, None] * noise
    bwd = fwd * rng.uniform(1.2, 2.5, layers)[None, :]
    return CostModel(
        model="rand",
        layer_names=tuple(f"l{i}" for i in range(layers)),
        fwd_ms=fwd,
        bwd_ms=bwd,
        param_bytes=rng.integers(0, 4 << 20, layers).astype(float),
        out_bytes=rng.integers(1, 8 << 20, layers).astype(float),
        act_bytes=rng.integers(0, 2 << 20, layers).astype(float),
        opt_mult=np.full(layers, 2.0),
        buffer_bytes=np.zeros(layers),
        bandwidth=rng.uniform(2e9, 50e9, devices - 1) if comm else np.full(devices - 1, 1e30),
        latency_ms=rng.uniform(0, 0.05, devices - 1) if comm else np.zeros(devices - 1),
    )


def all_partitions(layers: int, stages: int):
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        c = (0, *cuts, layers)
        yield tuple(itertools.pairwise(c))


def brute(cm: CostModel, stages: int, micro: int, schedule: str, memory=None):
    """Min bottleneck, and min simulated step (+ fitting memory), over every partition."""
    lim = memory_limits(memory, stages)
    best_t, best_step, best_bounds = np.inf, np.inf, None
    for bounds in all_partitions(cm.num_layers, stages):
        sc = stage_costs(cm, bounds, schedule=schedule, microbatches=micro)
        if any(m > lim[s] for s, m in enumerate(sc.mem_bytes)):
            continue
        best_t = min(best_t, sc.bottleneck_ms)
        step = simulate(
            sc.fwd_ms, sc.bwd_ms, comm_ms=sc.comm_ms, schedule=schedule, microbatches=micro
        ).step_ms
        if step < best_step:
            best_step, best_bounds = step, bounds
    return best_t, best_step, best_bounds


instances = st.tuples(
    st.integers(0, 2**32 - 1),  # seed
    st.integers(1, 9),  # layers
    st.integers(1, 4),  # stages (clipped to layers)
    st.integers(1, 6),  # microbatches
    st.sampled_from(["1f1b", "gpipe"]),
)


@settings(max_examples=250, deadline=None)
@given(instances)
def test_dp_equals_brute_force(inst) -> None:
    seed, layers, stages, micro, schedule = inst
    stages = min(stages, layers)
    rng = np.random.default_rng(seed)
    cm = random_costs(rng, layers, stages, comm=bool(seed % 2))
    t_brute, step_brute, _ = brute(cm, stages, micro, schedule)
    t_star, bounds = solve_bottleneck(cm, num_stages=stages, schedule=schedule, microbatches=micro)
    assert t_star == pytest.approx(t_brute, rel=1e-9, abs=1e-12)
    sc = stage_costs(cm, bounds, schedule=schedule, microbatches=micro)
    assert sc.bottleneck_ms == pytest.approx(t_star, rel=1e-9, abs=1e-12)
    res = plan_partition(cm, num_stages=stages, schedule=schedule, microbatches=micro)
    assert res.exhaustive  # small instances are always searched completely
    assert res.step_ms == pytest.approx(step_brute, rel=1e-9, abs=1e-12)
    assert res.optimal_bottleneck_ms == pytest.approx(t_brute, rel=1e-9, abs=1e-12)
    assert res.bottleneck_ms >= res.optimal_bottleneck_ms * (1 - 1e-12)


@settings(max_examples=200, deadline=None)
@given(instances)
def test_host_bound_stages_plan_exactly(inst) -> None:
    """With host issue times a stage costs the longer of its device's sum and its host's:
    the planner still finds the brute-force optimum of the simulated step."""
    seed, layers, stages, micro, schedule = inst
    stages = min(stages, layers)
    rng = np.random.default_rng(seed)
    cm = random_costs(rng, layers, stages, comm=bool(seed % 2))
    # Host times around the device times: some layers host-bound, some device-bound.
    host_f = cm.fwd_ms[0] * rng.uniform(0.3, 2.5, layers)
    host_b = cm.bwd_ms[0] * rng.uniform(0.3, 2.5, layers)
    hc = dataclasses.replace(
        cm,
        host_fwd_ms=np.repeat(host_f[None], stages, axis=0),
        host_bwd_ms=np.repeat(host_b[None], stages, axis=0),
    )
    _, step_brute, bounds_brute = brute(hc, stages, micro, schedule)
    res = plan_partition(hc, num_stages=stages, schedule=schedule, microbatches=micro)
    assert res.exhaustive
    assert res.step_ms == pytest.approx(step_brute, rel=1e-9, abs=1e-12)
    sc = stage_costs(hc, res.bounds, schedule=schedule, microbatches=micro)
    for s, (a, b) in enumerate(res.bounds):
        # One host issues a microbatch's forward and backward in turn: the totals compare.
        device = cm.fwd_ms[s, a:b].sum() + cm.bwd_ms[s, a:b].sum()
        host = host_f[a:b].sum() + host_b[a:b].sum()
        k = max(1.0, host / device)
        assert sc.fwd_ms[s] == pytest.approx(cm.fwd_ms[s, a:b].sum() * k, rel=1e-12)
        assert sc.bwd_ms[s] == pytest.approx(cm.bwd_ms[s, a:b].sum() * k, rel=1e-12)
    # The device sums alone are a lower bound of the same partition's step.
    plain = stage_costs(cm, bounds_brute, schedule=schedule, microbatches=micro)
    assert (
        sum(plain.fwd_ms)
        <= sum(stage_costs(hc, bounds_brute, schedule=schedule, microbatches=micro).fwd_ms) + 1e-12
    )


def test_a_hosts_slack_in_the_forward_covers_a_longer_backward() -> None:
    """resnet50's first nine layers at 128 images on an H200 (per microbatch): the host
    issued the forward in 10.5 ms and the backward in 31.3 against the device's 16.2 and
    26.4, and the stage ran its device's 42.6 ms. Each phase at its longer time would say
    47.5 ms; the totals say 42.6. Where the host's total is the longer, both phases stretch
    by its ratio."""
    cm = random_costs(np.random.default_rng(0), 2, 1)
    cm = dataclasses.replace(
        cm,
        fwd_ms=np.array([[10.0, 6.2]]),
        bwd_ms=np.array([[16.0, 10.4]]),
        stage_fwd_ms=np.zeros(1),
        stage_bwd_ms=np.zeros(1),
        host_fwd_ms=np.array([[6.0, 4.5]]),
        host_bwd_ms=np.array([[19.0, 12.3]]),
    )
    f, b = cm.stage_ms(0, 0, 2)
    assert (f, b) == (pytest.approx(16.2), pytest.approx(26.4))
    slow = dataclasses.replace(cm, host_bwd_ms=np.array([[30.0, 22.7]]))
    f, b = slow.stage_ms(0, 0, 2)
    assert f + b == pytest.approx(6.0 + 4.5 + 30.0 + 22.7)
    assert f / b == pytest.approx(16.2 / 26.4)


def test_host_times_must_come_for_both_phases() -> None:
    cm = random_costs(np.random.default_rng(0), 4, 2)
    with pytest.raises(UserError, match="host times for one phase only"):
        dataclasses.replace(cm, host_fwd_ms=cm.fwd_ms)


@settings(max_examples=150, deadline=None)
@given(instances, st.floats(0.3, 1.2))
def test_memory_limits_are_respected_or_the_error_says_what_fits(inst, frac) -> None:
    seed, layers, stages, micro, schedule = inst
    stages = min(stages, layers)
    rng = np.random.default_rng(seed)
    cm = random_costs(rng, layers, stages)
    # A limit around what the even split needs: sometimes feasible, sometimes not.
    even = stage_costs(cm, even_bounds(layers, stages), schedule=schedule, microbatches=micro)
    limit = max(even.mem_bytes) * frac + 1.0
    _, step_brute, _ = brute(cm, stages, micro, schedule, memory=limit)
    if np.isinf(step_brute):
        with pytest.raises(PlanError) as err:
            plan_partition(
                cm, num_stages=stages, schedule=schedule, microbatches=micro, memory_bytes=limit
            )
        msg = str(err.value)
        assert "\n" not in msg and "does not fit" in msg and "raise --memory-gb to" in msg
        need = float(msg.split("raise --memory-gb to ")[1].split(",")[0].split(" ")[0])
        # The amount named really is enough, and is not far above what is needed.
        plan_partition(
            cm, num_stages=stages, schedule=schedule, microbatches=micro, memory_bytes=need * 2**30
        )
        assert need * 2**30 > limit
        return
    res = plan_partition(
        cm, num_stages=stages, schedule=schedule, microbatches=micro, memory_bytes=limit
    )
    sc = stage_costs(cm, res.bounds, schedule=schedule, microbatches=micro)
    assert max(sc.mem_bytes) <= limit
    assert res.step_ms == pytest.approx(step_brute, rel=1e-9)


def test_infeasible_memory_names_the_need_and_other_fixes() -> None:
    rng = np.random.default_rng(3)
    cm = random_costs(rng, 12, 4)
    sc = stage_costs(cm, even_bounds(12, 4), schedule="gpipe", microbatches=8)
    with pytest.raises(PlanError) as err:
        plan_partition(
            cm, num_stages=4, schedule="gpipe", microbatches=8, memory_bytes=min(sc.mem_bytes) / 3
        )
    msg = str(err.value)
    assert "gpipe" in msg and "8 microbatches" in msg and "GiB on its fullest device" in msg
    assert "--schedule 1f1b" in msg and "more stages" in msg


def test_tight_memory_moves_layers_off_the_full_device() -> None:
    # One heavy-parameter layer: unlimited memory puts it with others on the faster stage;
    # a limit forces a split the time objective alone would not choose.
    layers = 6
    cm = CostModel(
        model="m",
        layer_names=tuple(f"l{i}" for i in range(layers)),
        fwd_ms=np.ones((2, layers)),
        bwd_ms=np.ones((2, layers)) * 2,
        param_bytes=np.array([0, 0, 0, 1e9, 0, 0.0]),
        out_bytes=np.ones(layers),
        act_bytes=np.zeros(layers),
        opt_mult=np.full(layers, 2.0),
        buffer_bytes=np.zeros(layers),
        bandwidth=[1e12],
        latency_ms=[0.0],
    )
    free = plan_partition(cm, num_stages=2, microbatches=4)
    assert free.bounds == ((0, 3), (3, 6))
    # 4 GB (param + grad + 2 Adam moments) fits on neither split side of 3/3 with 3.5 GB...
    with pytest.raises(PlanError, match=r"needs 3\.73 GiB"):
        plan_partition(cm, num_stages=2, microbatches=4, memory_bytes=3.5e9)
    # ...and per-device limits are honoured individually.
    res = plan_partition(cm, num_stages=2, microbatches=4, memory_bytes=[1e6, 5e9])
    assert res.bounds[0][1] <= 3


def test_migration_cost_keeps_the_current_plan_unless_the_gain_pays() -> None:
    rng = np.random.default_rng(7)
    cm = random_costs(rng, 30, 4)
    clean = plan_partition(cm, num_stages=4, microbatches=8)
    current = Plan(
        model="rand",
        num_layers=30,
        stages=tuple(StagePlan(a, b, r) for r, (a, b) in enumerate(clean.bounds)),
    )
    slowed = cm.with_slowdown([1.0, 1.0, 1.3, 1.0])
    moved = plan_partition(slowed, num_stages=4, microbatches=8)
    assert moved.bounds != clean.bounds
    # Priced so high no move pays: the current split stays.
    stay = plan_partition(
        slowed, num_stages=4, microbatches=8, current=current, migration_ms_per_byte=1.0
    )
    assert stay.bounds == clean.bounds and stay.migration_bytes == 0
    # Priced at zero: the same as ignoring it.
    free = plan_partition(
        slowed, num_stages=4, microbatches=8, current=current, migration_ms_per_byte=0.0
    )
    assert free.bounds == moved.bounds
    # Priced moderately: it never scores worse than either extreme's choice.
    price = 1e-9
    mid = plan_partition(
        slowed, num_stages=4, microbatches=8, current=current, migration_ms_per_byte=price
    )
    assert mid.score_ms <= stay.step_ms + 1e-9
    moved_bytes = sum(
        cm.state_bytes[i]
        for i in range(30)
        if current.owner(i) != next(s for s, (a, b) in enumerate(moved.bounds) if a <= i < b)
    )
    assert mid.score_ms <= moved.step_ms + price * moved_bytes + 1e-9
    assert mid.migration_ms == pytest.approx(price * mid.migration_bytes)


def test_problem_prices_ranges_like_stage_costs() -> None:
    rng = np.random.default_rng(11)
    cm = random_costs(rng, 20, 5)
    prob = Problem(cm, num_stages=5, schedule="1f1b", microbatches=6, memory=memory_limits(None, 5))
    for bounds in [even_bounds(20, 5), ((0, 1), (1, 2), (2, 3), (3, 4), (4, 20))]:
        cuts = np.array([[0, *[b for _, b in bounds]]])
        m = prob.metrics(cuts)
        sc = stage_costs(cm, bounds, schedule="1f1b", microbatches=6)
        np.testing.assert_allclose(m["fwd"][0], sc.fwd_ms)
        np.testing.assert_allclose(m["bwd"][0], sc.bwd_ms)
        np.testing.assert_allclose(m["comm"][0], sc.comm_ms)
        assert m["bottleneck"][0] == pytest.approx(sc.bottleneck_ms)
        s = np.arange(5)
        np.testing.assert_allclose(
            prob.Q[s, cuts[0, 1:]] - prob.Q[s, cuts[0, :-1]], sc.mem_bytes, rtol=1e-9
        )


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=1, max_size=40), st.data())
def test_range_min_matches_naive(vals, data) -> None:
    v = np.array(vals)
    n = len(v)
    lo = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=5, max_size=5)))
    hi = np.array(data.draw(st.lists(st.integers(-1, n - 1), min_size=5, max_size=5)))
    mv, mi = range_min(v, lo, hi)
    for q in range(5):
        if hi[q] < lo[q]:
            assert mv[q] == np.inf and mi[q] == -1
        else:
            seg = v[lo[q] : hi[q] + 1]
            assert mv[q] == seg.min() and mi[q] == lo[q] + int(np.argmin(seg))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=10), st.integers(1, 5))
def test_parameter_baseline_is_min_max_and_left_packed(weights, stages) -> None:
    stages = min(stages, len(weights))
    bounds = parameter_bounds(weights, stages)
    got = max(sum(weights[a:b]) for a, b in bounds)
    best = min(max(sum(weights[a:b]) for a, b in p) for p in all_partitions(len(weights), stages))
    assert got == best
    # Left-packed: no stage could take its successor's first layer within the bottleneck
    # without leaving a later stage empty.
    for s in range(stages - 1):
        a, b = bounds[s]
        if bounds[s + 1][1] - bounds[s + 1][0] > 1 or s + 1 == stages - 1:
            assert sum(weights[a : b + 1]) > best or b + 1 > len(weights) - (stages - 1 - s)


def test_even_baseline_gives_earlier_stages_the_remainder() -> None:
    assert even_bounds(10, 4) == ((0, 3), (3, 6), (6, 8), (8, 10))
    with pytest.raises(PlanError):
        even_bounds(3, 4)


def test_stage_count_and_rank_errors() -> None:
    cm = random_costs(np.random.default_rng(0), 3, 1)
    with pytest.raises(PlanError, match="into 4 stages"):
        plan_partition(cm, num_stages=4)
    with pytest.raises(PlanError, match="ranks"):
        plan_partition(cm, num_stages=2, ranks=[0])
    two = random_costs(np.random.default_rng(0), 3, 2)
    with pytest.raises(Exception, match="2 devices"):
        plan_partition(two, num_stages=3)


def test_make_plan_fills_predictions_that_the_simulator_reproduces() -> None:
    rng = np.random.default_rng(5)
    cm = random_costs(rng, 16, 4)
    plan = make_plan(cm, num_stages=4, microbatches=8, memory_bytes=64e9)
    assert plan.meta["method"] == "dp" and plan.meta["exhaustive"] in (True, False)
    sc = stage_costs(cm, plan.bounds, schedule="1f1b", microbatches=8)
    assert [st.fwd_ms for st in plan.stages] == pytest.approx(sc.fwd_ms, rel=1e-6)
    assert [st.mem_bytes for st in plan.stages] == list(sc.mem_bytes)
    assert plan.stages[-1].comm_ms is None and plan.stages[0].send_bytes == sc.send_bytes[0]
    sim = simulate(sc.fwd_ms, sc.bwd_ms, comm_ms=sc.comm_ms, microbatches=8)
    assert plan.meta["step_ms"] == pytest.approx(sim.step_ms, rel=1e-6)
    loads = sc.load_ms
    assert (
        plan.meta["bottleneck_stage"] == int(np.argmax(loads))
        or plan.meta["bottleneck_kind"] == "link"
    )
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.timing
@pytest.mark.parametrize(("layers", "stages", "limit_ms"), [(200, 8, 500), (1000, 64, 8000)])
def test_large_instances_plan_quickly(layers, stages, limit_ms) -> None:
    # A loose guard (the benchmark measures properly): the machine is shared.
    cm = random_costs(np.random.default_rng(1), layers, stages)
    res = plan_partition(cm, num_stages=stages, microbatches=2 * stages)
    assert res.solve_ms < limit_ms
    assert len(res.bounds) == stages and res.bounds[-1][1] == layers
