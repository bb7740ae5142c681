"""The layered-model type: what a model *is*, never how it is parallelised.

A model is an ordered list of named layers plus a loss and an input spec. Each layer is
built from its spec alone, so any rank can build a layer it has never held and then
receive its weights. Initialisation is a pure function of ``(model seed, layer index)``:
every rank, and a single-process reference, agree on every initial weight.
"""

from __future__ import annotations

import re
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "InputSpec",
    "LayerSpec",
    "LayeredModel",
    "layer_seed",
    "run_layers",
]

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def layer_seed(model_seed: int, index: int) -> int:
    """Seed for building layer ``index``: independent of which rank builds it."""
    return (model_seed * 1_000_003 + index * 7919 + 17) % (2**63 - 1)


@dataclass(frozen=True)
class InputSpec:
    """Per-sample shapes and dtypes of a model's input and target.

    ``vocab`` is set for token inputs (``dtype=torch.long``): values are in ``[0, vocab)``.
    ``num_classes`` is set for class-index targets.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    target_shape: tuple[int, ...] = ()
    target_dtype: torch.dtype = torch.long
    vocab: int | None = None
    num_classes: int | None = None

    def example(
        self, batch_size: int, *, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero/random tensors of the right shape (for shape inference and profiling)."""
        dev = torch.device(device)
        shape = (batch_size, *self.shape)
        tshape = (batch_size, *self.target_shape)
        if dev.type == "meta":
            return (
                torch.empty(shape, dtype=self.dtype, device=dev),
                torch.empty(tshape, dtype=self.target_dtype, device=dev),
            )
        if self.dtype.is_floating_point:
            x = torch.randn(shape, dtype=self.dtype, device=dev)
        else:
            x = torch.randint(0, self.vocab or 2, shape, dtype=self.dtype, device=dev)
        if self.target_dtype.is_floating_point:
            y = torch.randn(tshape, dtype=self.target_dtype, device=dev)
        else:
            high = self.num_classes or self.vocab or 2
            y = torch.randint(0, high, tshape, dtype=self.target_dtype, device=dev)
        return x, y


@dataclass(frozen=True)
class LayerSpec:
    """One pipeline-placeable layer: a stable name, a kind, and how to build it."""

    name: str
    kind: str
    build: Callable[[], nn.Module] = field(repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(
                f"layer name {self.name!r} is not a plain identifier; use letters, digits and "
                "'_' (no dots) so it can key a ModuleDict and a checkpoint"
            )


@dataclass(frozen=True)
class LayeredModel:
    """An ordered list of layers, a loss over the last layer's output, and an input spec.

    ``loss_fn(output, target)`` must reduce with a mean over the microbatch: pipelined
    training divides summed microbatch gradients by the number of microbatches.
    """

    name: str
    layers: tuple[LayerSpec, ...]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = field(repr=False, compare=False)
    input_spec: InputSpec
    seed: int = 0
    config: dict = field(default_factory=dict, compare=False)
    # Groups of parameters ("<layer>.<param>") that are one parameter of the source model
    # (a tied embedding and output projection): each owning layer holds a copy and training
    # sums their gradients so the copies stay equal. The first name is the primary copy.
    ties: tuple[tuple[str, ...], ...] = ()
    # trace_shapes results by batch size: a rebuild asks for them again under every new plan.
    _shapes: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"model {self.name!r} has no layers")
        seen: set[str] = set()
        for spec in self.layers:
            if spec.name in seen:
                raise ValueError(f"model {self.name!r} repeats layer name {spec.name!r}")
            seen.add(spec.name)
        for group in self.ties:
            for pname in group:
                if pname.partition(".")[0] not in seen:
                    raise ValueError(
                        f"model {self.name!r} ties {pname!r} but has no layer "
                        f"{pname.partition('.')[0]!r}"
                    )

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def layer_names(self) -> list[str]:
        return [s.name for s in self.layers]

    def index(self, name: str) -> int:
        for i, spec in enumerate(self.layers):
            if spec.name == name:
                return i
        raise KeyError(f"model {self.name!r} has no layer {name!r}")

    def build_layer(
        self, index: int, *, device: torch.device | str = "cpu", init: bool = True
    ) -> nn.Module:
        """Build layer ``index`` with this model's deterministic initialisation.

        Weights are always initialised on the CPU under a forked RNG seeded from
        ``(seed, index)`` and then moved, so a CPU and a GPU rank agree bit for bit.
        On ``meta`` the layer is built without memory (shapes and FLOPs only).

        ``init=False`` is for a layer whose parameters and buffers are about to be loaded
        (a migrated layer): it skips the CPU initialisation, which for a large layer costs
        far more than the move itself (seconds for VGG's fc6). Its state-dict entries hold
        arbitrary values until loaded; non-persistent buffers, which a state dict does not
        carry, are still computed by the layer's constructor.
        """
        spec = self.layers[index]
        dev = torch.device(device)
        if dev.type == "meta":
            with torch.device("meta"):
                return spec.build()
        if not init:
            with torch.device("meta"):
                module = spec.build()
            if not _has_nonpersistent_buffers(module):
                return module.to_empty(device=dev)
            with torch.device(dev):  # constructor runs where it is fast; values are loaded
                return spec.build()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(self.seed, index))
            module = spec.build()
        return module.to(dev)

    def build_range(
        self, start: int, stop: int, *, device: torch.device | str = "cpu"
    ) -> nn.ModuleDict:
        """Layers ``[start, stop)`` in a ``ModuleDict`` keyed by their stable names."""
        return nn.ModuleDict(
            {self.layers[i].name: self.build_layer(i, device=device) for i in range(start, stop)}
        )

    def build_sequential(self, *, device: torch.device | str = "cpu") -> nn.Sequential:
        """The unsplit model (single-process reference, profiling)."""
        return nn.Sequential(OrderedDict(self.build_range(0, len(self), device=device).items()))

    def trace_shapes(self, batch_size: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Output shape and dtype of every layer for a batch of ``batch_size`` (on ``meta``).

        Entry ``i`` is what layer ``i`` hands to layer ``i + 1``: the activation that
        crosses a stage boundary placed after layer ``i``.
        """
        if batch_size in self._shapes:
            return list(self._shapes[batch_size])
        x, _ = self.input_spec.example(batch_size, device="meta")
        out: list[tuple[tuple[int, ...], torch.dtype]] = []
        with torch.no_grad():
            for i in range(len(self)):
                x = self.build_layer(i, device="meta")(x)
                out.append((tuple(x.shape), x.dtype))
        self._shapes[batch_size] = tuple(out)
        return out

    def fingerprint(self) -> str:
        """Short stable id of the layer list (names and kinds), for plans and checkpoints."""
        text = ";".join(f"{s.name}:{s.kind}" for s in self.layers)
        return f"{zlib.crc32(text.encode()):08x}"


def _has_nonpersistent_buffers(module: nn.Module) -> bool:
    return any(m._non_persistent_buffers_set for m in module.modules())


def run_layers(layers: nn.ModuleDict | Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """Apply layers in order (the forward of a stage or of the whole model)."""
    mods = layers.values() if isinstance(layers, nn.ModuleDict) else layers
    for m in mods:
        x = m(x)
    return x
