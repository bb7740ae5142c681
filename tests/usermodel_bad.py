"""User model factories that return the wrong thing (loaded by tests/test_bad_input.py)."""

from __future__ import annotations

from torch import nn

from dynpipe.models import InputSpec


def linear() -> nn.Module:
    return nn.Linear(8, 3)


def nothing() -> None:
    return None


def empty() -> nn.Sequential:
    return nn.Sequential()


def stack(*, depth: int = 2) -> nn.Sequential:
    seq = nn.Sequential(*[nn.Linear(8, 8) for _ in range(depth)])
    seq.input_spec = InputSpec(shape=(8,), num_classes=8)
    return seq
