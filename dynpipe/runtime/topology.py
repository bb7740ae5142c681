"""Who this process is in the pipeline world: the one object that knows rank and device.

``Topology.from_env`` is the only reader of the launcher's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, the rendezvous store's address, torchrun's restart count);
everything else receives a ``Topology`` by keyword (distributed state is passed, not
fetched).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dynpipe.errors import UserError

__all__ = ["Topology", "destroy", "init_distributed", "resolve_device", "wait_all"]


def resolve_device(device: str) -> str:
    """``--device`` as the run will use it: ``auto`` is the GPUs when there are some."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@dataclass(frozen=True)
class Topology:
    """This rank's place in the world and the device it computes on.

    timeout_s: bounds every blocking collective and P2P wait: a dead or stuck peer turns
        into an error after at most that long instead of a hang.
    restart_attempt: how many times torchrun's agent has relaunched this job (0: the first
        launch).
    store_host / store_port: the rendezvous store every rank reaches (``MASTER_ADDR`` /
        ``MASTER_PORT``); None when there is none (one process).
    agent_store: the store is hosted by torchrun's agent (it outlives relaunches), not by
        rank 0's process group.
    run_id: torchrun's id of the job, the same for every relaunch (None outside torchrun).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    timeout_s: float = 120.0
    restart_attempt: int = 0
    store_host: str | None = None
    store_port: int | None = None
    agent_store: bool = False
    run_id: str | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def connect_store(self) -> dist.Store | None:
        """A client of the rendezvous store whose keys are this launch attempt's own.

        Under torchrun every relaunch talks to the same agent store: keys a previous attempt
        left (a dead rank's address, its heartbeat) must not be read as this attempt's, so
        each attempt gets its own key space. None without a store (one process).
        """
        if self.store_host is None or self.store_port is None:
            return None
        store = dist.TCPStore(
            self.store_host,
            self.store_port,
            self.world_size,
            is_master=False,
            timeout=timedelta(seconds=self.timeout_s),
        )
        return dist.PrefixStore(f"dynpipe/attempt_{self.restart_attempt}", store)

    @classmethod
    def from_env(cls, *, device: str = "auto", timeout_s: float = 120.0) -> Topology:
        """Read the torchrun environment (defaults to a single process)."""
        env = os.environ
        rank = int(env.get("RANK", "0"))
        world = int(env.get("WORLD_SIZE", "1"))
        local = int(env.get("LOCAL_RANK", "0"))
        port = env.get("MASTER_PORT")
        device = resolve_device(device)
        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise UserError(
                    "--device cuda was asked for but no CUDA device is visible; use --device cpu"
                )
            n = torch.cuda.device_count()
            if local >= n:
                raise UserError(
                    f"local rank {local} needs GPU {local} but this node has {n} GPUs; "
                    f"launch at most {n} processes per node"
                )
            dev = torch.device("cuda", local)
            backend = "nccl"
        elif device == "cpu":
            dev = torch.device("cpu")
            backend = "gloo"
        else:
            raise UserError(f"unknown device {device!r}; use auto, cpu or cuda")
        return cls(
            rank=rank,
            world_size=world,
            local_rank=local,
            device=dev,
            backend=backend,
            timeout_s=timeout_s,
            restart_attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            store_host=env.get("MASTER_ADDR") if port else None,
            store_port=int(port) if port else None,
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            run_id=env.get("TORCHELASTIC_RUN_ID"),
        )


def init_distributed(topo: Topology) -> None:
    """Create the default process group (env:// rendezvous) with the topology's timeout."""
    if dist.is_initialized():
        return
    if topo.is_cuda:
        torch.cuda.set_device(topo.device)
    kwargs = {}
    if topo.is_cuda:
        # Binds NCCL to this device up front, which also makes P2P communicators eager.
        kwargs["device_id"] = topo.device
    timeout = timedelta(seconds=topo.timeout_s)
    if topo.agent_store:
        # The agent's store outlives relaunches: the group rendezvouses in this attempt's
        # own key space (a previous attempt's keys would otherwise be read as this one's).
        kwargs["store"] = topo.connect_store()
    dist.init_process_group(
        backend=topo.backend,
        rank=topo.rank,
        world_size=topo.world_size,
        timeout=timeout,
        **kwargs,
    )


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def slowest(ms: float, *, topo: Topology) -> float:
    """The largest of every rank's ``ms`` (collective): a pause the job waits out is its
    slowest rank's, and every rank's policy must learn the same number."""
    if topo.world_size == 1:
        return ms
    t = torch.tensor([ms], dtype=torch.float64, device=topo.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def wait_all(works: list, *, timeout_s: float, what: str) -> None:
    """Wait for asynchronous collectives or point-to-point works, each within ``timeout_s``;
    ``TimeoutError`` naming ``what`` if one does not complete (no wait is unbounded)."""
    for w in works:
        if w.wait(timeout=timedelta(seconds=timeout_s)) is False:
            raise TimeoutError(f"{what} did not complete within {timeout_s:.0f}s")
