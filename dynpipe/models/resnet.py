"""``resnet50``: ResNet-50 (v1.5) at residual-block granularity.

Layers: ``stem``, the 16 bottleneck blocks ``layer1_0`` ... ``layer4_2`` (torchvision's
names with the dot replaced), and ``head`` (global average pool + FC). Small images use the
CIFAR stem (3x3 conv, no max-pool) so 32x32 inputs keep enough resolution; larger images
use the ImageNet stem (7x7/2 conv + 3x3/2 max-pool). Batch-norm running statistics are
buffers of the layer that owns them and move with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dynpipe.errors import UserError
from dynpipe.models.base import InputSpec, LayeredModel, LayerSpec
from dynpipe.models.registry import register

__all__ = ["Bottleneck", "resnet50"]

_STAGES = ((1, 3, 64, 1), (2, 4, 128, 2), (3, 6, 256, 2), (4, 3, 512, 2))
_EXPANSION = 4


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (strided, as in v1.5) -> 1x1 convolutions with a projection shortcut."""

    def __init__(self, cin: int, planes: int, *, stride: int) -> None:
        super().__init__()
        cout = planes * _EXPANSION
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=False)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


def _init_convs(module: nn.Module) -> nn.Module:
    # torchvision's ResNet initialisation: He normal (fan-out) convs, unit-gamma batch norm.
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    return module


def _stem_builder(cout: int, *, imagenet: bool) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        if imagenet:
            mods = [
                nn.Conv2d(3, cout, 7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=False),
                nn.MaxPool2d(3, stride=2, padding=1),
            ]
        else:
            mods = [
                nn.Conv2d(3, cout, 3, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=False),
            ]
        return _init_convs(nn.Sequential(*mods))

    return build


def _block_builder(cin: int, planes: int, *, stride: int) -> Callable[[], nn.Module]:
    return lambda: _init_convs(Bottleneck(cin, planes, stride=stride))


def _head_builder(cin: int, num_classes: int) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(
        nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(cin, num_classes)
    )


@register("resnet50")
def resnet50(
    *,
    image_size: int = 32,
    num_classes: int = 10,
    width_mult: float = 1.0,
    stem: str | None = None,
    seed: int = 0,
) -> LayeredModel:
    """ResNet-50 for ``image_size`` x ``image_size`` RGB images.

    ``stem`` is ``"cifar"`` or ``"imagenet"``; by default CIFAR for images up to 64 pixels.
    ``width_mult`` scales every width (small models for tests).
    """
    if stem is None:
        stem = "cifar" if image_size <= 64 else "imagenet"
    if stem not in ("cifar", "imagenet"):
        raise UserError(f"resnet50 stem must be 'cifar' or 'imagenet', got {stem!r}")
    min_size = 32 if stem == "imagenet" else 8
    if image_size < min_size:
        raise UserError(
            f"resnet50 with the {stem} stem needs image_size >= {min_size}, got {image_size}"
        )
    if width_mult <= 0:
        raise UserError(f"resnet50 width_mult must be > 0, got {width_mult}")

    def scaled(c: int) -> int:
        return max(1, round(c * width_mult))

    cin = scaled(64)
    layers = [LayerSpec("stem", "conv", _stem_builder(cin, imagenet=stem == "imagenet"))]
    for stage, blocks, planes, first_stride in _STAGES:
        p = scaled(planes)
        for b in range(blocks):
            stride = first_stride if b == 0 else 1
            layers.append(
                LayerSpec(f"layer{stage}_{b}", "bottleneck", _block_builder(cin, p, stride=stride))
            )
            cin = p * _EXPANSION
    layers.append(LayerSpec("head", "linear", _head_builder(cin, num_classes)))
    return LayeredModel(
        name="resnet50",
        layers=tuple(layers),
        loss_fn=nn.functional.cross_entropy,
        input_spec=InputSpec(shape=(3, image_size, image_size), num_classes=num_classes),
        seed=seed,
        config={
            "image_size": image_size,
            "num_classes": num_classes,
            "width_mult": width_mult,
            "stem": stem,
            "seed": seed,
        },
    )
