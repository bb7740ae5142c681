"""Cut an existing ``nn.Module`` into a layered model at block boundaries.

A module whose forward is *embeddings -> a ModuleList of blocks -> head* (nearly every
transformer, and the stage-by-stage CNNs) becomes a ``LayeredModel`` with one layer for
the part before the blocks, one per block and one for the part after. Each layer is a
``Part``: a small module that holds submodules of the source under attribute names and
remembers where in the source each came from (``source_paths``), so trained weights map
back to the source's own state-dict names (``source_state``, used by ``dynpipe export``).

Every rank must build identical weights. The source module is made once per process by a
deterministic loader (a seeded fresh init or a file) and cached; building layer ``i``
assembles its ``Part`` from the cached source and deep-copies it, so the layer owns its
tensors and every rank (and the unsplit reference) copies the same values. On the ``meta``
device a second, memory-free copy of the source is used, so shape tracing, planning and
profiling never materialise the whole model.

Parameters that the source shares between two layers (GPT-2's token embedding and its
output projection) become *ties*: each owning layer keeps its own copy and the runtime sums
their gradients every step so the copies stay identical (see ``dynpipe.runtime.ties``).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dynpipe.errors import UserError
from dynpipe.models.base import InputSpec, LayeredModel, LayerSpec

__all__ = [
    "Part",
    "SequentialPart",
    "SourceCache",
    "cut_model_meta",
    "find_ties",
    "from_module",
    "layered_from_source",
    "source_state",
]


class Part(nn.Module):
    """One layer made of submodules of a source module.

    ``paths`` maps an attribute name of this part to a dotted path in the source
    (``{"wte": "transformer.wte"}``). Subclasses define ``forward``.
    """

    def __init__(self, source: nn.Module, paths: dict[str, str]) -> None:
        super().__init__()
        self.source_paths = dict(paths)
        for attr, path in paths.items():
            self.add_module(attr, _submodule(source, path))


class SequentialPart(Part):
    """Its submodules applied in order; a tuple output (HF blocks) passes on its first item.

    The output is made contiguous (free when it already is): a transposed view, which
    attention layers return, cannot be sent to the next stage.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for mod in self.children():
            x = mod(x)
            if isinstance(x, tuple):
                x = x[0]
        return x.contiguous()


class SourceCache:
    """The source module, loaded at most once per process per device kind (real or meta).

    ``load(device)`` is called with ``"cpu"`` or ``"meta"`` and must give the same module
    every time it is called with ``"cpu"`` (seeded init or weights from a file).
    """

    def __init__(self, load: Callable[[str], nn.Module]) -> None:
        self._load = load
        self._held: dict[str, nn.Module] = {}
        self._lock = threading.Lock()

    def get(self, kind: str) -> nn.Module:
        with self._lock:
            if kind not in self._held:
                module = self._load(kind)
                module.requires_grad_(True)
                self._held[kind] = module
            return self._held[kind]

    def current(self) -> nn.Module:
        """The source for the device layers are being built on now (meta or real)."""
        return self.get("meta" if torch.get_default_device().type == "meta" else "cpu")


def _submodule(source: nn.Module, path: str) -> nn.Module:
    try:
        return source.get_submodule(path)
    except AttributeError:
        raise UserError(
            f"{type(source).__name__} has no submodule {path!r}; name the module by its "
            "dotted path as printed by print(model) (e.g. model.layers)"
        ) from None


def _builder(cache: SourceCache, make: Callable[[nn.Module], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        dev = torch.get_default_device()
        # The part shares tensors with the cached source: the deep copy makes them this
        # layer's own (and a tie's two owners separate copies).
        part = copy.deepcopy(make(cache.current()))
        if dev.type != "cpu":
            part = part.to(dev)
        return part

    return build


def find_ties(parts: Sequence[tuple[str, nn.Module]]) -> tuple[tuple[str, ...], ...]:
    """Parameters that appear in more than one part, as groups of ``"<layer>.<param>"``.

    Within one part a shared parameter stays shared (a deep copy keeps it one tensor).
    """
    owners: dict[int, list[str]] = {}
    for lname, part in parts:
        for pname, p in part.named_parameters():
            owners.setdefault(id(p), []).append(f"{lname}.{pname}")
    return tuple(tuple(names) for names in owners.values() if len(names) > 1)


def layered_from_source(
    *,
    name: str,
    cache: SourceCache,
    pieces: Sequence[tuple[str, str, Callable[[nn.Module], nn.Module]]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    input_spec: InputSpec,
    seed: int = 0,
    config: dict[str, Any] | None = None,
) -> LayeredModel:
    """A layered model whose layer ``i`` is ``pieces[i] = (name, kind, make)``.

    ``make(source)`` assembles the layer from the (cached) source module; it must return a
    ``Part``. Ties and the layers' source paths are read from a meta build.
    """
    meta = cache.get("meta")
    made = [(lname, make(meta)) for lname, _, make in pieces]
    for lname, part in made:
        if not isinstance(part, Part):
            raise TypeError(f"layer {lname} was assembled as {type(part).__name__}, not a Part")
    specs = tuple(LayerSpec(lname, kind, _builder(cache, make)) for lname, kind, make in pieces)
    conf = dict(config or {})
    conf["source_paths"] = {lname: dict(part.source_paths) for lname, part in made}
    return LayeredModel(
        name=name,
        layers=specs,
        loss_fn=loss_fn,
        input_spec=input_spec,
        seed=seed,
        config=conf,
        ties=find_ties(made),
    )


def source_state(model: LayeredModel, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layered model's state (``"<layer>.<attr>.<rest>"``) under the source's own names.

    Both copies of a tied parameter map to their own source names (which the source
    shares); the runtime keeps them identical.
    """
    paths = model.config.get("source_paths")
    if not paths:
        raise UserError(
            f"model {model.name} was not cut from a source module; only models loaded with "
            "hf:, tv: or dynpipe.models.from_module can be exported"
        )
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        lname, _, rest = key.partition(".")
        attr, _, tail = rest.partition(".")
        if lname not in paths or attr not in paths[lname]:
            continue  # extra modules a part holds of its own (none carry weights of the source)
        # A parameter held by the part itself (ViT's class token) maps to its own path.
        out[f"{paths[lname][attr]}.{tail}" if tail else paths[lname][attr]] = value
    return out


def cut_model_meta(model: LayeredModel) -> dict[str, Any]:
    """``{"model_config": ...}`` for a checkpoint of a model loaded by name with ``hf:`` or
    ``tv:`` (what ``dynpipe export`` rebuilds it from); ``{}`` for any other model."""
    conf = model.config
    if "source_paths" not in conf or "source" not in conf:
        return {}
    return {"model_config": conf}


def _resolve(source: nn.Module, items: Sequence[str | nn.Module], what: str) -> dict[str, Any]:
    resolved: dict[str, Any] = {}
    for i, item in enumerate(items):
        if isinstance(item, str):
            resolved[item.replace(".", "_")] = item
        elif isinstance(item, nn.Module):
            resolved[f"{what}{i}"] = item
        else:
            raise UserError(
                f"{what}[{i}] is a {type(item).__name__}; give a dotted submodule path or an "
                "nn.Module"
            )
    return resolved


def _seq_maker(
    items: dict[str, Any],
) -> Callable[[nn.Module], nn.Module]:
    paths = {a: p for a, p in items.items() if isinstance(p, str)}

    def make(source: nn.Module) -> nn.Module:
        part = SequentialPart(source, {})
        part.source_paths = dict(paths)
        for attr, item in items.items():  # in the order given: forward runs children in order
            part.add_module(attr, _submodule(source, item) if isinstance(item, str) else item)
        return part

    return make


def from_module(
    module: nn.Module,
    *,
    blocks: str,
    before: Sequence[str | nn.Module] = (),
    after: Sequence[str | nn.Module] = (),
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy,
    input_spec: InputSpec,
    name: str = "module",
    seed: int = 0,
) -> LayeredModel:
    """A layered model cut from ``module``: ``embed`` (the ``before`` modules in order),
    ``block00`` ... (each module of the ``blocks`` ModuleList) and ``head`` (``after``).

    before / after: dotted submodule paths of ``module`` (``"transformer.wte"``) or extra
        modules (a ``nn.Module`` such as a reshape), applied in the order given; a block that
        returns a tuple passes on its first item. Each layer takes one tensor and returns
        one tensor.
    loss: ``loss(output, target)`` reduced with a mean over the microbatch.
    input_spec: per-sample input and target shapes (``dynpipe.models.InputSpec``).

    Every rank must build ``module`` identically (the same factory under the same seed);
    each layer deep-copies its part of it. Parameters shared between layers become ties.
    """
    try:
        seq = module.get_submodule(blocks)
    except AttributeError:
        children = ", ".join(n for n, _ in module.named_children()) or "none"
        raise UserError(
            f"{type(module).__name__} has no submodule {blocks!r} holding its blocks (its "
            f"children: {children}); pass blocks= the dotted path of its ModuleList"
        ) from None
    if not isinstance(seq, nn.ModuleList | nn.Sequential) or len(seq) == 0:
        raise UserError(
            f"{type(module).__name__}.{blocks} is a {type(seq).__name__} with no blocks; pass "
            "blocks= the dotted path of the non-empty ModuleList of its blocks"
        )
    module = module.cpu()
    # The module is already built: meta layers are copied from it too (``Module.to("meta")``
    # would untie shared parameters, which is how ties are found).
    cache = SourceCache(lambda kind: module)
    pieces: list[tuple[str, str, Callable[[nn.Module], nn.Module]]] = []
    if before:
        pieces.append(("embed", "embedding", _seq_maker(_resolve(module, before, "before"))))
    width = max(2, len(str(len(seq) - 1)))
    for i in range(len(seq)):
        pieces.append(
            (f"block{i:0{width}d}", type(seq[i]).__name__.lower(),
             _seq_maker({"block": f"{blocks}.{i}"}))
        )  # fmt: skip
    if after:
        pieces.append(("head", "head", _seq_maker(_resolve(module, after, "after"))))
    return layered_from_source(
        name=name,
        cache=cache,
        pieces=pieces,
        loss_fn=loss,
        input_spec=input_spec,
        seed=seed,
        config={"blocks": blocks},
    )
