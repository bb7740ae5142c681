"""``dynpipe models``: list the model zoo, or show one model layer by layer.

dynpipe models                                  # every zoo model with its size
dynpipe models --model gpt --batch-size 8       # per-layer table: shapes, params, FLOPs
dynpipe models --model gpt --set depth=4 --set width=256
dynpipe models --model pkg.mod:factory          # a user model
"""

from __future__ import annotations

import argparse
import ast
import json
from typing import Any

__all__ = ["format_count", "parse_overrides", "register", "run"]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "models",
        help="list the model zoo or show one model's layers",
        description="List the model zoo, or show one model's layers with shapes, parameters "
        "and FLOPs (computed on the meta device; nothing is allocated).",
    )
    parser.add_argument("--model", metavar="NAME", help="zoo name or package.module:factory")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=1,
        metavar="B",
        help="batch size for shapes and FLOPs (default 1)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="model config override, e.g. --set depth=4",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="parameter and activation dtype for byte counts",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def format_count(n: float) -> str:
    """``138357544 -> '138.4M'``."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(int(n))


def parse_overrides(items: list[str], *, option: str = "--set") -> dict[str, Any]:
    """``["depth=4", "dropout=0.1", "stem=cifar"]`` -> typed config (Python literals or strings)."""
    from dynpipe.errors import UserError

    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise UserError(f"{option} expects KEY=VALUE, got {item!r}; e.g. {option} depth=4")
        try:
            out[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[key] = text
    return out


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _build(name: str, config: dict[str, Any]):
    from dynpipe.errors import UserError
    from dynpipe.models import get_model

    try:
        return get_model(name, **config)
    except TypeError as exc:  # an unknown keyword for the factory
        raise UserError(f"cannot build {name} with {config}: {exc}") from None


def _list_zoo(args: argparse.Namespace) -> int:
    from dynpipe.models import ZOO, load_zoo

    load_zoo()
    rows, records = [], []
    for name in ZOO:
        model = _build(name, {})
        params = sum(
            p.numel()
            for i in range(len(model))
            for p in model.build_layer(i, device="meta").parameters()
        )
        config = " ".join(f"{k}={v}" for k, v in model.config.items())
        rows.append([name, str(len(model)), f"{params:,}", format_count(params), config])
        records.append(
            {"name": name, "layers": len(model), "params": params, "config": model.config}
        )
    if args.json:
        print(json.dumps(records, indent=1, default=str))
    else:
        print(_table(rows, ["model", "layers", "params", "", "default config"]))
        print("\nshow one model's layers: dynpipe models --model NAME [--batch-size B]")
    return 0


def _show_model(args: argparse.Namespace) -> int:
    import torch

    from dynpipe.errors import UserError
    from dynpipe.models.stats import layer_stats

    if args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
    model = _build(args.model, parse_overrides(args.overrides))
    stats = layer_stats(model, batch_size=args.batch_size, dtype=getattr(torch, args.dtype))
    if args.json:
        print(json.dumps([s.as_dict() for s in stats], indent=1))
        return 0
    rows = [
        [
            str(s.index),
            s.name,
            s.kind,
            format_count(s.param_count),
            "x".join(map(str, s.out_shape)),
            f"{s.fwd_flops / 1e9:.3f}",
            f"{s.bwd_flops / 1e9:.3f}",
            f"{s.saved_bytes / 2**20:.1f}",
        ]
        for s in stats
    ]
    total = sum(s.param_count for s in stats)
    print(
        f"{model.name}: {len(model)} layers, {total:,} parameters ({format_count(total)}), "
        f"batch {args.batch_size}, {args.dtype}"
    )
    # A cut model's map back to its source's names is for export, not for reading.
    print(" ".join(f"{k}={v}" for k, v in model.config.items() if k != "source_paths"))
    if model.ties:
        print("tied (one copy per layer, gradients summed): " + "; ".join(
            " = ".join(group) for group in model.ties))  # fmt: skip
    print(
        _table(
            rows, ["#", "name", "kind", "params", "output", "fwd GFLOP", "bwd GFLOP", "saved MiB"]
        )
    )
    print(
        f"total fwd {sum(s.fwd_flops for s in stats) / 1e9:.3f} GFLOP, "
        f"bwd {sum(s.bwd_flops for s in stats) / 1e9:.3f} GFLOP"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    if args.model:
        return _show_model(args)
    if args.overrides:
        from dynpipe.errors import UserError

        raise UserError("--set needs --model NAME: overrides apply to one model")
    return _list_zoo(args)
