"""``dynpipe demo``: the one-command tour (see ``dynpipe.demo``)."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="a 2-stage CPU pipeline under a real interferer, static then adaptive (start here)",
        description="Trains the same 2-stage CPU pipeline twice on the same data, static then "
        "adaptive, while busy loops take most of stage 1's core mid-run; prints step times "
        "before, during and after, the speed-up, wall times and final held-out accuracy, and "
        "draws both runs in one step-time figure. Writes logs, summary.json and figures into "
        "a run folder.",
    )
    p.add_argument("--quick", action="store_true", help="fewer steps (under a minute)")
    p.add_argument("-o", "--out", default="", help="run folder (default runs/demo-<time>)")
    p.add_argument(
        "--interferer",
        choices=("emulate", "spin"),
        default="emulate",
        help="emulate: stage 1's layers run 3x slower (the same on any machine); spin: real "
        "busy loops on stage 1's core (how much they slow it depends on the machine)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dynpipe.demo.run import DemoConfig, run_demo

    return run_demo(DemoConfig(out=args.out, quick=args.quick, interferer=args.interferer))
