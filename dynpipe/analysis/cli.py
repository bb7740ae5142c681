"""``dynpipe figures``: every evaluation figure its inputs support, plus ``summary.md``.

    dynpipe figures runs/static.jsonl runs/adaptive.jsonl -o figures/
    dynpipe figures analysis/logs/vgg16-heavy/ -o figures/ --partitions partitions/
    dynpipe figures --label static=a.jsonl --label dynpipe=b.jsonl -o figures/
    dynpipe figures -o figures/ --predictor predictor/cpu_report            # eval report
    dynpipe figures -o figures/ --predictor predictor/cpu.json.gz --profiles profiles/cpu.parquet
    dynpipe figures --tensorboard runs/tb runs/*/log.jsonl                  # TensorBoard files

A figure whose inputs are missing is skipped with a one-line note saying what it needs.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "figures",
        help="draw the evaluation figures and a summary table from run logs",
        description="Draw every evaluation figure that the given run logs, plan files, "
        "profiles and predictor support (PNG + PDF each) and a summary.md table, from the "
        "raw files only.",
    )
    p.add_argument(
        "logs",
        nargs="*",
        metavar="RUN_LOG",
        help="JSONL run logs (`dynpipe train --log`), folders of them, or globs",
    )
    p.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="DIR",
        help="folder for the figures (required unless --tensorboard is given)",
    )
    p.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="write each run log's scalars and adaptation events as TensorBoard event files "
        "under DIR/<log name> (the same as a live run's --tensorboard; needs the tb extra)",
    )
    p.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="NAME=LOG",
        help="name the system of a run log (default: its adapt mode); repeatable",
    )
    p.add_argument(
        "--profiles",
        nargs="+",
        default=[],
        metavar="P",
        help="profile datasets to score --predictor on",
    )
    p.add_argument(
        "--predictor",
        default=None,
        metavar="X",
        help="a predictor evaluation report folder, or a saved predictor (.json[.gz], "
        "with --profiles)",
    )
    p.add_argument(
        "--partitions",
        nargs="+",
        default=[],
        metavar="P",
        help="plan files or folders of them (partitions/) to simulate",
    )
    p.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="loss for time-to-target (default: the --quantile every run reaches); with "
        "eval records, also the eval loss the time-to-accuracy figure measures",
    )
    p.add_argument(
        "--target-accuracy",
        type=float,
        default=None,
        metavar="FRACTION",
        help="held-out accuracy for the time-to-accuracy figure, e.g. 0.9 (default: the "
        "best accuracy every run reaches)",
    )
    p.add_argument(
        "--quantile",
        type=float,
        default=0.1,
        help="loss quantile that picks the target when none is given (default 0.1)",
    )
    p.add_argument("--smooth", type=int, default=5, help="steps in rolling means (default 5)")
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="first steps of a run left out of phase statistics (default 2)",
    )
    p.set_defaults(func=run)


def _labels(items: list[str]) -> dict[str, str]:
    from dynpipe.errors import UserError

    out = {}
    for item in items:
        name, sep, log = item.partition("=")
        if not sep or not name or not log:
            raise UserError(f"--label {item!r} is not NAME=LOG; e.g. --label dynpipe=run.jsonl")
        out[name] = log
    return out


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dynpipe.analysis import (
        accuracy,
        bars,
        bubbles,
        convergence,
        logs,
        scaling,
        summary,
        timeline,
    )
    from dynpipe.errors import UserError

    labels = _labels(args.label)
    if args.tensorboard:
        from dynpipe.analysis.tensorboard import convert, require_tensorboard

        require_tensorboard()
        if not (args.logs or labels):
            raise UserError("--tensorboard needs run logs to convert; give LOG files or folders")
        paths = logs.expand_log_paths([*args.logs, *labels.values()])
        for folder in convert(paths, out=args.tensorboard):
            print(f"tensorboard: {folder}")
        if not args.output:
            return 0
    if not args.output:
        raise UserError("give -o DIR for the figures (or --tensorboard DIR for event files)")
    if not (args.logs or labels or args.predictor or args.partitions):
        raise UserError(
            "nothing to draw; give run logs (`dynpipe train --log FILE`), --partitions or "
            "--predictor"
        )
    out = Path(args.output)
    runs = logs.load_runs(args.logs, labels=labels) if (args.logs or labels) else []
    written: list[Path] = []
    skipped: list[str] = []

    def draw(name: str, need: str | None, fn) -> None:
        if need:
            skipped.append(f"{name}: {need}")
            return
        try:
            fn()
        except UserError as exc:
            skipped.append(f"{name}: {exc}")
            return
        written.extend([out / f"{name}.png", out / f"{name}.pdf"])

    no_runs = "needs run logs" if not runs else None
    smooth = args.smooth
    draw("step_time", no_runs, lambda: timeline.plot_step_time(runs, out=out, smooth=smooth))
    draw("phases", no_runs, lambda: bars.plot_phases(runs, out=out, warmup=args.warmup))
    draw("throughput", no_runs, lambda: bars.plot_throughput(runs, out=out))
    draw(
        "loss_time",
        no_runs,
        lambda: timeline.plot_loss(
            runs, out=out, target=args.target_loss, quantile=args.quantile, smooth=smooth
        ),
    )
    draw(
        "busy_fraction", no_runs, lambda: timeline.plot_busy_fraction(runs, out=out, smooth=smooth)
    )
    draw("migration", no_runs, lambda: bars.plot_migration(runs, out=out))
    no_evals = no_runs or (
        None
        if any(not r.evals.empty for r in runs)
        else "needs eval records (train with --eval-every N)"
    )
    draw(
        "time_to_accuracy",
        no_evals,
        lambda: convergence.plot_time_to_accuracy(
            [r for r in runs if not r.evals.empty],
            out=out,
            target_accuracy=args.target_accuracy,
            target_loss=args.target_loss,
        ),
    )
    draw("scaling", no_runs, lambda: scaling.plot_scaling(runs, out=out, warmup=args.warmup))

    def bubble_fig() -> None:
        import pandas as pd

        parts = [bubbles.run_bubbles(runs, warmup=args.warmup)]
        if args.partitions:
            table, notes = bubbles.partition_bubbles(args.partitions)
            skipped.extend(f"bubbles (plan file) {n}" for n in notes)
            parts.append(table)
        table = (
            pd.concat([p for p in parts if len(p)], ignore_index=True)
            if any(len(p) for p in parts)
            else parts[0]
        )
        bubbles.plot_bubbles(table, runs=runs, out=out)

    draw(
        "bubbles", None if runs or args.partitions else "needs run logs or --partitions", bubble_fig
    )

    def predictor_fig() -> None:
        x = Path(args.predictor)
        if x.is_dir() or x.name == "report.json":
            preds = accuracy.predictions_from_report(x)
        else:
            preds = accuracy.predictions_from_predictor(x, profiles=args.profiles)
        accuracy.plot_predictor(preds, out=out)

    draw(
        "predictor",
        None
        if args.predictor
        else "needs --predictor (a report folder, or a predictor with --profiles)",
        predictor_fig,
    )
    if runs:
        written.append(
            summary.write_summary(
                runs,
                out / "summary.md",
                target=args.target_loss,
                quantile=args.quantile,
                smooth=smooth,
                warmup=args.warmup,
                target_accuracy=args.target_accuracy,
            )
        )
    for p in written:
        print(p)
    for note in skipped:
        print(f"skipped {note}")
    return 0
