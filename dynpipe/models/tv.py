"""torchvision classifiers as layered models: ``--model tv:NAME``.

``resnet18/34/50/101/152`` and ``wide_resnet50_2``: ``stem`` (conv, BN, ReLU, max-pool),
one layer per residual block (``layer1_0`` ...), ``head`` (pool, flatten, FC).
``vit_b_16``, ``vit_b_32``, ``vit_l_16``: ``embed`` (patch projection, class token,
position embedding), one layer per encoder block, ``head`` (final LayerNorm, the class
token through the heads). ``convnext_tiny/small/base``: the stem, every CNBlock, every
downsampling step, and the head, each its own layer.

Weights: torchvision's constructor with ``weights=None`` under the model seed (no pretrained
download, ever), or a local state-dict file: ``--model-arg weights=PATH`` (what
``torch.save(model.state_dict(), PATH)`` or ``dynpipe export --to torch`` writes). Other
settings: ``num_classes`` (default 1000) and ``image_size`` (default 224; the ViTs are
built for it, the CNNs take any size of at least 32).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dynpipe.errors import UserError
from dynpipe.models.base import InputSpec, LayeredModel
from dynpipe.models.cut import Part, SequentialPart, SourceCache, layered_from_source

__all__ = ["TV_MODELS", "tv_model"]

_RESNETS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "wide_resnet50_2")
_VITS = ("vit_b_16", "vit_b_32", "vit_l_16")
_CONVNEXTS = ("convnext_tiny", "convnext_small", "convnext_base")
TV_MODELS = _RESNETS + _VITS + _CONVNEXTS
_CACHES: dict[str, SourceCache] = {}
_LOCK = threading.Lock()


class _ResNetHead(Part):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.avgpool(x), 1))


class _ViTEmbed(Part):
    """Patch projection, class token and position embedding: the work of torchvision's
    ``_process_input``, the token concatenation and the encoder's first two steps."""

    def __init__(self, source: nn.Module, paths: dict[str, str]) -> None:
        super().__init__(source, {"conv_proj": "conv_proj", "dropout": "encoder.dropout"})
        self.class_token = source.class_token
        self.pos_embedding = source.encoder.pos_embedding
        self.source_paths.update(class_token="class_token", pos_embedding="encoder.pos_embedding")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        x = self.conv_proj(x)
        x = x.reshape(n, x.shape[1], -1).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        return self.dropout(x + self.pos_embedding)


class _ViTBlock(Part):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The attention's batch-first output is a transposed view and the residual sum
        # keeps its strides: what crosses a stage boundary must be contiguous to be sent.
        return self.block(x).contiguous()


class _ViTHead(Part):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads(self.ln(x)[:, 0])


def _source(name: str, *, num_classes: int, image_size: int, weights: str | None, seed: int):
    try:
        import torchvision
    except ModuleNotFoundError:
        raise UserError(
            "tv: models need torchvision; install it with pip install -e '.[vision]'"
        ) from None
    factory = getattr(torchvision.models, name)
    kwargs: dict[str, Any] = {"weights": None, "num_classes": num_classes}
    if name in _VITS:
        kwargs["image_size"] = image_size

    def load(kind: str) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with torch.device(kind):
                module = factory(**kwargs)
        if kind == "cpu" and weights is not None:
            _load_weights(module, weights, name)
        return module.train()

    return load


def _load_weights(module: nn.Module, path: str, name: str) -> None:
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(
            f"tv:{name} weights={path}: no such file; give a state dict torch.save wrote"
        )
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # a file torch cannot read: its reason, on one line
        raise UserError(
            f"tv:{name} weights={path}: cannot read it as a state dict: {exc}"
        ) from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    own = module.state_dict()
    for key, value in state.items():
        if key in own and tuple(value.shape) != tuple(own[key].shape):
            raise UserError(
                f"tv:{name} weights={path}: {key} has shape {list(value.shape)} but the model's "
                f"is {list(own[key].shape)}; check num_classes / image_size against the file"
            )
    missing = [k for k in own if k not in state]
    if missing:
        raise UserError(
            f"tv:{name} weights={path} lacks {len(missing)} of the model's tensors (e.g. "
            f"{missing[0]}); it is not a {name} state dict"
        )
    module.load_state_dict(state, strict=False)


def _seq(**paths: str) -> Callable[[nn.Module], nn.Module]:
    return lambda source: SequentialPart(source, paths)


def _pieces(name: str, meta: nn.Module) -> list[tuple[str, str, Callable[[nn.Module], nn.Module]]]:
    pieces: list[tuple[str, str, Callable[[nn.Module], nn.Module]]] = []
    if name in _RESNETS:
        pieces.append(
            ("stem", "conv", _seq(conv1="conv1", bn1="bn1", relu="relu", maxpool="maxpool"))
        )
        for stage in ("layer1", "layer2", "layer3", "layer4"):
            for i in range(len(getattr(meta, stage))):
                # The kinds are the ones the shipped predictors know (a one-hot feature):
                # a residual conv block is the zoo resnet's "bottleneck".
                pieces.append((f"{stage}_{i}", "bottleneck", _seq(block=f"{stage}.{i}")))
        head = _ResNetHead
        pieces.append(("head", "linear", lambda s: head(s, {"avgpool": "avgpool", "fc": "fc"})))
    elif name in _VITS:
        pieces.append(("embed", "embedding", lambda s: _ViTEmbed(s, {})))
        width = max(2, len(str(len(meta.encoder.layers) - 1)))
        # torchvision names them encoder_layer_0 ...: the paths come from the module.
        for i, (child, _) in enumerate(meta.encoder.layers.named_children()):
            path = f"encoder.layers.{child}"
            pieces.append(
                (f"block{i:0{width}d}", "transformer", lambda s, p=path: _ViTBlock(s, {"block": p}))
            )
        pieces.append(
            ("head", "linear", lambda s: _ViTHead(s, {"ln": "encoder.ln", "heads": "heads"}))
        )
    else:  # convnext: features = [stem, stage, downsample, stage, ...]
        for j, feature in enumerate(meta.features):
            if j % 2 == 0:
                pieces.append((f"features_{j}", "conv", _seq(block=f"features.{j}")))
                continue
            for i in range(len(feature)):
                pieces.append((f"features_{j}_{i}", "conv", _seq(block=f"features.{j}.{i}")))
        pieces.append(("head", "linear", _seq(avgpool="avgpool", classifier="classifier")))
    return pieces


def tv_model(
    name: str,
    *,
    num_classes: int = 1000,
    image_size: int = 224,
    weights: str | None = None,
    seed: int = 0,
) -> LayeredModel:
    """The torchvision classifier ``name`` cut at block granularity (module docstring)."""
    if name not in TV_MODELS:
        raise UserError(
            f"torchvision model {name!r} is not supported; supported: {', '.join(TV_MODELS)}"
        )
    if num_classes < 1 or image_size < 32:
        raise UserError(
            f"tv:{name} needs num_classes >= 1 and image_size >= 32; got num_classes="
            f"{num_classes} image_size={image_size}"
        )
    if name in _VITS:
        patch = int(name.rsplit("_", 1)[1])
        if image_size % patch:
            raise UserError(
                f"tv:{name} takes images whose size is a multiple of its patch {patch}; got "
                f"image_size={image_size} (e.g. {max(patch, image_size // patch * patch)})"
            )
    key = json.dumps([name, num_classes, image_size, weights, seed])
    with _LOCK:
        if key not in _CACHES:
            _CACHES[key] = SourceCache(
                _source(name, num_classes=num_classes, image_size=image_size,
                        weights=weights, seed=seed)
            )  # fmt: skip
        cache = _CACHES[key]
    if weights is not None:
        cache.get("cpu")  # a bad file is refused now, before any process group
    return layered_from_source(
        name=f"tv:{name}",
        cache=cache,
        pieces=_pieces(name, cache.get("meta")),
        loss_fn=F.cross_entropy,
        input_spec=InputSpec(shape=(3, image_size, image_size), num_classes=num_classes),
        seed=seed,
        config={
            "source": f"tv:{name}",
            "seed": seed,
            "fields": {
                "num_classes": num_classes,
                "image_size": image_size,
                **({"weights": weights} if weights else {}),
            },
        },
    )
