"""Command-line flags made from config dataclasses: one source of names, types and defaults.

Every field of a config dataclass becomes a flag: ``--field-name`` (or a name given by the
caller), its type from the annotation, its default from the dataclass (or from a default
instance), its help from the field's ``metadata["help"]`` or else the class docstring's
``name: text`` entry, and its choices from ``metadata["choices"]``. A field added to the
dataclass appears on the command line with no other change; a default changed there changes
the flag's.

    g = parser.add_argument_group("optimisation")
    add_config_args(g, OptimConfig, flags={"name": "--optimizer"}, exclude=("total_steps",))
    ...
    optim = OptimConfig(**config_kwargs(args, OptimConfig), total_steps=args.steps)

Booleans become switches: ``--name`` for a field that defaults to False, ``--no-name`` for
one that defaults to True (its help reads "turn off <the field's help>", so document such a
field as a noun phrase). Optional fields (``int | None``) take the inner type; tuples of a
fixed length take that many values. Other types (dicts, nested configs) are refused unless
excluded: the caller gives those their own flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["add_config_args", "config_kwargs", "field_help"]

_ENTRY = re.compile(r"^([A-Za-z_]\w*(?:\s*/\s*[A-Za-z_]\w*)*):\s+(.*)$")


def field_help(cls: type) -> dict[str, str]:
    """Each field's help: ``metadata["help"]``, else its entry in the class docstring.

    A docstring entry is a line ``name: text`` (or ``a / b: text`` for several fields)
    starting at the docstring's own indentation, continued by the more indented lines after
    it; double backticks are dropped.
    """
    entries: dict[str, list[str]] = {}
    current: list[list[str]] = []
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()[1:]
    for line in lines:
        m = _ENTRY.match(line)
        if m:
            current = []
            for name in m.group(1).split("/"):
                entries[name.strip()] = [m.group(2)]
                current.append(entries[name.strip()])
        elif line.startswith((" ", "\t")) and line.strip():
            for text in current:
                text.append(line.strip())
        else:
            current = []
    out = {}
    for f in dataclasses.fields(cls):
        text = f.metadata.get("help") or " ".join(entries.get(f.name, []))
        out[f.name] = text.replace("``", "")
    return out


def _dest(cls: type, name: str) -> str:
    # One namespace per dataclass, so two configs may share a field name (``schedule``).
    return f"{cls.__name__}.{name}"


def _default(f: dataclasses.Field, defaults: object | None) -> Any:
    # A field declared None is resolved by its config from the others (OptimConfig.lr from
    # the optimizer): an instance's resolved value as the flag's default would pin it
    # (``--optimizer sgd`` would train at AdamW's rate).
    if defaults is not None and f.default is not None:
        return getattr(defaults, f.name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _flag_type(cls: type, name: str, hint: Any) -> tuple[type, int | None]:
    """(the type one value is parsed with, how many values a tuple takes or None)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _flag_type(cls, name, inner[0])
    elif origin is tuple and args and Ellipsis not in args and len(set(args)) == 1:
        item, _ = _flag_type(cls, name, args[0])
        return item, len(args)
    elif hint in (int, float, str, bool):
        return hint, None
    raise TypeError(
        f"{cls.__name__}.{name} has type {hint!r}, which has no command-line form; "
        "exclude it and give it a flag of its own"
    )


def add_config_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    fields: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    flags: Mapping[str, str] | None = None,
    defaults: object | None = None,
    unset: bool = False,
) -> list[str]:
    """Add a flag for each field of the dataclass ``cls``; returns the flags added.

    fields: only these, in this order (default: every field, in declaration order).
    exclude: fields that get no flag (the caller sets them).
    flags: flag names that differ from ``--field-name``; naming a field ``cls`` does not
        have is an error, so a renamed field cannot silently lose its flag.
    defaults: an instance whose values are the defaults (a nested config's default in its
        parent may differ from the class's own).
    unset: every flag defaults to None, so the caller can tell what was given (to lay it
        over another config).
    """
    names = [f.name for f in dataclasses.fields(cls)]
    flags = dict(flags or {})
    unknown = sorted({*flags, *exclude, *(fields or ())} - set(names))
    if unknown:
        raise ValueError(f"{cls.__name__} has no fields {unknown}; it has {names}")
    hints = typing.get_type_hints(cls)
    helps = field_help(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    skip = set(exclude)
    added = []
    for name in fields if fields is not None else names:
        if name in skip:
            continue
        f = by_name[name]
        kind, nargs = _flag_type(cls, name, hints[name])
        default = _default(f, defaults)
        text = helps[name].replace("%", "%%").rstrip(".")
        kw: dict[str, Any] = {"dest": _dest(cls, name), "default": None if unset else default}
        flag = flags.get(name, "--" + name.replace("_", "-"))
        if kind is bool:
            on = bool(default)
            if on and name not in flags:
                flag = "--no-" + name.replace("_", "-")
            kw["action"] = "store_false" if on else "store_true"
            if on:
                text = f"turn off {text}" if text else "turn it off (on by default)"
        else:
            kw["type"] = kind
            kw["metavar"] = f.metadata.get("metavar", flag.lstrip("-").replace("-", "_").upper())
            if nargs is not None:
                kw["nargs"] = nargs
            choices: Sequence[Any] | None = f.metadata.get("choices")
            if choices is not None:
                kw["choices"] = tuple(choices)
                del kw["metavar"]
            if default is not None and not unset:
                text = f"{text} (default: %(default)s)".strip()
            elif unset:
                text = f"{text} (default: unchanged)".strip()
        parser.add_argument(flag, help=text, **kw)
        added.append(flag)
    return added


def config_kwargs(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The values of the flags ``add_config_args`` added for ``cls``, by field name
    (tuples as tuples)."""
    out = {}
    for f in dataclasses.fields(cls):
        dest = _dest(cls, f.name)
        if hasattr(args, dest):
            value = getattr(args, dest)
            out[f.name] = tuple(value) if isinstance(value, list) else value
    return out
