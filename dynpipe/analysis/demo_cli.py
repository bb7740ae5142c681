"""``dynpipe demo``: the one-command tour (see ``dynpipe.analysis.demo``)."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="watch a 2-stage CPU pipeline adapt live to a real interferer (start here)",
        description="Two pipeline stages on CPU; a busy-loop interferer takes half of stage "
        "1's core mid-run; dynpipe moves layers away and back. Writes the log, a summary and "
        "figures into a run folder.",
    )
    p.add_argument("--quick", action="store_true", help="fewer steps (about a minute)")
    p.add_argument("-o", "--out", default="", help="run folder (default runs/demo-<time>)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dynpipe.analysis.demo import DemoConfig, run_demo

    return run_demo(DemoConfig(out=args.out, quick=args.quick))
