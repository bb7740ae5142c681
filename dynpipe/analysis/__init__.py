"""Evaluation figures drawn from raw run logs, profile datasets and predictor reports.

``load_runs`` reads JSONL run logs into ``Run`` objects (tidy pandas frames); every
``plot_*`` function draws one figure from them, returns the ``matplotlib`` Figure and, given
``out``, saves it as PNG and PDF. ``dynpipe figures`` draws all that its inputs support.

Names are imported lazily so ``dynpipe --help`` does not pay for pandas and matplotlib.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Predictions",
    "Run",
    "load_run",
    "load_runs",
    "migration_costs",
    "partition_bubbles",
    "phase_stats",
    "plot_bubbles",
    "plot_busy_fraction",
    "plot_loss",
    "plot_migration",
    "plot_phases",
    "plot_predictor",
    "plot_scaling",
    "plot_step_time",
    "plot_throughput",
    "plot_time_to_accuracy",
    "predictions_from_predictor",
    "predictions_from_report",
    "run_bubbles",
    "scaling_table",
    "throughput",
    "time_to_accuracy_table",
    "time_to_target",
    "write_summary",
]

_WHERE = {
    "Run": "logs",
    "load_run": "logs",
    "load_runs": "logs",
    "migration_costs": "metrics",
    "phase_stats": "metrics",
    "throughput": "metrics",
    "time_to_target": "metrics",
    "plot_step_time": "timeline",
    "plot_busy_fraction": "timeline",
    "plot_loss": "timeline",
    "plot_phases": "bars",
    "plot_throughput": "bars",
    "plot_migration": "bars",
    "partition_bubbles": "bubbles",
    "plot_bubbles": "bubbles",
    "run_bubbles": "bubbles",
    "Predictions": "accuracy",
    "plot_predictor": "accuracy",
    "predictions_from_predictor": "accuracy",
    "predictions_from_report": "accuracy",
    "write_summary": "summary",
    "plot_time_to_accuracy": "convergence",
    "time_to_accuracy_table": "convergence",
    "plot_scaling": "scaling",
    "scaling_table": "scaling",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"dynpipe.analysis.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'dynpipe.analysis' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
