"""Text tables of plans: what ``dynpipe plan`` prints and the READMEs embed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dynpipe.planner.plan import Plan, split_label

__all__ = [
    "format_comparison",
    "format_plan",
    "format_schedules",
    "format_shapes",
    "replace_section",
]


def _mem(b: int | None) -> str:
    if b is None:
        return "-"
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(out)


def format_plan(plan: Plan) -> str:
    """Per-stage table (layers, predicted times, transfer, memory) and the step summary."""
    meta = plan.meta
    bott = meta.get("bottleneck_stage")
    kind = meta.get("bottleneck_kind", "compute")
    rows = []
    for s, st in enumerate(plan.stages):
        names = f"{st.layers[0]}…{st.layers[-1]}" if len(st.layers) > 1 else "".join(st.layers)
        mark = ""
        if s == bott:
            mark = "<- bottleneck" if kind == "compute" else "<- bottleneck (send)"
        rows.append(
            [
                str(s),
                str(st.rank),
                f"[{st.start}:{st.stop})",
                str(len(st)),
                names,
                _ms(st.fwd_ms),
                _ms(st.bwd_ms),
                _ms(st.comm_ms),
                _mem(st.mem_bytes),
                mark,
            ]
        )
    head = ["stage", "rank", "layers", "n", "names", "fwd ms", "bwd ms", "send ms", "memory", ""]
    lines = [_table(rows, head)]
    if "step_ms" in meta:
        costs = meta.get("costs", {})
        src = costs.get("source", "?")
        mb = costs.get("microbatch_size")
        line = (
            f"step {meta['step_ms']:.3f} ms ({plan.schedule}, {plan.microbatches} microbatches"
            f"{f' of {mb}' if mb else ''}), bubble {meta.get('bubble', 0.0):.1%}, "
            f"bottleneck {meta.get('bottleneck_ms', 0.0):.3f} ms/microbatch"
        )
        if "optimal_bottleneck_ms" in meta:
            line += f" (min possible {meta['optimal_bottleneck_ms']:.3f})"
        lines.append(line)
        if src == "analytic":
            src = (
                f"analytic roofline ({costs.get('flops_per_s', 0) / 1e12:g} TFLOP/s, "
                f"{(costs.get('mem_bytes_per_s') or 0) / 1e9:g} GB/s; not measured)"
            )
        extra = [f"costs: {src}"]
        if costs.get("slowdown"):
            extra.append(f"slowdown {costs['slowdown']}")
        if "planner_ms" in meta:
            exact = "exact" if meta.get("exhaustive") else "best found"
            extra.append(
                f"planned in {meta['planner_ms']:.1f} ms over {meta.get('candidates')} "
                f"candidates ({exact})"
            )
        if "migration_bytes" in meta:
            extra.append(f"moves {_mem(meta['migration_bytes'])} from the current plan")
        if meta.get("fits_memory") is False:
            extra.append("DOES NOT FIT the memory limit")
        lines.append("; ".join(extra))
    recomputed = [f"stage {s}: {', '.join(st.recompute)}" for s, st in enumerate(plan.stages)]
    if any(st.recompute for st in plan.stages):
        # The memory column is each stage's predicted peak with these layers recomputed.
        lines.append(
            "recomputed (re-forward in the backward): "
            + "; ".join(r for r, st in zip(recomputed, plan.stages, strict=True) if st.recompute)
        )
    return "\n".join(lines)


def format_comparison(plans: Sequence[Plan]) -> str:
    """One row per plan: method, stage sizes, step, bubble, bottleneck; ratio to the first."""
    if not plans:
        return ""
    ref = plans[0].meta.get("step_ms")
    rows = []
    for p in plans:
        step = p.meta.get("step_ms")
        ratio = f"{step / ref:.3f}" if step and ref else "-"
        rows.append(
            [
                str(p.meta.get("method", "?")),
                "/".join(str(len(st)) for st in p.stages),
                _ms(step),
                f"{p.meta.get('bubble', 0.0):.1%}",
                _ms(p.meta.get("bottleneck_ms")),
                _mem(max((st.mem_bytes or 0) for st in p.stages)),
                ratio,
            ]
        )
    return _table(
        rows,
        [
            "method",
            "layers/stage",
            "step ms",
            "bubble",
            "bottleneck ms",
            "peak memory",
            "step / first",
        ],
    )


def replace_section(path: str | Path, name: str, body: str) -> None:
    """Rewrite the text between ``<!-- name:begin -->`` and ``<!-- name:end -->`` in ``path``.

    Generated tables live between such markers so scripts can refresh them while the prose
    around them stays hand-written. Missing markers are appended at the end.
    """
    p = Path(path)
    text = p.read_text() if p.exists() else ""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + ("\n\n" if text else "") + block + "\n"
    p.write_text(text)


def format_shapes(shapes: Sequence) -> str:
    """One row per dp x pp shape (``planner.shape.ShapeChoice``): split and step time."""
    rows = []
    for c in shapes:
        split = split_label(c.bounds) or "-"
        done = bool(c.bounds)
        rows.append(
            [
                f"{c.dp} x {c.pp}",
                split,
                f"{c.microbatches} x {c.microbatch_size}" if done else "-",
                _ms(c.pipeline_ms) if done else "-",
                _ms(c.reduce_ms) if done else "-",
                _ms(c.step_ms) if done else "-",
                _mem(c.mem_bytes) if done else "-",
                c.note or ("" if c.fits else "does not fit memory"),
            ]
        )
    head = ["dp x pp", "split", "microbatches", "pipe ms", "reduce ms", "step ms", "memory", ""]
    return _table(rows, head)


def format_schedules(rows: list[dict]) -> str:
    """The predicted step time of each schedule (``virtual.schedule_table``)."""
    best = min((r["step_ms"] for r in rows if r["step_ms"] is not None), default=None)
    out = []
    for r in rows:
        split = "|".join(map(str, r.get("split", []))) or "-"
        if r["step_ms"] is None:
            step, note = "-", r["note"]
        else:
            step = f"{r['step_ms']:.3f}"
            fastest = "<- fastest" if r["step_ms"] == best else ""
            note = "; ".join(x for x in (fastest, r.get("note", "")) if x)
        out.append([r["schedule"], str(r["chunks"]), step, split, note])
    return _table(out, ["schedule", "chunks", "step ms", "split", ""])
