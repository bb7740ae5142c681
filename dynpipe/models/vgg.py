"""``vgg16``: VGG-16 without batch norm, the model PipeDream and DynPipe partitioned.

One layer per conv+ReLU (13), each max-pool folded into the conv layer before it, then the
three fully connected layers ``fc6``-``fc8``. The classifier follows the image size: 32x32
inputs reach the classifier as 1x1x512 and use 512-wide FC layers (the usual CIFAR
adaptation); larger inputs use the original 4096-wide FC layers.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from dynpipe.errors import UserError
from dynpipe.models.base import InputSpec, LayeredModel, LayerSpec
from dynpipe.models.registry import register

__all__ = ["vgg16"]

# (block, convs per block, channels): five blocks, each ending in a 2x2 max-pool.
_BLOCKS = ((1, 2, 64), (2, 2, 128), (3, 3, 256), (4, 3, 512), (5, 3, 512))


def _scaled(channels: int, width_mult: float) -> int:
    return max(1, round(channels * width_mult))


def _conv_builder(cin: int, cout: int, *, pool: bool) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        conv = nn.Conv2d(cin, cout, kernel_size=3, padding=1)
        # torchvision's VGG initialisation (He normal, fan-out): without batch norm the
        # default uniform init makes a 16-layer stack hard to start training.
        nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
        nn.init.zeros_(conv.bias)
        mods: list[nn.Module] = [conv, nn.ReLU(inplace=False)]
        if pool:
            mods.append(nn.MaxPool2d(kernel_size=2, stride=2))
        return nn.Sequential(*mods)

    return build


def _fc_builder(
    fan_in: int, fan_out: int, *, act: bool, flatten: bool, dropout: float
) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        fc = nn.Linear(fan_in, fan_out)
        nn.init.normal_(fc.weight, 0.0, 0.01)
        nn.init.zeros_(fc.bias)
        mods: list[nn.Module] = [nn.Flatten(1)] if flatten else []
        mods.append(fc)
        if act:
            mods.append(nn.ReLU(inplace=False))
            if dropout > 0:
                mods.append(nn.Dropout(dropout))
        return nn.Sequential(*mods)

    return build


@register("vgg16")
def vgg16(
    *,
    image_size: int = 32,
    num_classes: int = 10,
    width_mult: float = 1.0,
    fc_width: int | None = None,
    dropout: float = 0.0,
    seed: int = 0,
) -> LayeredModel:
    """VGG-16 (configuration D) for ``image_size`` x ``image_size`` RGB images.

    ``width_mult`` scales every conv and FC width (small models for tests); ``fc_width``
    defaults to 512 for images up to 64 pixels and 4096 above.
    """
    if image_size < 32 or image_size % 32:
        raise UserError(
            f"vgg16 needs image_size a multiple of 32 (five 2x2 pools), got {image_size}; "
            "use 32 (CIFAR) or 224 (ImageNet)"
        )
    if width_mult <= 0:
        raise UserError(f"vgg16 width_mult must be > 0, got {width_mult}")
    if fc_width is None:
        fc_width = 512 if image_size <= 64 else 4096
    hidden = _scaled(fc_width, width_mult)

    layers: list[LayerSpec] = []
    cin = 3
    for block, convs, channels in _BLOCKS:
        cout = _scaled(channels, width_mult)
        for j in range(1, convs + 1):
            build = _conv_builder(cin, cout, pool=j == convs)
            layers.append(LayerSpec(f"conv{block}_{j}", "conv", build))
            cin = cout
    side = image_size // 32
    fan_in = cin * side * side
    layers.append(
        LayerSpec(
            "fc6", "linear", _fc_builder(fan_in, hidden, act=True, flatten=True, dropout=dropout)
        )
    )
    layers.append(
        LayerSpec(
            "fc7", "linear", _fc_builder(hidden, hidden, act=True, flatten=False, dropout=dropout)
        )
    )
    layers.append(
        LayerSpec(
            "fc8", "linear", _fc_builder(hidden, num_classes, act=False, flatten=False, dropout=0.0)
        )
    )
    return LayeredModel(
        name="vgg16",
        layers=tuple(layers),
        loss_fn=nn.functional.cross_entropy,
        input_spec=InputSpec(shape=(3, image_size, image_size), num_classes=num_classes),
        seed=seed,
        config={
            "image_size": image_size,
            "num_classes": num_classes,
            "width_mult": width_mult,
            "fc_width": fc_width,
            "dropout": dropout,
            "seed": seed,
        },
    )
