"""A user convnet with layers that do no work (``Dropout(0)``, ``Identity``, ``Flatten``).

Loaded as ``usermodel_noop:noop_convnet`` by tests/test_noop_layers.py: a layer whose
forward and backward cost nothing must not upset the per-layer measurements that drive
adaptation.
"""

from __future__ import annotations

import torch
from torch import nn

from dynpipe.models import InputSpec


class _Residual(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)
        self.bn = nn.BatchNorm2d(ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn(self.conv(x)))


def noop_convnet(*, width: int = 8) -> nn.Sequential:
    seq = nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        _Residual(width),
        nn.Dropout(p=0.0),
        nn.Identity(),
        nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(width * 16, 10),
    )
    seq.input_spec = InputSpec(shape=(3, 16, 16), num_classes=10)
    return seq
