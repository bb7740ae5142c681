"""Shared look of every figure: colours per system, titles from the logs, PNG + PDF output.

Figures are built on ``matplotlib.figure.Figure`` directly (Agg canvas, no pyplot state), so
drawing many of them in one process leaks nothing and needs no display.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from dynpipe.analysis.logs import Run

__all__ = [
    "color_of",
    "describe",
    "line_styles",
    "new_figure",
    "save_figure",
    "shade_windows",
    "system_order",
]

# Fixed colours for the four systems, so a system looks the same in every figure.
_SYSTEM_COLORS = {
    "static": "#6b6b6b",
    "measured": "#1f77b4",
    "adaptive": "#d62728",
    "restart": "#2ca02c",
}
_ORDER = ("static", "restart", "measured", "adaptive")
_OTHER = ("#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
# Light to heavy interference: shading gets darker with severity.
_SHADES = ("#fde0b8", "#f9b98a", "#f28e5c", "#e0603a")


def system_order(systems: Sequence[str]) -> list[str]:
    """Systems in a fixed order: static, restart, measured, adaptive, then the rest as given."""
    uniq = list(dict.fromkeys(systems))
    known = [s for s in _ORDER if s in uniq]
    return known + [s for s in uniq if s not in known]


def color_of(system: str, systems: Sequence[str] = ()) -> str:
    if system in _SYSTEM_COLORS:
        return _SYSTEM_COLORS[system]
    others = [s for s in system_order(systems) if s not in _SYSTEM_COLORS]
    i = others.index(system) if system in others else abs(hash(system))
    return _OTHER[i % len(_OTHER)]


def line_styles(runs: Sequence[Run]) -> dict[str, str]:
    """A line style per run: solid, then dash-dot, dotted… for further runs of one system
    (same colour), so they stay apart."""
    seen: dict[str, int] = {}
    out = {}
    for run in runs:
        k = seen.get(run.system, 0)
        seen[run.system] = k + 1
        out[run.name] = ("-", "-.", ":", (0, (5, 1)))[k % 4]
    return out


def describe(runs: Sequence[Run]) -> str:
    """``mlp on cpu, 2 stages`` — models and devices named by the logs' headers."""
    models = ", ".join(dict.fromkeys(r.model for r in runs))
    devices = ", ".join(dict.fromkeys(r.device for r in runs))
    stages = ", ".join(dict.fromkeys(str(r.num_stages) for r in runs))
    return f"{models} on {devices}, {stages} stages"


def new_figure(*, width: float = 8.0, height: float = 4.5) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def save_figure(fig: Figure, out: str | Path | None, name: str) -> list[Path]:
    """Write ``out/name.png`` and ``out/name.pdf``; nothing when ``out`` is None."""
    if out is None:
        return []
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    from PIL import Image  # matplotlib's own dependency

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=150)
    # A plot holds a handful of colours (and their antialiased blends): a 256-colour palette
    # draws it the same at 40% of the bytes, which keeps the repository's figures small.
    with Image.open(buf) as im:
        im.convert("RGB").quantize(colors=256).save(paths[0], optimize=True)
    fig.savefig(paths[1])
    return paths


def shade_windows(ax: Axes, runs: Sequence[Run]) -> None:
    """Shade every distinct interference window of ``runs`` over the training-step axis.

    Each condition gets one legend entry; heavier conditions are shaded darker.
    """
    wins = {}
    for run in runs:
        for w in run.windows:
            wins.setdefault((w.start, w.stop, w.label), w)
    ranks = sorted({w.severity for w in wins.values()})
    labelled: set[str] = set()
    for (start, stop, label), w in wins.items():
        shade = _SHADES[min(ranks.index(w.severity), len(_SHADES) - 1)]
        ax.axvspan(
            start - 0.5,
            stop - 0.5,
            color=shade,
            alpha=0.6,
            lw=0,
            zorder=0,
            label=None if label in labelled else f"interference: {label}",
        )
        labelled.add(label)
