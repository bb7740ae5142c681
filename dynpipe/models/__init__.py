"""The model zoo: layered models with stable layer names (see ``base``)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dynpipe.errors import UserError
from dynpipe.models.base import InputSpec, LayeredModel, LayerSpec, layer_seed, run_layers
from dynpipe.models.registry import ZOO, register

__all__ = [
    "ZOO",
    "InputSpec",
    "LayerSpec",
    "LayeredModel",
    "get_model",
    "layer_seed",
    "load_zoo",
    "register",
    "run_layers",
]

# Each registers its models with ``registry.register`` when imported.
_ZOO_MODULES = (
    "dynpipe.models.vgg",
    "dynpipe.models.resnet",
    "dynpipe.models.gpt",
    "dynpipe.models.bert",
)
_ZOO_LOADED = False


def load_zoo() -> None:
    """Import every zoo module, so ``ZOO`` names every model (cheap after the first call)."""
    # Imported lazily so ``import dynpipe.models`` stays cheap. A flag, not ``if ZOO``:
    # importing one zoo module directly registers it early and must not stop the others
    # from loading.
    global _ZOO_LOADED
    if _ZOO_LOADED:
        return
    _ZOO_LOADED = True
    from dynpipe.models.mlp import mlp

    ZOO["mlp"] = mlp
    for mod in _ZOO_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:  # a zoo module not written yet must not break others
            if exc.name != mod:
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

    def build() -> nn.Module:
        module = copy.deepcopy(child)
        # ``build_layer(device="meta")`` builds under a meta default device; a copy of an
        # already-built child would otherwise keep real CPU weights there.
        if torch.get_default_device().type == "meta":
            module = module.to("meta")
        return module

    return build


def _call_user_factory(factory: Callable[..., Any], config: dict[str, Any]) -> Any:
    # A user's factory initialises its weights from the global RNG: seed it from the model
    # seed so every rank builds identical weights, without disturbing the caller's RNG.
    # ``seed`` is passed on only to factories that accept it.
    seed = int(config.get("seed", 0))
    params = inspect.signature(factory).parameters
    takes_seed = "seed" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )
    kwargs = config if takes_seed else {k: v for k, v in config.items() if k != "seed"}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory(**kwargs)


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
            raise UserError(
                f"cannot load model factory {name!r}: {exc}; give it as package.module:function "
                "importable from the current directory or PYTHONPATH"
            ) from None
        made = _call_user_factory(factory, config)
        if isinstance(made, LayeredModel):
            return made
        if isinstance(made, nn.Sequential):
            return _from_sequential(attr, made, int(config.get("seed", 0)))
        raise TypeError(
            f"model factory {name!r} returned {type(made).__name__}; return an nn.Sequential "
            "or a dynpipe.models.LayeredModel"
        )
    load_zoo()
    if name not in ZOO:
        raise UserError(
            f"unknown model {name!r}; choose one of {', '.join(ZOO)} "
            "or give your own as package.module:factory (see `dynpipe models`)"
        )
    return ZOO[name](**config)
