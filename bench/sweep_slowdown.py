"""How a slowed device's slowdown depends on how busy the pipeline keeps it, from oracle sweeps.

An oracle experiment's sweep (``bench/oracle.py``) holds every 2-stage split twice: clean, then
with the interferer on one stage's device. For each split this prints, for that stage, its
busy fraction under the interferer ``u`` (its forward and backward compute over the step) and
its slowdown ``s`` (that compute over the same split's clean compute), ordered by ``u``. A
policy that prices a layer on a slowed device by the slowdown measured on what the device
holds now assumes ``s`` does not depend on ``u``.

    python bench/sweep_slowdown.py analysis/logs/oracle-h200x2-52503de/*/
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from dynpipe.planner.plan import split_label
from dynpipe.runtime.records import find_log, read_log


def slowdowns(folder: Path) -> tuple[int, list[tuple[float, float, str]]] | None:
    """The interfered stage and, per split, ``(u, s, split)``; None without a sweep."""
    meta_path, log_path = folder / "oracle.json", find_log(folder, "sweep")
    if not meta_path.exists() or log_path is None:
        return None
    meta = json.loads(meta_path.read_text())
    stages = meta.get("stages") or [1]
    stage = int(stages[0] if isinstance(stages, list) else stages)
    onset = int(meta["sweep_onset"])
    held: dict[tuple[tuple[int, int], ...], dict[str, list[tuple[float, float]]]] = {}
    for s in read_log(log_path).steps:
        if len(s.stages) != 2:
            return None
        split = tuple(tuple(x.layers) for x in s.stages)
        busy = s.stages[stage].fwd_ms + s.stages[stage].bwd_ms
        held.setdefault(split, {"c": [], "i": []})["i" if s.step >= onset else "c"].append(
            (s.step_ms, busy)
        )
    out = []
    for split, runs in held.items():
        # The first two steps of a held split carry its move.
        clean, hit = runs["c"][2:], runs["i"][2:]
        if len(clean) < 2 or len(hit) < 2:
            continue
        c = float(np.median([b for _, b in clean]))
        step, busy = float(np.median([t for t, _ in hit])), float(np.median([b for _, b in hit]))
        if c > 0 and step > 0:
            out.append((busy / step, busy / c, split_label(split)))
    return stage, sorted(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="oracle experiment folders")
    a = ap.parse_args(argv)
    for d in a.folders:
        got = slowdowns(d)
        if got is None:
            continue
        stage, rows = got
        cells = " ".join(f"{sp} u{u:.2f} s{s:.2f}" for u, s, sp in rows)
        print(f"{d.parent.name}/{d.name} (stage {stage}): {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
