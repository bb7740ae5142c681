"""``bench/gpu_efficiency.py --quick`` runs on CPU and writes every field its readers use
(speed is not checked here: the GPU run measures it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_cpu_run_writes_every_variant_and_ratio(tmp_path) -> None:
    out = tmp_path / "eff.json"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_efficiency.py"), "--quick", "--device",
           "cpu", "--models", "gpt", "--steps", "2", "--warmup", "1", "-o", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["where"]["torch"] and got["where"]["device_name"] == "cpu"
    assert "revision" in got["where"] and got["settings"]["compile_backend"] == "aot_eager"
    gpt = got["models"]["gpt"]
    assert gpt["flops_per_step"] > 0 and gpt["unit"] == "tokens"
    assert set(gpt["variants"]) == {
        "plain_eager",
        "plain_compiled",
        "dynpipe_eager",
        "dynpipe_compiled",
    }
    for v in gpt["variants"].values():
        assert "error" not in v, v
        assert v["step_ms"] > 0 and len(v["steps_ms"]) == 2 and v["per_s"] > 0
        assert v["mfu"] is None and v["peak_mem_gib"] is None  # CPU: no peak, no CUDA memory
    assert all(r is not None and r > 0 for r in gpt["ratios"].values())
    assert "plain_eager" in done.stdout and "speed dynpipe_eager/plain_eager" in done.stdout


def test_unknown_model_is_one_line() -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_efficiency.py"), "--device", "cpu",
           "--models", "gpt,nope"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert "unknown model or variant nope" in done.stderr
