"""Live repartitioning: move only the layers that change owner, with their optimizer state.

At a step boundary every rank calls ``repartition(engine, new_plan)`` with the same plan.
``diff(old, new)`` names the moving layers; for each (source, destination) pair the source
packs those layers' parameters, buffers and optimizer state into one byte buffer (one
message per pair, however many layers move), with a header describing every tensor and a
checksum. Two rounds of ``batch_isend_irecv`` carry the sizes, then headers and payloads:
each rank posts all its sends and receives of a round in one batch, which cannot deadlock
on gloo or NCCL whatever the transfer pattern. Receivers build the layers from the model
spec, load the bytes, verify the checksum, and every rank rebuilds its stage, optimizer
and schedule under the new plan, keeping its process group.

With data parallelism every replica holds the same layers on the same stages, so the plan's
diff is the same in each: each replica's ranks move their own copies among themselves
(place ``p`` of replica ``r`` is rank ``r * pp + p``), all replicas at once, and the vote is
over every rank of every replica. A plan that changes only the batch shares (or the
replicas partial reduce drops) moves nothing and rebuilds the stages.

A plan may leave ranks idle (one replica): a rank that goes idle sends all its layers and
keeps none; one that comes back receives its layers like any other destination. Ranks are
the world's, so the transfers, the vote and the rebuild are the same code either way.

``reshape`` changes the number of replicas (``--autodp``): the same transfer, checksums,
vote and rebuild, but the layers are copied, not moved (a new replica needs every layer
its stages hold, from whichever rank holds one now), and each rank rebuilds at its place in
the new shape's mesh.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dynpipe.planner.diff import Transfer, diff
from dynpipe.planner.plan import Plan
from dynpipe.runtime.engine import PipelineEngine
from dynpipe.runtime.health import Heartbeat
from dynpipe.runtime.mesh import Mesh
from dynpipe.runtime.topology import Topology, wait_all

__all__ = [
    "MigrationError",
    "MigrationStats",
    "checksum",
    "pack",
    "repartition",
    "reshape",
    "unpack",
    "warm_links",
]

_ROW = 1024  # checksum layout: 32-bit words per row
_ALIGN = 16  # bytes between packed tensors' starts; covers every dtype's element size


class MigrationError(RuntimeError):
    """A repartition failed; the message names the rank, the peer and both plans."""


@dataclass
class MigrationStats:
    """What one repartition moved and what it cost on this rank (seconds)."""

    transfers: list[Transfer] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    # The transfer: packing and checksumming, the wire, and unpacking with the vote;
    # the rebuild: building received layers, and rebuilding the stage and optimizer.
    pack_s: float = 0.0
    wire_s: float = 0.0
    unpack_s: float = 0.0
    build_s: float = 0.0
    engine_s: float = 0.0
    # --compile: the first compile of what the rebuilt stage runs (``warm_compiled``).
    compile_s: float = 0.0

    @property
    def transfer_s(self) -> float:
        return self.pack_s + self.wire_s + self.unpack_s

    @property
    def rebuild_s(self) -> float:
        return self.build_s + self.engine_s + self.compile_s

    def parts_ms(self) -> dict[str, float]:
        """The pause's parts on this rank in milliseconds, keyed as the move events log
        them (``pack_ms`` ... ``engine_ms``)."""
        return {
            f"{k}_ms": round(getattr(self, f"{k}_s") * 1e3, 3)
            for k in ("pack", "wire", "unpack", "build", "engine", "compile")
        }

    def to_dict(self) -> dict:
        d = asdict(self)
        d["transfer_s"], d["rebuild_s"] = self.transfer_s, self.rebuild_s
        d["transfers"] = [repr(t) for t in self.transfers]
        return d


def checksum(buf: torch.Tensor) -> list[int]:
    """Row- and column-weighted sums of the buffer's 32-bit words, on its device.

    The words are laid out as rows of ``_ROW`` and summed in 64-bit along each axis (no
    64-bit copy of the buffer is made: two reductions and two tiny weighted sums, so even
    hundreds of MB cost a fraction of a millisecond on a GPU). Weighting rows and columns
    by position catches moved, dropped, zeroed and flipped words, not only changed sums.
    """
    pad = (-buf.numel()) % (4 * _ROW)
    if pad:
        buf = torch.cat([buf, buf.new_zeros(pad)])
    words = buf.view(torch.int32).view(-1, _ROW)
    rows = words.sum(dim=1, dtype=torch.int64)
    cols = words.sum(dim=0, dtype=torch.int64)
    w_rows = torch.arange(rows.numel(), device=buf.device, dtype=torch.int64) % 65521 + 1
    w_cols = torch.arange(_ROW, device=buf.device, dtype=torch.int64) + 1
    sums = torch.stack([rows.sum(), (rows * w_rows).sum(), (cols * w_cols).sum()])
    return sums.tolist()


def pack(tensors: dict[str, torch.Tensor], *, device: torch.device) -> tuple[dict, torch.Tensor]:
    """Tensors as one uint8 buffer plus a JSON-able header (names, dtypes, shapes, offsets).

    Each tensor starts at a multiple of ``_ALIGN`` bytes: ``unpack`` views its bytes as the
    tensor's dtype in place, which needs an offset divisible by the element size (an int64
    BatchNorm counter after a float32 weight of odd length would not be).
    """
    entries, parts, offset = [], [], 0
    for key, t in tensors.items():
        t = t.detach().contiguous()
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        gap = (-offset) % _ALIGN
        if gap:
            parts.append(torch.zeros(gap, dtype=torch.uint8, device=device))
            offset += gap
        entries.append(
            {
                "key": key,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "offset": offset,
                "nbytes": raw.numel(),
                "device": t.device.type,
            }
        )
        parts.append(raw.to(device))
        offset += raw.numel()
    buf = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    return {"entries": entries, "nbytes": offset, "checksum": checksum(buf)}, buf


def unpack(header: dict, buf: torch.Tensor, *, where: str) -> dict[str, torch.Tensor]:
    """Inverse of ``pack``; raises ``MigrationError`` if the bytes do not match the checksum."""
    got = checksum(buf)
    if got != header["checksum"] or buf.numel() != header["nbytes"]:
        raise MigrationError(
            f"{where}: checksum mismatch ({got} != {header['checksum']}, {buf.numel()} of "
            f"{header['nbytes']} bytes); the transfer was corrupted, nothing was installed"
        )
    out = {}
    for e in header["entries"]:
        dtype = getattr(torch, e["dtype"])
        raw = buf[e["offset"] : e["offset"] + e["nbytes"]]
        t = (
            raw.view(dtype).reshape(e["shape"])
            if e["nbytes"]
            else torch.empty(e["shape"], dtype=dtype)
        )
        # AdamW keeps its step counter on the CPU; everything else lives on the stage device.
        out[e["key"]] = t.clone() if e["device"] != "cpu" else t.cpu().clone()
    return out


def _layer_payload(engine: PipelineEngine, names: list[str]) -> dict[str, torch.Tensor]:
    opt = engine.optim_state()
    out: dict[str, torch.Tensor] = {}
    for lname in names:
        layer = engine.module.layers[lname]
        for k, v in layer.state_dict().items():
            out[f"model/{lname}.{k}"] = v
        prefix = f"{lname}."
        for k, v in opt.items():
            if k.startswith(prefix):
                out[f"optim/{k}"] = v
    return out


def _vote(
    *,
    ok: bool,
    where: str,
    problem: str,
    timeout_s: float,
    beat: Heartbeat | None,
    device: torch.device,
    world_size: int,
) -> None:
    """Every rank's verdict on its transfers; raises on all ranks unless all succeeded."""
    if world_size == 1:
        if not ok:
            raise MigrationError(problem)
        return
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    try:
        work = dist.all_reduce(flag, op=dist.ReduceOp.MIN, async_op=True)
        wait_all([work], timeout_s=timeout_s, what="migration vote")
    except Exception as exc:
        dead = beat.dead_peers() if beat is not None else []
        who = (
            ", ".join(f"rank {r} silent for {age:.1f}s" for r, age in dead) or "no peer looks dead"
        )
        raise MigrationError(
            f"{where}: a peer did not finish the migration ({who}); "
            f"cause: {str(exc).splitlines()[0][:200]}"
        ) from exc
    if problem:
        raise MigrationError(problem)
    if int(flag.item()) == 0:
        raise MigrationError(
            f"{where}: another rank's transfer failed its checksum; "
            "nothing was installed on any rank"
        )


def _message(tensors: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
    """``pack``'s header as JSON bytes and its payload, both on ``device``, ready to send."""
    header, buf = pack(tensors, device=device)
    hbytes = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
    return hbytes.to(device), buf


def _exchange(
    outgoing: dict[int, tuple[torch.Tensor, ...]],
    sources: list[int],
    *,
    device: torch.device,
    timeout_s: float,
) -> tuple[dict[int, tuple[dict, torch.Tensor]], int]:
    """Send each peer its (header, payload) message and receive one from each source.

    Two rounds, each one batch of all this rank's sends and receives (which cannot deadlock
    on gloo or NCCL, whatever the pattern): the sizes, then headers and payloads. Returns
    ``{source: (header, payload)}``, not yet checked against the checksum, and the bytes
    received.
    """
    sizes_out = {
        p: torch.tensor([h.numel(), b.numel()], dtype=torch.int64, device=device)
        for p, (h, b) in outgoing.items()
    }
    sizes_in = {p: torch.zeros(2, dtype=torch.int64, device=device) for p in sources}
    ops = [dist.P2POp(dist.isend, t, p) for p, t in sorted(sizes_out.items())]
    ops += [dist.P2POp(dist.irecv, t, p) for p, t in sorted(sizes_in.items())]
    if ops:
        wait_all(dist.batch_isend_irecv(ops), timeout_s=timeout_s, what="size exchange")
    recv = {
        p: (
            torch.empty(int(n[0]), dtype=torch.uint8, device=device),
            torch.empty(int(n[1]), dtype=torch.uint8, device=device),
        )
        for p, n in sizes_in.items()
    }
    ops = [dist.P2POp(dist.isend, t, p) for p, msg in sorted(outgoing.items()) for t in msg]
    ops += [dist.P2POp(dist.irecv, t, p) for p, msg in sorted(recv.items()) for t in msg]
    if ops:
        wait_all(dist.batch_isend_irecv(ops), timeout_s=timeout_s, what="layer transfer")
    got = {p: (json.loads(bytes(h.cpu().numpy()).decode()), b) for p, (h, b) in recv.items()}
    return got, sum(h.numel() + b.numel() for h, b in recv.values())


def warm_links(topo: Topology, *, warm_bytes: int = 0) -> float:
    """Exchange one tiny message between every pair of ranks, once, before training.

    A backend sets up a point-to-point channel on its first use (NCCL builds a communicator
    and its buffers, which takes tens of milliseconds); a migration can pair any two ranks,
    so without this the first repartition between a pair would pay that set-up inside its
    pause. One batch of sends and receives to and from every peer cannot deadlock.
    ``topo``: this rank's place among the ranks to link (their process group must exist).
    ``warm_bytes``: size of a second, layer-sized message (0: the tiny one only).
    Returns the seconds it took.
    """
    if topo.world_size == 1:
        return 0.0
    t0 = time.perf_counter()
    me, n, device, timeout_s = topo.rank, topo.world_size, topo.device, topo.timeout_s
    out = torch.full((1,), me, dtype=torch.int64, device=device)
    inbox = {p: torch.empty(1, dtype=torch.int64, device=device) for p in range(n) if p != me}
    ops = [dist.P2POp(dist.isend, out, p) for p in inbox]
    ops += [dist.P2POp(dist.irecv, t, p) for p, t in inbox.items()]
    wait_all(dist.batch_isend_irecv(ops), timeout_s=timeout_s, what="link warm-up")
    bad = [p for p, t in inbox.items() if int(t.item()) != p]
    if bad:
        raise MigrationError(f"rank {me}: link warm-up got wrong ids from ranks {bad}")
    if warm_bytes > 0:
        # Then one message of a layer's size to every peer through the real path (pack,
        # checksum, two rounds, unpack): large transfers set up their own channels and
        # buffers, and the allocator its blocks, which a tiny message does not.
        msg = _message({"warm": torch.zeros(warm_bytes // 4, device=device)}, device)
        got, _ = _exchange({p: msg for p in inbox}, list(inbox), device=device, timeout_s=timeout_s)
        for p, (header, buf) in got.items():
            unpack(header, buf, where=f"warm-up from {p}")
    return time.perf_counter() - t0


def repartition(
    engine: PipelineEngine,
    new_plan: Plan,
    *,
    timeout_s: float | None = None,
    beat: Heartbeat | None = None,
) -> MigrationStats:
    """Move layers from ``engine.plan`` to ``new_plan`` and rebuild this rank's stage.

    Collective: every rank calls it with the same ``new_plan`` at the same step boundary.
    It is all-or-nothing: after the transfers every rank votes on whether its part arrived
    intact, and no rank installs the new plan unless all of them did. A dead or failing peer
    makes every rank raise ``MigrationError`` (naming the peers that stopped beating when a
    heartbeat is given) instead of training on under a half-moved model.
    """
    old = engine.plan
    # Plans name a stage's place in its pipeline; the wire needs the replica's own ranks.
    me, to_rank = engine.mesh.pp_rank, engine.mesh.global_rank
    new_plan.validate(engine.model, engine.topo.world_size, elastic=True)
    stats = MigrationStats(transfers=diff(old, new_plan))
    out_by_peer: dict[int, list[str]] = {}
    in_by_peer: dict[int, list[str]] = {}
    for t in stats.transfers:
        if t.src == me:
            out_by_peer.setdefault(to_rank(t.dst), []).append(t.name)
        if t.dst == me:
            in_by_peer.setdefault(to_rank(t.src), []).append(t.name)
    where = f"rank {engine.topo.rank} repartitioning {old!r} -> {new_plan!r}"
    received = _transfer(
        engine, out_by_peer, in_by_peer, stats=stats, where=where, timeout_s=timeout_s, beat=beat
    )
    _install(engine, new_plan, received, stats=stats, place=me)
    return stats


def reshape(
    engine: PipelineEngine,
    new_plan: Plan,
    *,
    mesh: Mesh,
    copies: list[Transfer],
    timeout_s: float | None = None,
    beat: Heartbeat | None = None,
) -> MigrationStats:
    """Change the run's data x pipeline shape: ``new_plan`` (``new_plan.dp`` replicas) with
    this rank at its place in ``mesh``, a mesh made at start-up (``init_meshes``).

    ``copies``: the layers each rank lacks under the new shape and where it gets them, by
    global rank (``autodp.copy_plan``); a source keeps what it sends (copies, not moves),
    and drops afterwards what the new shape does not give it. The transfer, checksums and
    all-or-nothing vote are ``repartition``'s. Collective, like ``repartition``.
    """
    me = engine.topo.rank
    new_plan.validate(engine.model, engine.topo.world_size, elastic=True)
    if new_plan.dp != mesh.dp:
        raise ValueError(f"plan of {new_plan.dp} replicas for a mesh of {mesh.dp}")
    stats = MigrationStats(transfers=list(copies))
    out_by_peer: dict[int, list[str]] = {}
    in_by_peer: dict[int, list[str]] = {}
    for t in copies:
        if t.src == me:
            out_by_peer.setdefault(t.dst, []).append(t.name)
        if t.dst == me:
            in_by_peer.setdefault(t.src, []).append(t.name)
    old = engine.plan
    where = (
        f"rank {me} reshaping {old.dp} x {engine.mesh.pp} {old!r} -> {mesh.dp} x {mesh.pp} "
        f"{new_plan!r}"
    )
    received = _transfer(
        engine, out_by_peer, in_by_peer, stats=stats, where=where, timeout_s=timeout_s, beat=beat
    )
    _install(engine, new_plan, received, stats=stats, place=mesh.pp_rank, mesh=mesh)
    return stats


def _transfer(
    engine: PipelineEngine,
    out_by_peer: dict[int, list[str]],
    in_by_peer: dict[int, list[str]],
    *,
    stats: MigrationStats,
    where: str,
    timeout_s: float | None,
    beat: Heartbeat | None,
) -> dict[str, torch.Tensor]:
    """Send each global rank of ``out_by_peer`` its layers' state, receive from each of
    ``in_by_peer``, check every checksum and vote (collective). Returns what arrived, keyed
    ``model/<layer>.<name>`` and ``optim/<layer>.<name>``."""
    dev = engine.topo.device
    timeout_s = engine.topo.timeout_s if timeout_s is None else timeout_s
    t0 = time.perf_counter()
    peers = sorted(set(out_by_peer) | set(in_by_peer))
    try:
        packed = {
            p: _message(_layer_payload(engine, names), dev) for p, names in out_by_peer.items()
        }
        t_packed = time.perf_counter()
        recv, stats.bytes_received = _exchange(
            packed, sorted(in_by_peer), device=dev, timeout_s=timeout_s
        )
    except MigrationError:
        raise
    except Exception as exc:
        dead = beat.dead_peers() if beat is not None else []
        who = "".join(f"; rank {r} silent for {age:.1f}s" for r, age in dead)
        raise MigrationError(
            f"{where}: transfer with peers {peers} failed{who} ({str(exc).splitlines()[0][:200]})"
        ) from exc
    t_wired = time.perf_counter()
    stats.bytes_sent = sum(b.numel() + h.numel() for h, b in packed.values())
    received: dict[str, torch.Tensor] = {}
    problem = ""
    try:
        for p, (header, buf) in recv.items():
            received.update(unpack(header, buf, where=f"{where}, from rank {p}"))
    except MigrationError as exc:
        problem = str(exc)
    _vote(
        ok=not problem,
        where=where,
        problem=problem,
        timeout_s=timeout_s,
        beat=beat,
        device=dev,
        world_size=engine.topo.world_size,
    )
    t1 = time.perf_counter()
    stats.pack_s, stats.wire_s, stats.unpack_s = t_packed - t0, t_wired - t_packed, t1 - t_wired
    return received


def _install(
    engine: PipelineEngine,
    new_plan: Plan,
    received: dict[str, torch.Tensor],
    *,
    stats: MigrationStats,
    place: int,
    mesh: Mesh | None = None,
) -> None:
    """Rebuild this rank (``place`` in its pipeline under ``new_plan``) from the layers it
    kept and those it received."""
    t1 = time.perf_counter()
    dev = engine.topo.device
    # Kept layers are the same module objects (no copy); received ones are built from the
    # model spec and loaded; optimizer state follows every parameter by name.
    # A rank the new plan leaves idle keeps nothing: every layer it held was sent. Under
    # virtual stages a rank holds several ranges; a layer that moves between two of them
    # stays on the rank (the same module object, re-seated in its new virtual stage).
    held = new_plan.layers_of_rank(place)
    kept_opt = engine.optim_state()
    layers = nn.ModuleDict()
    opt_state: dict[str, torch.Tensor] = {}
    for i in held:
        lname = engine.model.layers[i].name
        if lname in engine.module.layers:
            layers[lname] = engine.module.layers[lname]
            opt_state.update({k: v for k, v in kept_opt.items() if k.startswith(lname + ".")})
        else:
            # Built without initialisation: every parameter and buffer is loaded next.
            layer = engine.model.build_layer(i, device=dev, init=False)
            prefix = f"model/{lname}."
            layer.load_state_dict(
                {k[len(prefix) :]: v for k, v in received.items() if k.startswith(prefix)}
            )
            layers[lname] = layer
            oprefix = f"optim/{lname}."
            opt_state.update(
                {k[len("optim/") :]: v for k, v in received.items() if k.startswith(oprefix)}
            )
    t_built = time.perf_counter()
    engine.rebuild(new_plan, layers=layers, opt_state=opt_state, mesh=mesh)
    t2 = time.perf_counter()
    stats.build_s, stats.engine_s = t_built - t1, t2 - t_built
    stats.compile_s = engine.warm_compiled()
