"""Offline profiler: layer times alone and beside real interfering jobs, with telemetry.

Importing this package is cheap (no torch, pandas or pynvml): the training runtime uses
``start_interferer`` and ``TelemetrySampler`` from here. Timing (``layers``), sweeps
(``sweep``) and summaries (``summary``) import torch/pandas and are imported by module.
"""

from __future__ import annotations

from dynpipe.profiler.interfere import (
    CPU_KINDS,
    GPU_KINDS,
    KINDS,
    Interferer,
    InterfererError,
    InterfererSpec,
    start_interferer,
)
from dynpipe.profiler.schema import COLUMNS, SCHEMA_VERSION, load_profiles
from dynpipe.profiler.telemetry import TelemetrySampler

__all__ = [
    "COLUMNS",
    "CPU_KINDS",
    "GPU_KINDS",
    "KINDS",
    "SCHEMA_VERSION",
    "Interferer",
    "InterfererError",
    "InterfererSpec",
    "TelemetrySampler",
    "load_profiles",
    "start_interferer",
]
