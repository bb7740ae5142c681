"""A user model given as ``usermodel_tiny:tiny_sequential`` (loaded by tests/test_models.py)."""

from __future__ import annotations

from torch import nn

from dynpipe.models import InputSpec


def tiny_sequential(*, width: int = 16) -> nn.Sequential:
    """A plain ``nn.Sequential`` whose weights come from the global RNG, as users write it."""
    seq = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3))
    seq.input_spec = InputSpec(shape=(8,), num_classes=3)
    return seq
