"""--schedule 2bw on one GPU: its step time beside 1f1b's, and a checkpoint resumed exactly.

Three ``dynpipe train`` runs of one small gpt on one GPU (one stage, fused AdamW, batches
kept on the device): 1f1b and 2bw for ``--steps`` steps each, then 2bw again from its
checkpoint at half way (saved asynchronously through pinned host buffers, as a real run
saves). Writes ``$OUT/twobw-gpu.json`` (the medians, the losses and how far the resumed
losses are from the uninterrupted run's) and the three raw run logs beside it.

    python bench/twobw_gpu.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

TINY = ["--model-arg", "depth=4", "--model-arg", "width=16", "--batch-size", "8"]  # CPU smoke
MODEL = ["--model", "gpt", "--model-arg", "depth=8", "--model-arg", "width=1024",
         "--model-arg", "seq_len=256", "--model-arg", "heads=8", "--batch-size", "16", "--microbatches", "4"]  # fmt: skip


def _train(
    out: Path, name: str, schedule: str, steps: int, *extra: str, model=MODEL, device="cuda"
) -> Path:
    log = out / f"{name}.jsonl"
    argv = [sys.executable, "-m", "dynpipe", "train", "--nproc", "1", "--device", device,
            *model, "--schedule", schedule, "--steps", str(steps), "--device-batches", "4",
            "--no-progress", "--log", str(log), *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    subprocess.run(argv, check=True, env=env)
    return log


def _steps(log: Path) -> dict[int, tuple[float, float]]:
    from dynpipe.runtime.records import read_log

    return {r.step: (r.loss, r.step_ms) for r in read_log(str(log)).steps}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--device", default="cuda", help="cuda, or cpu with --tiny for a smoke run")
    p.add_argument("--tiny", action="store_true", help="a 4-layer mlp instead of the gpt")
    args = p.parse_args()
    kw = {"model": TINY if args.tiny else MODEL, "device": args.device}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    half = args.steps // 2
    sync = _steps(_train(out, "1f1b", "1f1b", args.steps, **kw))
    whole = _steps(_train(out, "2bw", "2bw", args.steps, **kw))
    ck = out / "ck"
    _train(out, "2bw-first", "2bw", half, "--save-every", str(half), "--save-dir", str(ck), **kw)
    (saved,) = sorted(ck.glob(f"ckpt-{half:08d}-*"))
    resumed = _steps(_train(out, "2bw-resumed", "2bw", args.steps, "--resume", str(saved), **kw))

    def median_ms(steps: dict) -> float:  # steps 5+: past compile and allocator warm-up
        return statistics.median(ms for s, (_, ms) in steps.items() if s >= 5)

    diff = [abs(resumed[s][0] - whole[s][0]) for s in resumed]
    result = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": kw["model"],
        "steps": args.steps,
        "median_step_ms": {"1f1b": median_ms(sync), "2bw": median_ms(whole)},
        "losses": {
            "1f1b": [sync[s][0] for s in sorted(sync)],
            "2bw": [whole[s][0] for s in sorted(whole)],
        },
        "resumed_from": half,
        "resumed_steps": sorted(resumed),
        "resumed_max_abs_loss_diff": max(diff),
        "resumed_bit_identical": max(diff) == 0.0,
    }
    (out / "twobw-gpu.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "losses"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
