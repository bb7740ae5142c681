"""The reliability table of docs/reliability.md, from the fault suite's committed summaries.

    python bench/reliability_table.py                          # print the table
    python bench/reliability_table.py --write docs/reliability.md

Reads ``bench/results/gpu_faults-cpu.json`` (``bench/gpu_faults.py OUT --device cpu
--quick``) and ``bench/results/gpu_faults-gpu.json`` (``bench/gpu_faults.py OUT`` on one
GPU, its ``OUT/gpu_faults.json`` copied there); a missing file leaves its column saying so.
``--write`` replaces the text between the page's two table markers and nothing else.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from gpu_faults import summary_rows  # noqa: E402

START = "<!-- reliability-table:start -->"
END = "<!-- reliability-table:end -->"
RESULTS = ROOT / "bench" / "results"


def _column(path: Path) -> tuple[str, dict[str, str], dict[str, str]]:
    """(heading, result per case, what was checked per case) from one summary file."""
    if not path.is_file():
        return "not run yet: bench/gpu_faults.py, above", {}, {}
    result = json.loads(path.read_text())
    m = result["machine"]
    name = m["device_name"] if m.get("cuda") else f"{m['cpus']}-core CPU"
    heading = f"{name}, torch {m['torch']}, {result['mode']}, rev. {m.get('revision') or '?'}"
    rows = summary_rows(result)
    return heading, {a: c for a, _, c in rows}, {a: b for a, b, _ in rows}


def table(cpu: Path, gpu: Path) -> str:
    cpu_head, cpu_rows, checked = _column(cpu)
    gpu_head, gpu_rows, gpu_checked = _column(gpu)
    checked = {**gpu_checked, **checked}
    cases = list(dict.fromkeys([*cpu_rows, *gpu_rows]))
    lines = [
        f"| case | checked | CPU ({cpu_head}) | GPU ({gpu_head}) |",
        "|---|---|---|---|",
    ]
    for case in cases:
        lines.append(
            f"| {case} | {checked[case]} | {cpu_rows.get(case, 'not run')} | "
            f"{gpu_rows.get(case, 'not run')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", type=Path, default=RESULTS / "gpu_faults-cpu.json")
    p.add_argument("--gpu", type=Path, default=RESULTS / "gpu_faults-gpu.json")
    p.add_argument("--write", type=Path, default=None, help="page whose table to replace")
    args = p.parse_args(argv)
    text = table(args.cpu, args.gpu)
    if args.write is None:
        print(text, end="")
        return 0
    page = args.write.read_text()
    if START not in page or END not in page:
        print(f"{args.write} has no {START} ... {END} markers to write between", file=sys.stderr)
        return 2
    head, _, rest = page.partition(START)
    _, _, tail = rest.partition(END)
    args.write.write_text(f"{head}{START}\n{text}{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
