"""The controller simulator's truth: a slowed device's slowdown follows its load.

On 2 x H200 a slowed stage's excess over clean grows with how busy a split keeps its device
(gpt under ``gemm``: 1.7x at 15% busy, 2.05x at 85%; the oracle sweeps,
``bench/sweep_slowdown.py``). The simulator's truth scales the excess by ``c + (1 - c) u``
per device; ``c = 1`` is the load-independent truth it had before.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import numpy as np

from dynpipe.sim import simulator as sim


@lru_cache(maxsize=1)
def _setup():
    workloads = {w.name: w for w in sim.load_workloads()}
    traces = sim.noise_from_logs()
    return workloads, traces


def _scenario(c: float, **kw) -> sim.Scenario:
    """vgg16 (batch 32), 2 stages, ``gemm`` on rank 1 from step 0, the first recorded run's
    noise, rank 1's load coefficient ``c``."""
    w = _setup()[0]["vgg16-bs32"]
    base = dict(
        seed=0,
        workload=w.name,
        stages=2,
        microbatches=4,
        steps=40,
        events=((), ((0, 40, "gemm@1x1"),)),
        noise=((0, 0), (1, 0)),
        pause_fixed_ms=20.0,
        link_bytes_per_ms=20e6,
        stall=0.5,
        untimed=0.2,
        load_c=(1.0, c),
    )
    return sim.Scenario(**{**base, **kw})


def _truth(sc: sim.Scenario) -> sim._Truth:
    workloads, traces = _setup()
    return sim._Truth(sc, workloads[sc.workload], traces)


def test_a_device_kept_less_busy_shows_less_of_its_slowdown() -> None:
    flat, loaded = _truth(_scenario(1.0)), _truth(_scenario(0.5))
    n = 16
    light, full = ((0, 14), (14, n)), ((0, 4), (4, n))
    # Rank 1 holding two layers waits on rank 0 most of the step: it shows about half its
    # excess; holding twelve it is nearly always busy and shows nearly all of it.
    g_light = loaded.gain(light)[1].mean()
    g_full = loaded.gain(full)[1].mean()
    assert g_light < 0.75 and g_full > 0.85, (g_light, g_full)
    step = 10
    f_flat, b_flat = flat.stage_loads(light, step, (0, 1))
    f_light, b_light = loaded.stage_loads(light, step, (0, 1))
    clean = loaded.clean_fwd[1, step, 14:n].sum() + loaded.clean_bwd[1, step, 14:n].sum()
    assert f_light[1] + b_light[1] < f_flat[1] + b_flat[1]
    assert f_light[1] + b_light[1] > clean
    # The step follows: lighter than the load-independent truth where rank 1 bounds it.
    assert loaded.step_ms(full).mean() < flat.step_ms(full).mean()
    assert loaded.step_ms(full).mean() > 0.9 * flat.step_ms(full).mean()


def test_a_coefficient_of_one_is_the_load_independent_truth_exactly() -> None:
    a, b = _truth(_scenario(1.0)), _truth(dataclasses.replace(_scenario(1.0), load_c=()))
    for bounds in (((0, 8), (8, 16)), ((0, 3), (3, 16))):
        assert np.array_equal(a.step_ms(bounds), b.step_ms(bounds))
    assert a.flat and b.flat
    workloads, traces = _setup()
    kw = dict(workloads=list(workloads.values()), traces=traces, seed=3)
    on = sim.random_scenarios(20, **kw)
    off = sim.random_scenarios(20, load_dependent=False, **kw)
    # The coefficients have a generator of their own: every other draw is the same.
    assert [dataclasses.replace(s, load_c=()) for s in on] == off
    assert any(min(s.load_c) < 1.0 for s in on)


def test_the_two_stage_oracle_is_the_best_split_under_load() -> None:
    sc = _scenario(0.4, events=((), ((10, 30, "gemm@1x1"),)))
    workloads, _ = _setup()
    w = workloads[sc.workload]
    truth = _truth(sc)
    oracle = sim._oracle(sc, w, truth)
    n = w.num_layers
    for a, b in sim._phases(sc):
        best = min(truth.step_ms(((0, k), (k, n)))[a:b].mean() for k in range(1, n))
        assert oracle[a:b].mean() <= best + 1e-9
