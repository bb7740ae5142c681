"""The topology is the one reader of the launcher's environment; the heartbeat and the
process group reach the rendezvous store through it, in the launch attempt's own keys."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from dynpipe.runtime.health import Heartbeat
from dynpipe.runtime.topology import Topology

ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
)


@pytest.fixture
def bare_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def server():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_from_env_defaults_to_one_process_without_a_store(bare_env) -> None:
    topo = Topology.from_env(device="cpu")
    assert (topo.rank, topo.world_size, topo.local_rank, topo.backend) == (0, 1, 0, "gloo")
    assert topo.restart_attempt == 0 and not topo.agent_store
    assert topo.store_host is None and topo.connect_store() is None


def test_from_env_reads_the_torchrun_environment(bare_env) -> None:
    bare_env.setenv("RANK", "3")
    bare_env.setenv("WORLD_SIZE", "4")
    bare_env.setenv("LOCAL_RANK", "1")
    bare_env.setenv("MASTER_ADDR", "node0")
    bare_env.setenv("MASTER_PORT", "29511")
    bare_env.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    bare_env.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    topo = Topology.from_env(device="cpu", timeout_s=7.0)
    assert (topo.rank, topo.world_size, topo.local_rank) == (3, 4, 1)
    assert (topo.store_host, topo.store_port) == ("node0", 29511)
    assert topo.restart_attempt == 2 and topo.agent_store and topo.timeout_s == 7.0


def _topo(port: int, *, rank: int, attempt: int) -> Topology:
    return Topology(
        rank=rank,
        world_size=2,
        local_rank=rank,
        device=Topology.from_env(device="cpu").device,
        backend="gloo",
        timeout_s=10.0,
        restart_attempt=attempt,
        store_host="127.0.0.1",
        store_port=port,
    )


def test_each_launch_attempt_has_its_own_keys(server) -> None:
    first = _topo(server.port, rank=0, attempt=0).connect_store()
    again = _topo(server.port, rank=0, attempt=0).connect_store()
    relaunch = _topo(server.port, rank=0, attempt=1).connect_store()
    first.set("k", "attempt 0")
    assert again.get("k") == b"attempt 0"
    assert not relaunch.check(["k"])


def test_heartbeat_names_a_peer_whose_beat_went_stale(server) -> None:
    beat = Heartbeat(topo=_topo(server.port, rank=0, attempt=1), interval_s=0.2).start()
    try:
        peers = _topo(server.port, rank=1, attempt=1).connect_store()
        peers.set("dynpipe/hb/1", repr(time.time() - 60.0))  # rank 1 last beat a minute ago
        ((rank, age),) = beat.dead_peers(wait_s=0.0)
        assert rank == 1 and age >= 60.0
        # This rank's own beat lands in the same attempt's keys, and only there.
        assert float(peers.get("dynpipe/hb/0").decode()) > time.time() - 60.0
        other = _topo(server.port, rank=1, attempt=0).connect_store()
        assert not other.check(["dynpipe/hb/0"])
    finally:
        beat.stop()


def test_heartbeat_of_one_process_does_nothing(bare_env) -> None:
    beat = Heartbeat(topo=Topology.from_env(device="cpu")).start()
    assert beat.dead_peers(wait_s=0.0) == []
    beat.stop()
