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
from dynpipe.models.cut import from_module
from dynpipe.models.registry import ZOO, register

__all__ = [
    "ZOO",
    "InputSpec",
    "LayerSpec",
    "LayeredModel",
    "from_module",
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
# ``--model PREFIX:SPEC`` for models of other libraries: module and factory (imported lazily:
# transformers alone takes seconds to import).
_ADAPTERS = {"hf": ("dynpipe.models.hf", "hf_model"), "tv": ("dynpipe.models.tv", "tv_model")}


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


def _settings(config: dict[str, Any]) -> str:
    return " ".join(f"{k}={v!r}" for k, v in config.items() if k != "seed") or "its defaults"


def _check_config(name: str, factory: Callable[..., Any], config: dict[str, Any]) -> None:
    """Refuse settings the factory does not take, and values whose type differs from the
    setting's default (``depth=abc`` for an int), in one line naming the setting."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return  # a builtin or C factory: nothing to check against
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        takes = [
            n
            for n, p in params.items()
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        ]
        unknown = [k for k in config if k not in params and k != "seed"]
        if unknown:
            raise UserError(
                f"model {name} has no setting {unknown[0]!r}; it takes "
                f"{', '.join(t for t in takes if t != 'seed') or 'no settings'}"
            )
    for key, value in config.items():
        p = params.get(key)
        if p is None or p.default is inspect.Parameter.empty or p.default is None:
            continue
        want = type(p.default)
        if want is bool:
            ok = isinstance(value, bool)
        elif want is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif want is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif want in (str, tuple, list):
            ok = isinstance(value, (tuple, list) if want is not str else str)
        else:
            continue
        if not ok:
            kind = {bool: "True or False", int: "an integer", float: "a number"}.get(
                want, "a string" if want is str else "a list"
            )
            raise UserError(
                f"model {name} setting {key} takes {kind} (its default is {p.default!r}), got "
                f"{value!r}; e.g. {key}={p.default!r}"
            )


def get_model(name: str, **config: Any) -> LayeredModel:
    """A zoo model by name, or a user factory given as ``package.module:factory``.

    The factory returns a ``LayeredModel`` or an ``nn.Sequential`` (whose children become
    the layers; give it an ``input_spec`` attribute so data and shapes can be inferred).
    Unknown settings, values of the wrong type and values the factory rejects (``depth=0``)
    raise ``UserError``.
    """
    prefix, _, rest = name.partition(":")
    if prefix in _ADAPTERS and rest:
        adapter = importlib.import_module(_ADAPTERS[prefix][0])
        return getattr(adapter, _ADAPTERS[prefix][1])(rest, **config)
    if ":" in name:
        mod_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(mod_name), attr)
        except (ModuleNotFoundError, AttributeError) as exc:
            raise UserError(
                f"cannot load model factory {name!r}: {exc}; give it as package.module:function "
                "importable from the current directory or PYTHONPATH"
            ) from None
        if not callable(factory):
            raise UserError(f"model factory {name!r} is a {type(factory).__name__}, not a function")
        _check_config(name, factory, config)
        try:
            made = _call_user_factory(factory, config)
            if isinstance(made, nn.Sequential):
                made = _from_sequential(attr, made, int(config.get("seed", 0)))
        except (TypeError, ValueError) as exc:
            raise UserError(f"cannot build model {name} with {_settings(config)}: {exc}") from None
        if isinstance(made, LayeredModel):
            return made
        raise UserError(
            f"model factory {name!r} returned {type(made).__name__}; return an nn.Sequential "
            "or a dynpipe.models.LayeredModel"
        )
    load_zoo()
    if name not in ZOO:
        raise UserError(
            f"unknown model {name!r}; choose one of {', '.join(ZOO)} "
            "or give your own as package.module:factory (see `dynpipe models`)"
        )
    _check_config(name, ZOO[name], config)
    try:
        return ZOO[name](**config)
    except (TypeError, ValueError) as exc:
        raise UserError(f"cannot build model {name} with {_settings(config)}: {exc}") from None
