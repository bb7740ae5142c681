"""A model whose layers' time is sleep, for schedule measurements on a shared CPU.

Each ``SleepLinear`` sleeps ``fwd_ms`` in its forward, ``bwd_i_ms`` in the backward of its
input gradient and ``bwd_w_ms`` in the backward of its weight gradient (separate autograd
nodes, so a zero-bubble schedule's input and weight parts each take theirs), around a tiny
real linear layer. Four pipeline ranks on two cores then run side by side without taking
each other's CPU, and a schedule's step time is its ordering of these times, which is what
the schedule simulator predicts. Loaded as ``sleepy:sleepy`` with ``bench/`` on the path.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from dynpipe.models import InputSpec


class _SleepGrad(torch.autograd.Function):
    """Identity forward; the backward sleeps ``ms`` before passing the gradient on."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ms: float) -> torch.Tensor:
        ctx.ms = ms
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.ms / 1e3)
        return grad, None


class SleepLinear(nn.Module):
    def __init__(self, width: int, fwd_ms: float, bwd_i_ms: float, bwd_w_ms: float) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.fwd_ms, self.bwd_i_ms, self.bwd_w_ms = fwd_ms, bwd_i_ms, bwd_w_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.fwd_ms / 1e3)
        x = _SleepGrad.apply(x, self.bwd_i_ms)
        w = _SleepGrad.apply(self.lin.weight, self.bwd_w_ms)
        return torch.relu(nn.functional.linear(x, w, self.lin.bias))


def sleepy(
    *,
    depth: int = 16,
    width: int = 16,
    fwd_ms: float = 1.0,
    bwd_i_ms: float = 1.0,
    bwd_w_ms: float = 1.0,
) -> nn.Sequential:
    """``depth`` sleeping layers, then a linear head to 10 classes (no sleep)."""
    layers = [SleepLinear(width, fwd_ms, bwd_i_ms, bwd_w_ms) for _ in range(depth - 1)]
    seq = nn.Sequential(*layers, nn.Linear(width, 10))
    seq.input_spec = InputSpec(shape=(width,), num_classes=10)
    return seq
