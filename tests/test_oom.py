"""A step that runs out of device memory ends the job with one line that says where and
what to lower, on whichever stage it happens, and no rank is left waiting for it.

The out-of-memory error is torch's own type, raised by a layer of a user model at a given
step (``usermodel_oom``): what a CUDA allocation failure raises inside a stage's forward.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dynpipe.runtime.health import OutOfMemory, find_oom, out_of_memory

TESTS = Path(__file__).resolve().parent


def test_the_error_is_found_under_the_schedules_wrapping() -> None:
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.50 GiB. GPU 0")
    try:
        try:
            raise oom
        except RuntimeError as inner:
            raise RuntimeError("[Stage 1] failed to run forward") from inner
    except RuntimeError as wrapped:
        assert find_oom(wrapped) is oom
    assert find_oom(RuntimeError("Connection closed by peer")) is None
    cublas = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`")
    assert find_oom(cublas) is cublas
    line = str(
        out_of_memory(
            oom,
            rank=1,
            stage=1,
            num_stages=2,
            step=7,
            batch_size=64,
            microbatches=4,
            schedule="gpipe",
            device=torch.device("cpu"),
            lower=("--recompute",),
        )
    )
    assert line.startswith("stage 1 of 2 ran out of CPU memory at step 7 (batch 64 as 4 ")
    assert "microbatches of 16" in line and "Tried to allocate 3.50 GiB" in line
    assert "--schedule 1f1b" in line and line.endswith("--recompute") and "\n" not in line


@pytest.mark.slow
@pytest.mark.parametrize("at_layer,stage", [(4, 1), (1, 0)])
def test_an_oom_in_a_step_ends_every_rank_with_one_line(
    tmp_path, at_layer: int, stage: int
) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]),
    }
    cmd = [
        sys.executable,
        "-m",
        "dynpipe",
        "train",
        "--model",
        "usermodel_oom:oom_mlp",
        "--model-arg",
        f"at_layer={at_layer}",
        "--model-arg",
        "at_step=3",
        "--nproc",
        "2",
        "--device",
        "cpu",
        "--batch-size",
        "16",
        "--steps",
        "20",
        "--no-progress",
        "--no-telemetry",
        "--timeout",
        "300",
        "--log",
        str(tmp_path / "run.jsonl"),
    ]
    # A peer left waiting on the failed stage would be ended by --timeout (300 s) at best:
    # this run's own limit is below it.
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, lines
    assert lines[0].startswith(
        f"dynpipe train: rank {stage}: {OutOfMemory.__name__}: stage {stage} of 2 ran out of "
        "CPU memory at step 3 (batch 16 as 4 microbatches of 4"
    ), lines[0]
    assert "lower --batch-size" in lines[0]
