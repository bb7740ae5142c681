"""Offline profiler: layer times alone and beside real interfering jobs, with telemetry.

The interferers and the telemetry sampler it runs live in ``dynpipe.devices`` (the training
runtime uses them too). Importing this package is cheap (no torch, pandas or pynvml): timing
(``layers``), sweeps (``sweep``) and summaries (``summary``) import torch/pandas and are
imported by module.
"""

from __future__ import annotations

from dynpipe.profiler.schema import COLUMNS, SCHEMA_VERSION, load_profiles

__all__ = ["COLUMNS", "SCHEMA_VERSION", "load_profiles"]
