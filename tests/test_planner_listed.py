"""``best_bounds`` (every split scored) against ``plan_partition`` (bound and search): the
same split on every instance, ties, memory limits, host times and overheads included."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_planner_dp import random_costs

from dynpipe.planner.baselines import even_bounds
from dynpipe.planner.dp import plan_partition
from dynpipe.planner.evaluate import stage_costs
from dynpipe.planner.listed import _splits, best_bounds
from dynpipe.planner.plan import PlanError

instances = st.tuples(
    st.integers(0, 2**32 - 1),  # seed
    st.integers(1, 18),  # layers
    st.integers(1, 4),  # stages (clipped to layers)
    st.integers(1, 8),  # microbatches
    st.sampled_from(["1f1b", "gpipe"]),
    st.booleans(),  # identical layers (ties between splits)
    st.booleans(),  # host times and stage overheads
)


def _instance(inst):
    seed, layers, stages, micro, schedule, same, host = inst
    stages = min(stages, layers)
    rng = np.random.default_rng(seed)
    cm = random_costs(rng, layers, stages, comm=bool(seed % 2))
    if same:
        # Repeated blocks, every device alike: many splits score exactly alike.
        f, b = np.round(cm.fwd_ms[:1, :1], 3), np.round(cm.bwd_ms[:1, :1], 3)
        cm = dataclasses.replace(
            cm,
            fwd_ms=np.broadcast_to(f, cm.fwd_ms.shape),
            bwd_ms=np.broadcast_to(b, cm.bwd_ms.shape),
            out_bytes=np.full(layers, cm.out_bytes[0]),
            bandwidth=np.full(stages - 1, cm.bandwidth[0]) if stages > 1 else cm.bandwidth,
            latency_ms=np.full(stages - 1, cm.latency_ms[0]) if stages > 1 else cm.latency_ms,
        )
    if host:
        cm = dataclasses.replace(
            cm,
            host_fwd_ms=np.repeat((cm.fwd_ms[0] * rng.uniform(0.3, 2.5, layers))[None], stages, 0),
            host_bwd_ms=np.repeat((cm.bwd_ms[0] * rng.uniform(0.3, 2.5, layers))[None], stages, 0),
            stage_fwd_ms=rng.uniform(0, 0.5, stages),
            stage_bwd_ms=rng.uniform(0, 0.5, stages),
        )
    return cm, stages, micro, schedule


@settings(max_examples=300, deadline=None)
@given(instances)
def test_the_split_plan_partition_chooses(inst) -> None:
    cm, stages, micro, schedule = _instance(inst)
    want = plan_partition(cm, num_stages=stages, schedule=schedule, microbatches=micro)
    got = best_bounds(cm, num_stages=stages, schedule=schedule, microbatches=micro)
    assert got == tuple(want.bounds)


@settings(max_examples=200, deadline=None)
@given(instances, st.floats(0.3, 1.2))
def test_the_split_within_memory_or_plan_partitions_error(inst, frac) -> None:
    cm, stages, micro, schedule = _instance(inst)
    even = stage_costs(
        cm, even_bounds(cm.num_layers, stages), schedule=schedule, microbatches=micro
    )
    limit = [max(even.mem_bytes) * frac + 1.0] * stages
    kw = {"num_stages": stages, "schedule": schedule, "microbatches": micro, "memory_bytes": limit}
    try:
        want = tuple(plan_partition(cm, **kw).bounds)
    except PlanError as err:
        with pytest.raises(PlanError, match="does not fit"):
            best_bounds(cm, **kw)
        assert "does not fit" in str(err)
        return
    assert best_bounds(cm, **kw) == want


def test_a_split_at_the_memory_limit_is_listed_as_the_search_lists_it() -> None:
    """The stage that holds everything, with exactly its bytes as the limit: one split."""
    cm, *_ = _instance((7, 6, 1, 2, "1f1b", False, False))
    need = stage_costs(cm, ((0, 6),), schedule="1f1b", microbatches=2).mem_bytes[0]
    for limit in (need, need - 1.0, need + 1.0):
        kw = {"num_stages": 1, "schedule": "1f1b", "microbatches": 2, "memory_bytes": limit}
        try:
            want = tuple(plan_partition(cm, **kw).bounds)
        except PlanError:
            with pytest.raises(PlanError):
                best_bounds(cm, **kw)
            continue
        assert best_bounds(cm, **kw) == want


def test_many_splits_go_to_the_search() -> None:
    cm = random_costs(np.random.default_rng(1), 40, 6)
    assert _splits(40, 6) > 4096
    want = plan_partition(cm, num_stages=6, microbatches=8)
    assert best_bounds(cm, num_stages=6, microbatches=8) == tuple(want.bounds)
