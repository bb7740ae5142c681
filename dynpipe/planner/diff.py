"""``diff(old, new)``: which layers change owner between two plans, as plain data.

The runtime's migration moves exactly these layers (parameters, optimizer state, buffers)
from ``src`` rank to ``dst`` rank; layers that stay are not touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dynpipe.planner.plan import Plan, PlanError

if TYPE_CHECKING:
    from dynpipe.planner.costs import CostModel

__all__ = ["Transfer", "diff", "total_bytes"]


@dataclass(frozen=True)
class Transfer:
    """Layer ``layer`` (named ``name``) moves from rank ``src`` to rank ``dst``.

    ``nbytes``: state it carries (parameters + optimizer state + buffers with a cost model,
    parameters with ``param_bytes``); ``None`` when no sizes were given.
    """

    layer: int
    name: str
    src: int
    dst: int
    nbytes: int | None = None

    def __repr__(self) -> str:
        size = "" if self.nbytes is None else f" {self.nbytes}B"
        return f"{self.name}#{self.layer}:r{self.src}->r{self.dst}{size}"


def _names(old: Plan, new: Plan) -> list[str]:
    names = [""] * new.num_layers
    for plan in (old, new):
        for st in plan.stages:
            for i, nm in zip(range(st.start, st.stop), st.layers, strict=False):
                names[i] = names[i] or nm
    return [nm or f"layer{i}" for i, nm in enumerate(names)]


def diff(
    old: Plan,
    new: Plan,
    *,
    costs: CostModel | None = None,
    param_bytes: Sequence[int] | None = None,
) -> list[Transfer]:
    """Layers whose owner rank differs between ``old`` and ``new``, in layer order."""
    if old.model != new.model or old.num_layers != new.num_layers:
        raise PlanError(
            f"cannot diff a plan of {old.model} ({old.num_layers} layers) against one of "
            f"{new.model} ({new.num_layers} layers); both must be plans of the same model"
        )
    sizes: Sequence[float] | None = None
    if costs is not None:
        if costs.num_layers != new.num_layers:
            raise PlanError(
                f"cost model has {costs.num_layers} layers but the plans have {new.num_layers}"
            )
        sizes = costs.state_bytes.tolist()
    elif param_bytes is not None:
        if len(param_bytes) != new.num_layers:
            raise PlanError(
                f"{len(param_bytes)} parameter sizes for {new.num_layers} layers; give one each"
            )
        sizes = param_bytes
    owner_old = [0] * old.num_layers
    for st in old.stages:
        owner_old[st.start : st.stop] = [st.rank] * len(st)
    names = _names(old, new)
    out = []
    for st in new.stages:
        for i in range(st.start, st.stop):
            if owner_old[i] != st.rank:
                nb = None if sizes is None else int(sizes[i])
                out.append(Transfer(i, names[i], owner_old[i], st.rank, nb))
    return out


def total_bytes(transfers: Sequence[Transfer]) -> int:
    """Bytes all ``transfers`` move (they must carry sizes)."""
    if any(t.nbytes is None for t in transfers):
        raise PlanError("transfers carry no sizes; call diff(..., costs=...) or param_bytes=")
    return sum(int(t.nbytes or 0) for t in transfers)
