"""``--compile``: layers compiled one by one with ``torch.compile``, in place.

The unit compiled is the layer, the unit dynpipe times and moves, not the stage:

* The per-layer timers (``timing.LayerProbe``) mark layer boundaries and hook the
  boundary tensors' gradients; each layer's forward and backward is one compiled region
  between two marks, so the marks stay outside compiled code and read what they read
  eagerly. A stage compiled whole would fuse across the boundaries the planner prices.
* A layer that moves to another rank is rebuilt there from the model's spec and compiled
  again; its code is the cached code of its class and shapes. ``torch.compile`` caches by
  code object and guards on the module's structure and tensor shapes, not on its
  identity, so a model's twelve identical blocks compile once between them and a migrated
  block costs a guard check where blocks of its kind already ran.
* A layer is compiled in place (its ``forward`` under ``torch.compile``, as
  ``nn.Module.compile`` does with ``_call_impl``): the layer keeps its class and its parameter
  names, so ``state_dict`` keys, checkpoints and optimizer state by name carry no
  ``_orig_mod.`` prefix.

Every layer of a class shares one code object (its ``forward``), and dynamo
keeps at most ``recompile_limit`` (8) compiled entries per code object before it falls
back to eager without an error: vgg16's sixteen conv and linear shapes would run their
last eight layers eager. ``compile_layers`` raises the limit to what the model needs, and
compiles with static shapes (``dynamic=False``): each layer's shapes are fixed for a run,
and the automatic dynamic shapes dynamo turns on after a second shape would give every
conv after the first symbolic-shape kernels.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch import nn

from dynpipe.errors import UserError

__all__ = ["check_backend", "compile_layers", "is_compiled", "raise_recompile_limit"]


def check_backend(backend: str) -> None:
    """Refuse, in one line, a torch without ``torch.compile`` or an unknown backend."""
    if not hasattr(torch, "compile") or not hasattr(nn.Module, "compile"):
        raise UserError(
            f"--compile needs torch.compile and nn.Module.compile (torch >= 2.2); this torch "
            f"is {torch.__version__}: install a newer torch or run without --compile"
        )
    from torch._dynamo import list_backends

    if backend not in list_backends(exclude_tags=()):
        # The usual ones; debugging backends are accepted but not listed.
        usual = sorted({*list_backends(), "aot_eager", "eager"})
        raise UserError(
            f"unknown --compile-backend {backend!r}; use one of {', '.join(usual)} "
            "(inductor on GPUs; aot_eager runs anywhere without a C++ compiler)"
        )


def raise_recompile_limit(*, entries: int) -> None:
    """Let dynamo keep at least ``entries`` compiled variants per code object (see the
    module docstring); never lowers a limit the user set higher."""
    import torch._dynamo.config as dcfg

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dcfg, name) and getattr(dcfg, name) < entries:
            setattr(dcfg, name, entries)
    if hasattr(dcfg, "accumulated_recompile_limit"):
        dcfg.accumulated_recompile_limit = max(dcfg.accumulated_recompile_limit, 4 * entries)


def is_compiled(layer: nn.Module) -> bool:
    """Whether ``layer`` was compiled in place (``nn.Module.compile``)."""
    return getattr(layer, "_compiled_call_impl", None) is not None


def compile_layers(layers: Iterable[nn.Module], *, backend: str, model_layers: int) -> float:
    """Compile each of ``layers`` in place that is not compiled yet, for a model of
    ``model_layers`` layers; returns the seconds it took (compilation itself happens at
    each layer's first call: this only wraps them)."""
    t0 = time.perf_counter()
    # Per layer: training and evaluation, and an input that arrives from another stage in
    # the wire dtype or from the layer before in the stage's compute dtype.
    raise_recompile_limit(entries=4 * model_layers + 16)
    for layer in layers:
        if not is_compiled(layer):
            # What ``nn.Module.compile`` does, with the layer's ``forward`` as the compiled
            # function instead of ``Module._call_impl``: on torch 2.13 (CPU build) dynamo
            # captured no graph from ``_call_impl`` and the layer silently ran eager, while
            # ``forward`` compiles on every torch tested (2.11, 2.13, 2.14). Module hooks do
            # not run inside; dynpipe registers none on layers.
            layer._compiled_call_impl = torch.compile(layer.forward, backend=backend, dynamic=False)
    return time.perf_counter() - t0
