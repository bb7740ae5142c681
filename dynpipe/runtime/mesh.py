"""Where a rank sits in a data x pipeline parallel job: a 2-D ``DeviceMesh`` (dp, pp).

``Mesh`` is plain rank arithmetic (which replica, which place in its pipeline, the global
rank of any (replica, place)) plus, once the process group exists, torch's
``DeviceMesh`` with dimensions ``("dp", "pp")`` and its two sub-groups: a replica's
pipeline stages talk over the ``pp`` group, a stage's copies in every replica average their
gradients over the ``dp`` group. Rank ``r * pp + p`` is place ``p`` of replica ``r``, as in
``init_device_mesh``'s row-major layout.

One replica (``dp == 1``) makes no mesh and no sub-groups: the pipeline uses the default
group exactly as a single-pipeline run always has.

A run that may change its shape while it trains (``--autodp``) makes the meshes of every
shape of its world at start-up (``init_meshes``): new groups are collective, and made in
the middle of a run, by ranks that disagree on when, they are where hangs come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dynpipe.errors import UserError

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from dynpipe.runtime.topology import Topology

__all__ = ["Mesh", "check_dp", "init_mesh", "init_meshes", "shapes"]


def check_dp(dp: int, *, world_size: int) -> int:
    """Pipeline stages per replica for ``dp`` replicas over ``world_size`` ranks."""
    if dp < 1:
        raise UserError(f"--dp must be >= 1 (pipeline replicas), got {dp}")
    if world_size % dp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise UserError(
            f"--dp {dp} does not divide {world_size} workers into equal pipelines; use --dp "
            f"{' or '.join(map(str, divisors))}, or --nproc a multiple of {dp}"
        )
    return world_size // dp


def shapes(world_size: int) -> list[tuple[int, int]]:
    """Every ``(dp, pp)`` with ``dp * pp == world_size``, fewest replicas first."""
    return [(d, world_size // d) for d in range(1, world_size + 1) if world_size % d == 0]


@dataclass(frozen=True, eq=False)
class Mesh:
    """Rank ``rank`` of a ``dp`` x ``pp`` mesh.

    device_mesh: torch's ``DeviceMesh`` (dims ``("dp", "pp")``) once groups exist; None for
        one replica or without a process group (the rank arithmetic still holds).
    """

    dp: int
    pp: int
    rank: int
    device_mesh: DeviceMesh | None = None

    def __post_init__(self) -> None:
        if self.dp < 1 or self.pp < 1 or not 0 <= self.rank < self.dp * self.pp:
            raise ValueError(f"rank {self.rank} is not in a {self.dp} x {self.pp} mesh")

    def __repr__(self) -> str:
        return f"Mesh(dp={self.dp} pp={self.pp} rank={self.rank}: replica {self.replica}, place {self.pp_rank})"

    @property
    def world_size(self) -> int:
        return self.dp * self.pp

    @property
    def replica(self) -> int:
        return self.rank // self.pp

    @property
    def pp_rank(self) -> int:
        """This rank's place in its replica's pipeline (the rank a ``Plan`` names)."""
        return self.rank % self.pp

    def global_rank(self, pp_rank: int, replica: int | None = None) -> int:
        """The rank of place ``pp_rank`` in ``replica`` (default: this rank's replica)."""
        return (self.replica if replica is None else replica) * self.pp + pp_rank

    def replica_ranks(self, replica: int) -> list[int]:
        return [replica * self.pp + p for p in range(self.pp)]

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """This replica's pipeline group (None: the default group, one replica)."""
        return None if self.device_mesh is None else self.device_mesh.get_group("pp")

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The group of this stage's copies in every replica (None: one replica)."""
        return None if self.device_mesh is None else self.device_mesh.get_group("dp")

    @classmethod
    def single(cls, *, rank: int, world_size: int) -> Mesh:
        """One pipeline over the whole world (no sub-groups)."""
        return cls(dp=1, pp=world_size, rank=rank)


def init_mesh(topo: Topology, *, dp: int) -> Mesh:
    """This rank's mesh; with ``dp > 1`` builds torch's ``DeviceMesh`` (collective: every
    rank calls it once the default process group exists).

    The sub-groups are made here, with the topology's timeout, and handed to
    ``DeviceMesh.from_group``: groups ``init_device_mesh`` makes would take the backend's
    default timeout (30 minutes on gloo), and no collective may wait that long on a dead peer.
    """
    pp = check_dp(dp, world_size=topo.world_size)
    if dp == 1:
        return Mesh.single(rank=topo.rank, world_size=topo.world_size)
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    layout = torch.arange(dp * pp, dtype=torch.int).view(dp, pp)
    timeout = timedelta(seconds=topo.timeout_s)
    # Every rank creates every group, in the same order (new_group is collective).
    pp_group, _ = dist.new_subgroups_by_enumeration(layout.tolist(), timeout=timeout)
    dp_group, _ = dist.new_subgroups_by_enumeration(layout.t().tolist(), timeout=timeout)
    try:
        device_mesh = DeviceMesh.from_group(
            [dp_group, pp_group], topo.device.type, mesh=layout, mesh_dim_names=("dp", "pp")
        )
    except (TypeError, ValueError, NotImplementedError):
        # A torch whose DeviceMesh cannot adopt 2-D groups makes its own (their timeout is
        # then the backend's default).
        from torch.distributed.device_mesh import init_device_mesh

        device_mesh = init_device_mesh(topo.device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
    return Mesh(dp=dp, pp=pp, rank=topo.rank, device_mesh=device_mesh)


def init_meshes(topo: Topology) -> dict[int, Mesh]:
    """This rank's mesh in every shape of the world, keyed by ``dp`` (collective: every
    rank makes every shape's groups, in the same order, before training starts)."""
    return {dp: init_mesh(topo, dp=dp) for dp, _ in shapes(topo.world_size)}
