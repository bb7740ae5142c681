"""``--set [MODEL.]KEY=VALUE`` settings of ``dynpipe profile``, applied to its models.

Kept apart from the command line so that what a profile's metadata says it ran (its command
line) can be rebuilt without importing the command line (``dynpipe.profiler.work``).
"""

from __future__ import annotations

import ast
import inspect
from typing import Any

from dynpipe.errors import UserError

__all__ = ["model_configs"]


def _value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def model_configs(names: list[str], *, overrides: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """Apply ``--set [MODEL.]KEY=VALUE`` to the models that take that keyword."""
    from dynpipe.models import ZOO, load_zoo

    load_zoo()
    configs: dict[str, dict[str, Any]] = {n: {} for n in names}
    for item in overrides:
        key, sep, val = item.partition("=")
        if not sep:
            raise UserError(f"--set {item!r}: write KEY=VALUE or MODEL.KEY=VALUE, e.g. depth=4")
        target, _, key = key.rpartition(".") if "." in key else ("", "", key)
        hits = []
        for name in names:
            if target and target != name:
                continue
            factory = ZOO.get(name)
            params = inspect.signature(factory).parameters if factory else {}
            if factory is None or key in params:
                configs[name][key] = _value(val)
                hits.append(name)
        if not hits:
            raise UserError(
                f"--set {item!r}: none of the models {', '.join(names)} takes {key!r}; "
                "see `dynpipe models --model NAME`"
            )
    return [(n, configs[n]) for n in names]
