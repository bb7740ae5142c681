"""Live repartitioning keeps training exact, and fails loudly and everywhere when a peer dies.

Forced repartitions move layers across several stages at once and back again; the run must
end bit-identical, parameters and optimizer state, to single-process training.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from distutil import run_ranks
from test_runtime_equivalence import BATCH, make_batch, optim_config

pytestmark = pytest.mark.slow

STEPS = 8
MODEL = {"depth": 6, "width": 32}  # 8 layers


def _plans(model, world: int):
    from dynpipe.planner import Plan

    n = len(model)
    # Everything but one layer per stage piles up at the end, then at the front, then back.
    return {
        2: Plan.from_bounds(model, [1] * (world - 1) + [n - world + 1]),
        4: Plan.from_bounds(model, [n - world + 1] + [1] * (world - 1)),
        6: Plan.even(model, world),
    }


def _forced(rank: int, world: int, opt: str) -> dict:
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.migrate import repartition
    from dynpipe.runtime.topology import Topology

    model = get_model("mlp", **MODEL)
    eng = PipelineEngine(
        model,
        Plan.even(model, world),
        topo=Topology.from_env(device="cpu"),
        config=EngineConfig(batch_size=BATCH, optim=optim_config(opt)),
    )
    plans = _plans(model, world)
    moved = []
    for s in range(STEPS):
        if s in plans:
            stats = repartition(eng, plans[s])
            moved.append([repr(t) for t in stats.transfers])
        eng.step(s, make_batch(model, s))
    return {"model": eng.model_state(), "optim": eng.optim_state(), "moved": moved}


@pytest.mark.parametrize("world", [2, 4])
def test_forced_repartitions_are_bit_identical(world: int) -> None:
    from dynpipe.models import get_model
    from dynpipe.runtime.reference import ReferenceTrainer

    torch.set_num_threads(1)
    for opt in ("sgd", "adamw"):
        results = run_ranks(_forced, world, opt)
        ref = ReferenceTrainer(
            model=get_model("mlp", **MODEL),
            batch_size=BATCH,
            microbatches=4,
            optim=optim_config(opt),
        )
        for s in range(STEPS):
            ref.step(s, make_batch(ref.model, s))
        model, optim = {}, {}
        for r in results:
            model.update(r["value"]["model"])
            optim.update(r["value"]["optim"])
        want_m, want_o = ref.model_state(), ref.optim_state()
        assert set(model) == set(want_m) and set(optim) == set(want_o), opt
        for k in want_m:
            assert torch.equal(model[k], want_m[k]), f"{opt}: {k}"
        for k in want_o:
            assert torch.equal(optim[k], want_o[k]), f"{opt}: {k}"
        moved = results[0]["value"]["moved"]
        assert all(moved), "every forced repartition moved layers"
        if world == 4:
            # Layers crossed several stages in one repartition (rank 0 -> rank 3 and back).
            assert any("r0->r3" in t or "r3->r0" in t for m in moved for t in m), moved


def _receiver_dies(rank: int, world: int) -> str:
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.health import Heartbeat
    from dynpipe.runtime.migrate import repartition
    from dynpipe.runtime.topology import Topology

    model = get_model("mlp", **MODEL)
    eng = PipelineEngine(
        model,
        Plan.even(model, world),
        topo=Topology.from_env(device="cpu", timeout_s=20),
        config=EngineConfig(batch_size=BATCH, optim=optim_config("sgd")),
    )
    beat = Heartbeat(topo=eng.topo, interval_s=0.5).start()
    eng.step(0, make_batch(model, 0))
    if rank == 2:
        time.sleep(1.0)
        os._exit(9)  # the receiving peer dies just before the migration
    t0 = time.time()
    try:
        # Rank 2 would receive layers from rank 1.
        repartition(eng, Plan.from_bounds(model, [3, 1, 4]), beat=beat)
    except Exception as exc:
        return f"{time.time() - t0:.1f} {type(exc).__name__}: {exc}"
    finally:
        beat.stop()
    return "no error"


@pytest.mark.timing
def test_migration_peer_death_fails_every_rank_naming_it() -> None:
    res = run_ranks(_receiver_dies, 3, timeout_s=120, pg_timeout_s=20, expect_failure=True)
    for r in (0, 1):
        msg = res[r]["value"]
        assert "MigrationError" in msg, msg
        assert "rank 2" in msg, msg
        assert float(msg.split()[0]) < 40, msg


def test_pack_round_trip_and_corruption_is_caught() -> None:
    from dynpipe.runtime.migrate import MigrationError, pack, unpack

    # An int64 right after 33 * 17 float32 (2244 bytes) and after 3 bfloat16 (6 bytes): a
    # BatchNorm counter after a weight of odd length must still be viewable in place.
    tensors = {
        "w": torch.randn(33, 17),
        "idx": torch.arange(5),
        "half": torch.randn(3, dtype=torch.bfloat16),
        "count": torch.tensor(7, dtype=torch.int64),
        "step": torch.tensor(4.0),
        "empty": torch.empty(0, 4),
    }
    header, buf = pack(tensors, device=torch.device("cpu"))
    out = unpack(header, buf.clone(), where="test")
    assert set(out) == set(tensors)
    for k, v in tensors.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k
    bad = buf.clone()
    bad[len(bad) // 2] ^= 1
    with pytest.raises(MigrationError, match="checksum mismatch"):
        unpack(header, bad, where="test")


def _warm(rank: int, world: int) -> float:
    from dynpipe.runtime.migrate import warm_links
    from dynpipe.runtime.topology import Topology

    return warm_links(Topology.from_env(device="cpu", timeout_s=30), warm_bytes=1 << 20)


def test_link_warm_up_reaches_every_peer_through_the_transfer_path() -> None:
    # Three ranks: every pair exchanges ids and a checksummed 1 MB message in one batch.
    res = run_ranks(_warm, 3, timeout_s=120)
    assert all(r["ok"] and r["value"] > 0 for r in res), res


def _bandwidth(rank: int, world: int) -> float | None:
    from dynpipe.runtime.links import measure_bandwidth
    from dynpipe.runtime.topology import Topology

    return measure_bandwidth(Topology.from_env(device="cpu", timeout_s=30), nbytes=2 << 20)


def test_link_bandwidth_is_measured_once_and_agreed_by_every_rank() -> None:
    # Three ranks, two links: each pair sends its bursts in turn, and every rank returns
    # the same median (one all-reduce hands out the pairs' times).
    res = run_ranks(_bandwidth, 3, timeout_s=120)
    assert all(r["ok"] for r in res), res
    values = {r["value"] for r in res}
    assert len(values) == 1, values
    (bw,) = values
    # Loopback gloo moves megabytes in well under a second and not faster than memory.
    assert 1e6 < bw < 1e12, bw
