"""The telemetry columns: what a sampler reads from a device, by name and dtype family.

One list for every reader and writer: the telemetry sampler fills these keys, the profile
schema stores them beside each measured layer time, the runtime gathers them with stage
times, and the predictor takes them as features. A reading a platform lacks is NaN.
"""

from __future__ import annotations

__all__ = ["TELEMETRY_COLUMNS", "empty_telemetry"]

# name -> dtype family (as in the profile schema): every reading is a float.
TELEMETRY_COLUMNS: dict[str, str] = {
    "tel_util": "float",
    "tel_mem_util": "float",
    "tel_clock_mhz": "float",
    "tel_mem_used_mb": "float",
    "tel_power_w": "float",
    "tel_other_procs": "float",
    "tel_other_util": "float",
    "tel_other_mem_util": "float",
    "tel_throttle": "float",
}


def empty_telemetry() -> dict[str, float]:
    """All ``tel_*`` columns as NaN (a platform without that reading)."""
    return dict.fromkeys(TELEMETRY_COLUMNS, float("nan"))
