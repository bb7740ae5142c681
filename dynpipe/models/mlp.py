"""``mlp``: a tiny multi-layer perceptron for tests and the demo."""

from __future__ import annotations

from torch import nn

from dynpipe.models.base import InputSpec, LayeredModel, LayerSpec

__all__ = ["mlp"]


def mlp(
    *,
    depth: int = 8,
    width: int = 64,
    in_features: int = 32,
    num_classes: int = 10,
    seed: int = 0,
) -> LayeredModel:
    """``depth`` hidden Linear+GELU layers between an input projection and a classifier."""
    if depth < 1:
        raise ValueError(f"mlp depth must be >= 1, got {depth}")

    def block(fan_in: int, fan_out: int):
        return lambda: nn.Sequential(nn.Linear(fan_in, fan_out), nn.GELU())

    layers = [LayerSpec("inp", "linear", block(in_features, width))]
    layers += [LayerSpec(f"fc{i:02d}", "linear", block(width, width)) for i in range(depth)]
    layers.append(LayerSpec("head", "linear", lambda: nn.Linear(width, num_classes)))
    return LayeredModel(
        name="mlp",
        layers=tuple(layers),
        loss_fn=nn.functional.cross_entropy,
        input_spec=InputSpec(shape=(in_features,), num_classes=num_classes),
        seed=seed,
        config={
            "depth": depth,
            "width": width,
            "in_features": in_features,
            "num_classes": num_classes,
        },
    )
