"""Who this process is in the pipeline world: the one object that knows rank and device.

Only the entry point reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``; everything else receives a
``Topology`` by keyword (distributed state is passed, not fetched).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dynpipe.errors import UserError

__all__ = ["Topology", "destroy", "init_distributed"]


@dataclass(frozen=True)
class Topology:
    """This rank's place in the world and the device it computes on.

    ``timeout_s`` bounds every blocking collective and P2P wait: a dead or stuck peer turns
    into an error after at most that long instead of a hang.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    timeout_s: float = 120.0

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @classmethod
    def from_env(cls, *, device: str = "auto", timeout_s: float = 120.0) -> Topology:
        """Read the torchrun environment (defaults to a single process)."""
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
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
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Under torchrun every relaunch talks to the same agent store. Keys left by the
        # previous attempt (a dead rank's gloo address, its heartbeat) must not be read as
        # this attempt's, so each attempt gets its own key space.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            topo.world_size,
            is_master=False,
            timeout=timeout,
        )
        kwargs["store"] = dist.PrefixStore(f"dynpipe/attempt_{attempt}", store)
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
