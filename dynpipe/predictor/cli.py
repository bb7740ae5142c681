"""``dynpipe predictor``: fit, evaluate and inspect the layer slowdown predictor.

    dynpipe predictor fit profiles/cpu.parquet -o predictor/cpu.json.gz           # xgboost
    dynpipe predictor fit profiles/*.parquet -o predictor/rf.json --estimator rf
    dynpipe predictor fit profiles/cpu.parquet -o predictor/cpu.json.gz --report predictor/cpu_report
    dynpipe predictor eval predictor/cpu.json.gz profiles/cpu.parquet -o predictor/cpu_report
    dynpipe predictor show predictor/cpu.json.gz
    dynpipe predictor convert old.joblib -o new.json.gz --allow-pickle   # a trusted old file

``eval`` re-fits the predictor's configuration inside grouped cross-validation (held-out
conditions, models, interferer kinds) next to random forest, ridge, stage-mean and
no-interference baselines on the same folds, and writes report.json, report.md,
pred_vs_measured.png and the raw out-of-fold predictions to ``-o DIR``. On profiles that the
predictor was not trained on it also scores the saved predictor as shipped, without refitting.

Predictor files are JSON (``.json``, or ``.json.gz`` compressed): numbers and strings only, so
loading one runs no code. Older versions wrote joblib pickles, which do; ``convert`` reads one
only with ``--allow-pickle``, for a file you trust.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register", "run"]

_COMPARED = ("xgb", "rf", "ridge", "stage-mean", "none")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "predictor",
        help="fit, evaluate and inspect the layer slowdown predictor",
        description="Fit the per-layer slowdown predictor on profile datasets, evaluate it "
        "with grouped cross-validation against baselines, or show a saved one.",
    )
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--stages",
            default="2,4",
            metavar="N,N",
            help="stage counts of the balanced splits scored per stage (default 2,4)",
        )
        p.add_argument(
            "--folds",
            type=int,
            default=0,
            metavar="K",
            help="condition split: 0 leaves one condition out per fold (default), K > 0 "
            "uses GroupKFold(K)",
        )
        p.add_argument(
            "--splits",
            default="condition,model,interferer,device",
            metavar="S,S",
            help="held-out groups: condition, model, interferer, device (a split the data "
            "cannot support, e.g. device with one device, is skipped)",
        )
        p.add_argument(
            "--n-jobs",
            type=int,
            default=None,
            metavar="N",
            help="threads per estimator (default: all cores)",
        )

    fit = sub.add_parser(
        "fit",
        help="fit a predictor and save it",
        description="Fit a slowdown predictor on all given profiles and save it.",
    )
    fit.add_argument(
        "profiles",
        nargs="+",
        metavar="PROFILES",
        help="profile datasets (.parquet files or directories of them)",
    )
    fit.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="PATH",
        help="where to write the predictor (.json or .json.gz), e.g. predictor/cpu.json.gz",
    )
    fit.add_argument(
        "--estimator",
        default="xgb",
        choices=("xgb", "rf", "ridge"),
        help="model family (default xgb)",
    )
    fit.add_argument(
        "--set",
        dest="params",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="hyper-parameter override, e.g. --set max_depth=8",
    )
    fit.add_argument(
        "--tune",
        action="store_true",
        help="choose xgb hyper-parameters by grouped CV (nested CV in --report)",
    )
    fit.add_argument(
        "--report",
        metavar="DIR",
        help="also cross-validate, write the report to DIR and attach its summary",
    )
    common(fit)
    fit.set_defaults(func=run)

    ev = sub.add_parser(
        "eval",
        help="cross-validate a predictor's configuration against baselines",
        description="Grouped cross-validation of the predictor's configuration "
        "and the baselines on the same folds; report as JSON, markdown and PNG.",
    )
    ev.add_argument("predictor", metavar="PREDICTOR", help="saved predictor (.json or .json.gz)")
    ev.add_argument(
        "profiles",
        nargs="+",
        metavar="PROFILES",
        help="profile datasets (.parquet files or directories of them)",
    )
    ev.add_argument("-o", "--output", metavar="DIR", help="write the report files here")
    ev.add_argument(
        "--tune", action="store_true", help="nested grouped CV for the xgb hyper-parameters (slow)"
    )
    common(ev)
    ev.set_defaults(func=run)

    show = sub.add_parser(
        "show",
        help="print a saved predictor's schema, provenance and report",
        description="Print a saved predictor's schema, provenance and accuracy.",
    )
    show.add_argument("predictor", metavar="PREDICTOR", help="saved predictor (.json or .json.gz)")
    show.set_defaults(func=run)

    conv = sub.add_parser(
        "convert",
        help="rewrite an older joblib predictor as JSON (reads a pickle: trusted files only)",
        description="Read a predictor an older dynpipe saved as a joblib pickle and write it as "
        "JSON. Unpickling runs any code the file holds, so this needs --allow-pickle and a "
        "file you trained or trust; the JSON file it writes is safe to load anywhere.",
    )
    conv.add_argument("predictor", metavar="OLD", help="predictor saved as .joblib")
    conv.add_argument(
        "-o", "--output", required=True, metavar="NEW", help="JSON file to write (.json[.gz])"
    )
    conv.add_argument(
        "--allow-pickle",
        action="store_true",
        help="unpickle OLD although that runs any code it holds (only for files you trust)",
    )
    conv.set_defaults(func=run)


def _ints(text: str, *, flag: str) -> tuple[int, ...]:
    from dynpipe.errors import UserError

    try:
        out = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise UserError(
            f"{flag} expects comma-separated integers such as 2,4, got {text!r}"
        ) from None
    if not out or min(out) < 1:
        raise UserError(f"{flag} expects positive integers such as 2,4, got {text!r}")
    return out


def _splits(text: str) -> tuple[str, ...]:
    from dynpipe.errors import UserError
    from dynpipe.predictor.crossval import SPLITS

    out = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [s for s in out if s not in SPLITS]
    if bad or not out:
        raise UserError(f"--splits takes some of {', '.join(SPLITS)}, got {text!r}")
    return out


def _with_jobs(est: Any, n_jobs: int | None) -> Any:
    if n_jobs is not None and "n_jobs" in est.get_params():
        est.set_params(n_jobs=n_jobs)
    return est


def _evaluate(args: argparse.Namespace, df: Any, *, primary: str, primary_est: Any, tune: bool):
    from sklearn.base import clone

    from dynpipe.predictor.crossval import evaluate
    from dynpipe.predictor.estimator import make_estimator

    estimators = {
        name: _with_jobs(
            clone(primary_est) if name == primary else make_estimator(name), args.n_jobs
        )
        for name in (primary, *(n for n in _COMPARED if n != primary))
    }
    return evaluate(
        df,
        estimators=estimators,
        splits=_splits(args.splits),
        n_stages=_ints(args.stages, flag="--stages"),
        n_folds=args.folds,
        tune=(primary,) if tune and primary == "xgb" else (),
        calibrate=(primary,),
    )


def _headline(summary: dict, *, primary: str) -> dict:
    """The compact summary stored inside a predictor file."""
    return {
        "primary": primary,
        "fingerprint": summary.get("fingerprint"),
        "n_stages": summary["n_stages"],
        "results": {
            split: {
                name: {"layer": r["layer"]["all"], "stage": r["stage"]["all"]}
                for name, r in res.items()
            }
            for split, res in summary["results"].items()
        },
        **({"shipped": summary["shipped"]} if "shipped" in summary else {}),
    }


def _pct(x: float | None) -> str:
    return "     –" if x is None else f"{x:6.2f}"


def _print_headline(head: dict) -> None:
    for split, res in head["results"].items():
        for name, r in res.items():
            mark = "*" if name == head["primary"] else " "
            la, st = r["layer"], r["stage"]
            print(
                f"{mark} {split:<10} {name:<10} layer MAPE {_pct(la['mape'])}%  "
                f"p90 {_pct(la['p90'])}%   stage MAPE {_pct(st['mape'])}%  p90 {_pct(st['p90'])}%"
            )


def _fit(args: argparse.Namespace) -> int:
    import time

    from dynpipe.models.cli import parse_overrides
    from dynpipe.predictor.estimator import make_estimator
    from dynpipe.predictor.io import save_predictor
    from dynpipe.predictor.report import write_report
    from dynpipe.predictor.train import fit_predictor
    from dynpipe.profiler.schema import load_profiles
    from dynpipe.profiler.work import add_work

    _ints(args.stages, flag="--stages"), _splits(args.splits)  # fail before the slow part
    df = add_work(load_profiles(args.profiles))
    params = parse_overrides(args.params)
    if args.n_jobs is not None and args.estimator != "ridge":
        params.setdefault("n_jobs", args.n_jobs)
    t0 = time.perf_counter()
    pred = fit_predictor(df, estimator=args.estimator, params=params, tune=args.tune)
    fit_s = time.perf_counter() - t0
    print(
        f"fitted {args.estimator} on {len(df)} rows, {len(pred.schema.names)} features in "
        f"{fit_s:.1f}s; data {pred.data_fingerprint[:16]}"
    )
    if args.report:
        ev = _evaluate(
            args,
            df,
            primary=args.estimator,
            primary_est=make_estimator(args.estimator, **params),
            tune=args.tune,
        )
        ev.summary["fingerprint"] = pred.data_fingerprint
        paths = write_report(ev, args.report, primary=args.estimator)
        pred.report = _headline(ev.summary, primary=args.estimator)
        _print_headline(pred.report)
        print(f"report: {paths['markdown']}")
    path = save_predictor(pred, args.output)
    print(f"saved {path}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from dynpipe.predictor.crossval import score
    from dynpipe.predictor.io import dataset_fingerprint, load_predictor
    from dynpipe.predictor.report import render_markdown, write_report
    from dynpipe.profiler.schema import load_profiles
    from dynpipe.profiler.work import add_work

    _ints(args.stages, flag="--stages"), _splits(args.splits)  # fail before the slow part
    pred = load_predictor(args.predictor)
    df = add_work(load_profiles(args.profiles))
    primary = pred.estimator_name
    ev = _evaluate(args, df, primary=primary, primary_est=pred.estimator, tune=args.tune)
    fp = dataset_fingerprint(df)
    ev.summary["fingerprint"] = fp
    ev.summary["predictor"] = {"path": str(args.predictor), "trained_on": pred.data_fingerprint}
    if fp != pred.data_fingerprint:
        # New data for this predictor: its as-shipped accuracy, no refit, is meaningful.
        ev.summary["shipped"] = score(
            df, pred.predict_time_ms(df), n_stages=_ints(args.stages, flag="--stages")
        )
        s = ev.summary["shipped"]
        print(
            f"shipped predictor, no refit: layer MAPE {s['layer']['all']['mape']:.2f}%, "
            f"stage MAPE {s['stage']['all']['mape']:.2f}%"
        )
    _print_headline(_headline(ev.summary, primary=primary))
    if args.output:
        paths = write_report(ev, args.output, primary=primary)
        print(f"report: {paths['markdown']}")
    else:
        print(render_markdown(ev.summary, primary=primary))
    return 0


def _show(args: argparse.Namespace) -> int:
    import json

    from dynpipe.predictor.io import load_predictor

    pred = load_predictor(args.predictor)
    print(repr(pred))
    print(f"estimator: {type(pred.estimator).__name__} {pred.estimator.get_params()}")
    print(
        f"features (schema {pred.schema.version}, {len(pred.schema.names)}): "
        f"{', '.join(pred.schema.names)}"
    )
    for line in _training_lines(pred.training):
        print(line)
    est = pred.estimator
    if getattr(est, "spread_booster_", None) is not None:
        print(
            f"spread: {100 * est.coverage:.0f}% interval calibrated on held-out architectures; "
            f"level spread {est.level_log_sd_:.3f} (log time)"
        )
    else:
        print("spread: none (predict_layer_distribution refuses this file)")
    print(f"data fingerprint: {pred.data_fingerprint}")
    print(f"versions: {json.dumps(pred.versions)}")
    if pred.report:
        _print_headline(pred.report)
    else:
        print("no accuracy report attached; run `dynpipe predictor fit ... --report DIR`")
    return 0


def _training_lines(training: dict) -> list[str]:
    """What ``show`` prints of a predictor's training data: architectures, cards (with
    driver and torch, from the profiles' metadata), conditions, batch sizes."""
    lines = [f"trained on: {training.get('rows', '?')} rows"]
    models = training.get("models") or []
    lines.append(f"  architectures ({len(models)}): {', '.join(models) or '?'}")
    metas = (training.get("metadata") or {}).get("dynpipe") or []
    cards: dict[str, set[str]] = {}
    for meta in metas if isinstance(metas, list) else [metas]:
        if isinstance(meta, dict) and meta.get("device_name"):
            cards.setdefault(str(meta["device_name"]), set()).add(
                f"driver {meta.get('driver', '?')}, torch {meta.get('torch_version', '?')}"
            )
    for name in training.get("devices") or []:
        cards.setdefault(str(name), set())
    for name, soft in sorted(cards.items()):
        lines.append(f"  card: {name}" + (f" ({'; '.join(sorted(soft))})" if soft else ""))
    conditions = training.get("conditions") or []
    lines.append(f"  conditions ({len(conditions)}): {', '.join(conditions)}")
    for key, label in (("batch_sizes", "batch sizes"), ("dtypes", "dtypes")):
        if training.get(key):
            lines.append(f"  {label}: {', '.join(map(str, training[key]))}")
    return lines


def _convert(args: argparse.Namespace) -> int:
    from dynpipe.predictor.io import load_predictor, save_predictor

    pred = load_predictor(args.predictor, allow_pickle=args.allow_pickle)
    path = save_predictor(pred, args.output)
    print(f"converted {args.predictor} -> {path} ({pred!r})")
    return 0


def run(args: argparse.Namespace) -> int:
    actions = {"fit": _fit, "eval": _eval, "show": _show, "convert": _convert}
    return actions[args.action](args)
