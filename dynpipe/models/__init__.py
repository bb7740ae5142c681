"""The model zoo: layered models with stable layer names (see ``base``)."""

from __future__ import annotations

import importlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch import nn

from dynpipe.models.base import InputSpec, LayeredModel, LayerSpec, layer_seed, run_layers

__all__ = [
    "InputSpec",
    "LayerSpec",
    "LayeredModel",
    "ZOO",
    "get_model",
    "layer_seed",
    "register",
    "run_layers",
]

ZOO: dict[str, Callable[..., LayeredModel]] = OrderedDict()


def register(name: str) -> Callable[[Callable[..., LayeredModel]], Callable[..., LayeredModel]]:
    """Decorator adding a factory to the zoo under ``name``."""

    def wrap(factory: Callable[..., LayeredModel]) -> Callable[..., LayeredModel]:
        ZOO[name] = factory
        return factory

    return wrap


def _load_zoo() -> None:
    # Imported lazily so ``import dynpipe.models`` stays cheap; each module registers itself.
    if ZOO:
        return
    from dynpipe.models.mlp import mlp

    ZOO["mlp"] = mlp
    for mod in ("vgg", "resnet", "gpt", "bert"):
        try:
            importlib.import_module(f"dynpipe.models.{mod}")
        except ModuleNotFoundError as exc:  # a zoo module not written yet must not break others
            if exc.name != f"dynpipe.models.{mod}":
                raise


def _from_sequential(name: str, seq: nn.Sequential, seed: int) -> LayeredModel:
    children = list(seq.named_children())
    specs = []
    for i, (child_name, child) in enumerate(children):
        safe = child_name if child_name.isidentifier() else f"layer{i:03d}"
        # A user's Sequential is already built: every rank builds the same one from the same
        # factory and seed, so layer i is taken from a fresh copy rather than re-initialised.
        specs.append(LayerSpec(safe, type(child).__name__.lower(), _child_builder(child)))
    return LayeredModel(
        name=name,
        layers=tuple(specs),
        loss_fn=nn.functional.cross_entropy,
        input_spec=getattr(seq, "input_spec", InputSpec(shape=(0,))),
        seed=seed,
    )


def _child_builder(child: nn.Module) -> Callable[[], nn.Module]:
    import copy

    return lambda: copy.deepcopy(child)


def get_model(name: str, **config: Any) -> LayeredModel:
    """A zoo model by name, or a user factory given as ``package.module:factory``.

    The factory returns a ``LayeredModel`` or an ``nn.Sequential`` (whose children become
    the layers; give it an ``input_spec`` attribute so data and shapes can be inferred).
    """
    if ":" in name:
        mod_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(mod_name), attr)
        except (ModuleNotFoundError, AttributeError) as exc:
            raise ValueError(
                f"cannot load model factory {name!r}: {exc}; give it as package.module:function "
                "importable from the current directory or PYTHONPATH"
            ) from None
        made = factory(**config)
        if isinstance(made, LayeredModel):
            return made
        if isinstance(made, nn.Sequential):
            return _from_sequential(attr, made, int(config.get("seed", 0)))
        raise TypeError(
            f"model factory {name!r} returned {type(made).__name__}; return an nn.Sequential "
            "or a dynpipe.models.LayeredModel"
        )
    _load_zoo()
    if name not in ZOO:
        raise ValueError(
            f"unknown model {name!r}; choose one of {', '.join(ZOO)} "
            "or give your own as package.module:factory (see `dynpipe models`)"
        )
    return ZOO[name](**config)
