"""The README's table of adaptation against the oracle, drawn from ``bench/results``.

Reads ``oracle-*.json`` files (as ``bench/oracle.py report`` writes them), keeps the newest
run of each configuration (model and sizes, interferers, slowed stages, stage count; newest
by the commit time of the revision the run names, so the table follows the code), and
prints one Markdown row per configuration: per phase the oracle's split and step time and
each system's ratio to it, bold where it is within ``--goal``, and the worst phase of
adaptive and of measured against static (ratio of their phase times), where a static run
exists. Nothing is typed in by hand: a row is a file.

    python bench/oracle_table.py                 # newest run of every configuration
    python bench/oracle_table.py --since 01d66a4 # ... of runs of that code or later
    python bench/oracle_table.py --all FILES...  # every file given, oldest first
    python bench/oracle_table.py --factors ...   # measured / adaptive as choice x execution
"""

from __future__ import annotations

import argparse
import glob
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from dynpipe.analysis.metrics import oracle_phases

PHASES = ("clean", "interference", "after")
SYSTEMS = ("static", "measured", "adaptive", "restart")


def _commit_time(rev: str) -> int:
    """Commit time of ``rev`` in this repository, 0 if git does not know it."""
    try:
        out = subprocess.run(
            ["git", "show", "-s", "--format=%ct", rev],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return int(out.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def _key(doc: dict[str, Any]) -> tuple:
    c = doc["config"]
    first = tuple(c.get("initial_split") or ())  # a planned start is its own configuration
    start = "clean" not in oracle_phases(c)  # an interferer from the start: its own scenario
    return (
        c["config"],
        tuple(c["interferer"]),
        tuple(c["stages"]),
        c.get("nproc", 2),
        first,
        start,
    )


def _label(doc: dict[str, Any]) -> str:
    c = doc["config"]
    kinds = "+".join(c["interferer"])
    stages = "+".join(str(s) for s in c["stages"])
    since = "" if "clean" in oracle_phases(c) else f" from step {c['onset']}"
    label = f"{c['config']}, `{kinds}`{since} on stage {stages}, {c.get('nproc', 2)} stages"
    if c.get("initial_split"):
        label += ", from the planned " + "\\|".join(map(str, c["initial_split"]))
    return label


def _title(doc: dict[str, Any]) -> str:
    """A row's first cell: the configuration, then the card and the code it ran."""
    return f"{_label(doc)} ({doc.get('device', '?')}, `{doc.get('revision', '?')}`)"


def _fmt(x: float | None, goal: float) -> str:
    if x is None:
        return "–"
    s = f"{x:.3f}"
    return f"**{s}**" if x <= goal else s


def row(doc: dict[str, Any], goal: float) -> str:
    c, ph = doc["config"], doc["phases"]
    steps = " / ".join(f"{a}-{b}" for p, (a, b) in oracle_phases(c).items() if p in ph)
    bar = "\\|"  # a split's "|" escaped: it would end the table cell
    oracle = " / ".join(
        f"{bar.join(map(str, ph[p]['oracle']['split']))} {ph[p]['oracle']['ms']:.1f}"
        for p in PHASES
        if p in ph
    )
    cells = []
    for s in SYSTEMS:
        ratios = [ph[p]["systems"].get(s, {}).get("ratio") for p in PHASES if p in ph]
        cells.append(
            "–" if all(r is None for r in ratios) else " / ".join(_fmt(r, goal) for r in ratios)
        )
    vs_static = []
    for s in ("measured", "adaptive"):
        worst = None
        for p in PHASES:
            sy = ph.get(p, {}).get("systems", {})
            if s in sy and "static" in sy:
                r = sy[s]["ms"] / sy["static"]["ms"]
                worst = r if worst is None else max(worst, r)
        vs_static.append("–" if worst is None else f"{worst:.3f}")
    return (
        f"| {_title(doc)} | {steps} | {oracle} | " + " | ".join(cells) + " | "
        f"{' / '.join(vs_static)} |"
    )


def factors_row(doc: dict[str, Any]) -> str:
    """measured's and adaptive's ratio per phase as ``choice x execution`` (``bench/oracle.py
    report``'s two factors: the sweep's time of the splits held over the oracle's, and the
    run's own time over the sweep's for those splits)."""
    ph = doc["phases"]
    cells = []
    for s in ("measured", "adaptive"):
        parts = []
        for p in PHASES:
            v = ph.get(p, {}).get("systems", {}).get(s)
            parts.append("–" if not v or "choice" not in v else
                         f"{v['choice']:.3f} x {v['execution']:.3f}")  # fmt: skip
        cells.append("–" if all(x == "–" for x in parts) else " / ".join(parts))
    return f"| {_title(doc)} | " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="oracle-*.json (default: bench/results/)")
    ap.add_argument("--all", action="store_true", help="every file, not the newest of each")
    ap.add_argument("--since", help="only runs of this revision or a later one")
    ap.add_argument("--goal", type=float, default=1.05, help="ratio printed bold at or under")
    ap.add_argument(
        "--factors",
        action="store_true",
        help="print measured's and adaptive's ratios as choice x execution instead",
    )
    a = ap.parse_args(argv)
    files = a.files or sorted(glob.glob(str(Path(__file__).parent / "results" / "oracle-*.json")))
    if not files:
        print("no oracle-*.json files given or found in bench/results", file=sys.stderr)
        return 2
    docs = [json.loads(Path(f).read_text()) for f in files]
    for d in docs:
        d["_t"] = _commit_time(str(d.get("revision", "")))
    docs.sort(key=lambda d: d["_t"])
    if a.since:
        t0 = _commit_time(a.since)
        if not t0:
            print(f"--since {a.since}: git does not know this revision", file=sys.stderr)
            return 2
        docs = [d for d in docs if d["_t"] >= t0]
    if not a.all:
        newest: dict[tuple, dict[str, Any]] = {}
        for d in docs:
            newest[_key(d)] = d  # sorted oldest first: the last one wins
        docs = sorted(newest.values(), key=lambda d: _label(d))
    if a.factors:
        print(
            "| configuration (card, code) | measured: choice x execution, per phase | "
            "adaptive: choice x execution, per phase |"
        )
        print("|---|---|---|")
        for d in docs:
            print(factors_row(d))
        return 0
    print(
        "| configuration (card, code) | phases (steps) | oracle split and ms, per phase | "
        "static | measured | adaptive | restart | worst phase vs static (measured / adaptive) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for d in docs:
        print(row(d, a.goal))
    return 0


if __name__ == "__main__":
    sys.exit(main())
