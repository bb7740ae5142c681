"""Virtual stages: a rank holding several stages of a plan, run by torch's multi-stage
schedules (``interleaved-1f1b``, ``zb``, ``zbv``, ``dualpipev``).

The plan names ``chunks`` stages per rank (``Plan.chunks``, placed as the schedule places
them). The rank keeps every layer it holds in one ``StageModule`` (state, optimizer and
migration address layers by name, wherever they sit in the pipeline) and runs one
``StageModule`` per virtual stage over the same layer objects, each inside its own
``TimedPipelineStage`` with its own layer probe. The schedule is torch's own
``PipelineScheduleMulti`` subclass; gradients accumulate in each parameter's ``.grad`` in
microbatch order, as in single-process gradient accumulation, so a synchronous multi-stage
schedule computes what one device would.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.pipelining as pipelining

from dynpipe.errors import UserError

__all__ = ["MULTI_CLASSES", "StageGroup", "schedule_class"]

# The torch class behind each multi-stage schedule name.
MULTI_CLASSES = {
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def schedule_class(name: str) -> type:
    """torch's schedule class for ``name``; a one-line error when this torch lacks it."""
    cls = getattr(pipelining, MULTI_CLASSES[name], None)
    if cls is None:
        raise UserError(
            f"--schedule {name} needs torch.distributed.pipelining.{MULTI_CLASSES[name]}, "
            f"which torch {torch.__version__} lacks; install torch 2.8 or newer, or use "
            "--schedule 1f1b"
        )
    return cls


class StageGroup:
    """The pipeline stages of one rank, as the engine addresses its one stage."""

    def __init__(self, stages: list[Any]) -> None:
        self.stages = stages

    @property
    def keep_outputs(self) -> bool:
        return all(s.keep_outputs for s in self.stages)

    @keep_outputs.setter
    def keep_outputs(self, on: bool) -> None:
        for s in self.stages:
            s.keep_outputs = on
