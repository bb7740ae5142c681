"""``dynpipe demo``: the one-command tour (see ``dynpipe.demo``)."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    from dynpipe.demo.run import DemoConfig  # plain data, no heavy imports

    factor = f"{DemoConfig.factor:g}x"
    p = sub.add_parser(
        "demo",
        help="a 2-stage CPU pipeline slowed mid-run, static then adaptive (start here)",
        description="Trains the same 2-stage CPU pipeline twice on the same data, static then "
        f"adaptive, while stage 1 runs {factor} slower mid-run; prints step times "
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
        help=f"emulate: stage 1's layers run {factor} slower (the same on any machine); spin: real "
        "busy loops on stage 1's core (how much they slow it depends on the machine)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dynpipe.demo.run import DemoConfig, run_demo

    return run_demo(DemoConfig(out=args.out, quick=args.quick, interferer=args.interferer))
