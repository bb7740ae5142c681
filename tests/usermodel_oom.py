"""A user model whose layer ``at_layer`` raises torch's out-of-memory error in the forward
pass of step ``at_step`` (``usermodel_oom:oom_mlp``; tests/test_oom.py and bench/gpu_faults.py
on CPU). Steps are counted by the layer's forward calls: ``microbatches`` per step."""

from __future__ import annotations

import torch
from torch import nn

from dynpipe.models import InputSpec

_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class RaiseOOM(nn.Module):
    def __init__(self, width: int, at_call: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.at_call = at_call
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls > self.at_call:
                raise _OOM(
                    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                    "capacity of 79.19 GiB of which 1.02 GiB is free. (raised by the test layer)"
                )
        return self.linear(x)


def oom_mlp(
    *, width: int = 16, depth: int = 6, at_layer: int = 4, at_step: int = 3, microbatches: int = 4
) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(8, width)]
    for i in range(1, depth - 1):
        layers.append(
            RaiseOOM(width, at_step * microbatches) if i == at_layer else nn.Linear(width, width)
        )
    layers.append(nn.Linear(width, 3))
    seq = nn.Sequential(*layers)
    seq.input_spec = InputSpec(shape=(8,), num_classes=3)
    return seq
