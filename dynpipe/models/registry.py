"""The zoo's registry: model factories by name.

Kept apart from ``dynpipe.models`` so the zoo modules can register themselves without
importing the package that loads them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from dynpipe.models.base import LayeredModel

__all__ = ["ZOO", "register"]

ZOO: dict[str, Callable[..., LayeredModel]] = OrderedDict()


def register(name: str) -> Callable[[Callable[..., LayeredModel]], Callable[..., LayeredModel]]:
    """Decorator adding a factory to the zoo under ``name``."""

    def wrap(factory: Callable[..., LayeredModel]) -> Callable[..., LayeredModel]:
        ZOO[name] = factory
        return factory

    return wrap
