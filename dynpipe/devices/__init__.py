"""What shares a device with a job, and what the job can observe about it.

Telemetry samplers (``telemetry``: NVML on GPU, ``/proc`` on CPU), interferer processes
(``interfere``, running the ``workloads``), and the telemetry column list (``columns``).
Both the offline profiler and the training runtime use them; neither depends on the other.

Importing this package is cheap (no torch, pandas or pynvml).
"""

from __future__ import annotations

from dynpipe.devices.columns import TELEMETRY_COLUMNS, empty_telemetry
from dynpipe.devices.interfere import (
    CPU_KINDS,
    GPU_KINDS,
    KINDS,
    Interferer,
    InterfererError,
    InterfererSpec,
    llc_bytes,
    start_interferer,
)
from dynpipe.devices.telemetry import TelemetrySampler, parse_device

__all__ = [
    "CPU_KINDS",
    "GPU_KINDS",
    "KINDS",
    "TELEMETRY_COLUMNS",
    "Interferer",
    "InterfererError",
    "InterfererSpec",
    "TelemetrySampler",
    "empty_telemetry",
    "llc_bytes",
    "parse_device",
    "start_interferer",
]
