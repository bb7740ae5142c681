"""GPU checks of the probe's lead (``queue_ahead``): a layer timed alone on an otherwise idle
device reads the device's time, not the host's pace of issuing it.

Run on the GPU machine: ``python -m pytest -m gpu tests/test_probe_gpu.py``.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from dynpipe.runtime.timing import queue_ahead

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda:0")


def _events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def test_the_lead_lasts_about_what_it_asks() -> None:
    queue_ahead(DEV, 1.0)  # measures the spin's rate
    a, b = _events()
    a.record()
    queue_ahead(DEV, 5.0)
    b.record()
    b.synchronize()
    assert 3.5 < a.elapsed_time(b) < 8.0, a.elapsed_time(b)


def test_a_launch_bound_layer_reads_its_device_time_behind_the_lead() -> None:
    # Forty small linear layers on 8 rows: each kernel runs in microseconds, each takes the
    # host longer to issue, so timed alone the events read the host's pace.
    torch.manual_seed(0)
    layer = nn.Sequential(*[nn.Linear(256, 256) for _ in range(40)]).to(DEV)
    x = torch.randn(8, 256, device=DEV)
    with torch.no_grad():
        for _ in range(3):
            layer(x)
        torch.cuda.synchronize()

        def timed(lead_ms: float, repeats: int = 1) -> tuple[float, float]:
            """(device ms per forward, host ms per forward)."""
            torch.cuda.synchronize()
            queue_ahead(DEV, lead_ms)
            a, b = _events()
            a.record()
            t = time.perf_counter()
            for _ in range(repeats):
                layer(x)
            host = (time.perf_counter() - t) * 1e3 / repeats
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / repeats, host

        alone, host = timed(0.0)
        # The reference: many forwards queued back to back behind a long lead.
        reference, _ = timed(25 * host + 5.0, repeats=20)
        ahead, _ = timed(2.0 * host + 1.0)
    print(
        f"alone {alone:.3f} ms, behind the lead {ahead:.3f}, back to back {reference:.3f}, "
        f"host {host:.3f}"
    )
    assert abs(ahead / reference - 1.0) < 0.25, (ahead, reference)
    assert alone > ahead, (alone, ahead)
