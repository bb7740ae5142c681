"""A training step keeps no more than a plain loop: the last stage frees each microbatch's
output with its backward instead of holding every one for a merge nobody reads."""

from __future__ import annotations

import torch
from distutil import run_ranks


def _one_stage(rank: int, world: int) -> dict:
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.topology import Topology

    model = get_model("gpt", depth=1, width=16, heads=2, seq_len=8, vocab=32)
    eng = PipelineEngine(
        model,
        Plan.even(model, world),
        topo=Topology.from_env(device="cpu"),
        config=EngineConfig(batch_size=8),
    )
    batch = model.input_spec.example(8, device="cpu")
    eng.step(0, batch)
    held = [t.numel() for t in eng.pipe_stage.output_chunks if isinstance(t, torch.Tensor)]
    ev = eng.evaluate([batch])  # reads every microbatch's output: they are kept for it
    eng.step(1, batch)
    after = [t.numel() for t in eng.pipe_stage.output_chunks if isinstance(t, torch.Tensor)]
    return {"held": held, "after": after, "eval_samples": ev.samples, "acc": ev.accuracy}


def test_training_steps_hold_no_outputs_and_evaluation_still_reads_them() -> None:
    torch.set_num_threads(1)
    got = run_ranks(_one_stage, 1)[0]["value"]
    assert sum(got["held"]) == 0 and sum(got["after"]) == 0, got
    assert got["eval_samples"] == 8 and got["acc"] is not None
