"""Saving and resuming on one rank whose default process group has no CPU backend.

One NCCL rank is the usual one-GPU run: ``dcp.async_save`` refuses a group without a CPU
backend, the default one included when it is given none. On CPU the same default group is
a gloo backend registered for CUDA tensors only (``"cuda:gloo"``): a CPU collective on it
fails as on NCCL. The run saves in the background every few steps, and a resume from its
middle checkpoint ends bit-identical to the run that was never stopped.
"""

from __future__ import annotations

import os
import tempfile

import pytest

pytestmark = pytest.mark.slow


def _device_only_group() -> None:
    import torch
    import torch.distributed as dist

    dist.destroy_process_group()  # run_ranks' gloo group, which serves CPU tensors
    dist.init_process_group(
        "cuda:gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1
    )
    with pytest.raises(RuntimeError, match="cpu"):
        dist.all_reduce(torch.ones(1))  # what NCCL says too: no CPU collective on it


def _train(rank: int, world: int, cfg: dict) -> dict:
    _device_only_group()
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    out = train(TrainConfig(**cfg), topo=Topology.from_env(device="cpu"))
    return {"start": out["start"], "losses": out["losses"]}


def test_one_rank_without_a_cpu_backend_saves_and_resumes_bit_identically(tmp_path) -> None:
    from distutil import run_ranks

    from dynpipe.runtime.checkpoint import list_checkpoints

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ck = tmp_path / "ck"
    base = {
        "model": "mlp",
        "model_args": {"depth": 4, "width": 16},
        "batch_size": 16,
        "save_dir": str(ck),
        "keep_checkpoints": 10,
        "progress": False,
        "telemetry": False,
    }
    full = run_ranks(
        _train, 1, {**base, "steps": 12, "save_every": 4, "log": str(tmp_path / "a.jsonl")}
    )
    done, skipped = list_checkpoints(ck)
    assert [c.step for c in done] == [4, 8, 12] and not skipped
    middle = next(c for c in done if c.step == 4)
    again = run_ranks(
        _train,
        1,
        {**base, "steps": 12, "resume": str(middle.path), "log": str(tmp_path / "b.jsonl")},
    )
    assert again[0]["value"]["start"] == 4
    assert again[0]["value"]["losses"] == full[0]["value"]["losses"][4:]


def test_no_dist_is_passed_only_to_a_dcp_that_takes_it() -> None:
    from dynpipe.runtime.checkpoint import dcp_kwargs

    def save_before_2_5(state_dict, *, checkpoint_id=None, process_group=None):
        return None

    def save_from_2_5(state_dict, *, checkpoint_id=None, process_group=None, no_dist=False):
        return None

    assert dcp_kwargs(save_before_2_5, True) == {}
    assert dcp_kwargs(save_from_2_5, True) == {"no_dist": True}
    assert dcp_kwargs(save_from_2_5, False) == {"no_dist": False}
