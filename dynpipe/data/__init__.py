"""Data sources: deterministic batches addressed by step (see ``base``).

    source = get_data("text", path="input.txt")
    model = get_model("gpt", **source.model_kwargs("gpt"))
    source = get_data("text", path="input.txt", model=model, seed=0)
    x, y = source.batch(step, batch_size)

Sources: ``synthetic`` (shaped to any model), ``digits`` (scikit-learn, bundled: flat
features for an mlp, augmented images at the model's size for a conv net),
``cifar10`` and ``imagefolder`` (local folders, through torchvision), ``text`` (a local
file as bytes), ``pystdlib`` (this Python's own standard library sources as bytes: real
text on any machine with Python). Nothing is ever downloaded.

Each has a ``train`` and a held-out ``test`` split (``get_data(..., split="test")``), which
``dynpipe train --eval-every`` evaluates on.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from dynpipe.data.base import SPLITS, BatchSource, IndexedSource, derive_seed, generator
from dynpipe.errors import UserError
from dynpipe.models.base import LayeredModel

__all__ = [
    "SOURCES",
    "SPLITS",
    "BatchSource",
    "IndexedSource",
    "derive_seed",
    "generator",
    "get_data",
]


def _no_path(name: str, path: str | None) -> None:
    if path is not None:
        raise UserError(f"{name} data is not read from disk; drop the data path {path!r}")


def _need_path(name: str, path: str | None, what: str) -> None:
    # Checked here, before the source looks at the path, so that a forgotten --data-path
    # names the flag instead of complaining that None is not a file.
    if path is None:
        raise UserError(f"--data {name} needs --data-path {what}; nothing is downloaded")


def _token_task(model: LayeredModel | None, default: str) -> str:
    if model is None:
        return default
    from dynpipe.data.synthetic import token_task

    return token_task(model)


def _image_size(model: LayeredModel | None, default: int) -> int:
    if model is not None and len(model.input_spec.shape) == 3:
        return int(model.input_spec.shape[-1])
    return default


def _synthetic(
    *,
    model: LayeredModel | None,
    path: str | None,
    seed: int,
    split: str = "train",
    task: str = "auto",
    noise: float = 0.05,
    mask_prob: float = 0.15,
) -> BatchSource:
    from dynpipe.data.synthetic import SyntheticSource

    _no_path("synthetic", path)
    spec = model.input_spec if model is not None else None
    if (
        task == "auto"
        and spec is not None
        and not spec.dtype.is_floating_point
        and spec.target_shape == spec.shape
    ):
        task = _token_task(model, "lm")
    return SyntheticSource(
        spec,
        task=task,
        seed=seed,
        noise=noise,
        mask_prob=mask_prob,
        model_name=model.name if model is not None else "",
        split=split,
    )


def _digits(
    *,
    model: LayeredModel | None,
    path: str | None,
    seed: int,
    split: str = "train",
    image_size: int | None = None,
    augment: bool | None = None,
) -> BatchSource:
    from dynpipe.data.digits import DigitsImageSource, DigitsSource

    _no_path("digits", path)
    # The model picks the form: images for one that takes (C, H, W), else flat features.
    spec = model.input_spec if model is not None else None
    if spec is not None and len(spec.shape) == 3:
        c, h, w = (int(d) for d in spec.shape)
        size = (h, w) if image_size is None else image_size
        return DigitsImageSource(
            split=split, seed=seed, image_size=size, channels=c, augment=augment
        )
    if image_size is not None:
        return DigitsImageSource(split=split, seed=seed, image_size=image_size, augment=augment)
    if augment:
        raise UserError(
            "digits augmentation applies to images; give image_size (or an image model) "
            "or drop augment"
        )
    return DigitsSource(split=split, seed=seed)


def _cifar10(
    *,
    model: LayeredModel | None,
    path: str | None,
    seed: int,
    split: str = "train",
    image_size: int | None = None,
    augment: bool | None = None,
) -> BatchSource:
    from dynpipe.data.vision import Cifar10Source

    _need_path("cifar10", path, "DIR (a folder holding cifar-10-batches-py/)")
    size = image_size or _image_size(model, 32)
    return Cifar10Source(path=path, split=split, image_size=size, augment=augment, seed=seed)


def _imagefolder(
    *,
    model: LayeredModel | None,
    path: str | None,
    seed: int,
    split: str = "train",
    image_size: int | None = None,
    augment: bool = False,
) -> BatchSource:
    from dynpipe.data.vision import ImageFolderSource

    _need_path("imagefolder", path, "DIR (one sub-folder of images per class)")
    size = image_size or _image_size(model, 224)
    return ImageFolderSource(path=path, split=split, image_size=size, augment=augment, seed=seed)


def _token_options(
    model: LayeredModel | None, seq_len: int | None, task: str | None
) -> dict[str, Any]:
    from dynpipe.data.text import BYTE_VOCAB

    spec = model.input_spec if model is not None else None
    if seq_len is None:
        seq_len = int(spec.shape[0]) if spec is not None and len(spec.shape) == 1 else 256
    vocab = spec.vocab if spec is not None and spec.vocab is not None else BYTE_VOCAB
    opts = {"seq_len": seq_len, "task": task or _token_task(model, "lm"), "vocab": vocab}
    # A model loaded from a folder with its own tokenizer (hf:PATH) reads text through it.
    tokenizer = model.config.get("tokenizer") if model is not None else None
    return {**opts, "tokenizer": tokenizer} if tokenizer else opts


def _text(
    *,
    model: LayeredModel | None,
    path: str | None,
    seed: int,
    split: str = "train",
    seq_len: int | None = None,
    task: str | None = None,
    mask_prob: float = 0.15,
) -> BatchSource:
    from dynpipe.data.text import TextSource

    _need_path("text", path, "FILE (a local text file, one token per byte)")
    return TextSource(
        path=path,
        split=split,
        mask_prob=mask_prob,
        seed=seed,
        **_token_options(model, seq_len, task),
    )


def _pystdlib(
    *,
    model: LayeredModel | None,
    path: str | None,
    seed: int,
    split: str = "train",
    seq_len: int | None = None,
    task: str | None = None,
    mask_prob: float = 0.15,
) -> BatchSource:
    from dynpipe.data.text import PyStdlibSource

    _no_path("pystdlib", path)
    return PyStdlibSource(
        split=split, mask_prob=mask_prob, seed=seed, **_token_options(model, seq_len, task)
    )


SOURCES: dict[str, Callable[..., BatchSource]] = {
    "synthetic": _synthetic,
    "digits": _digits,
    "cifar10": _cifar10,
    "imagefolder": _imagefolder,
    "text": _text,
    "pystdlib": _pystdlib,
}


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_fits(source: Any, model: LayeredModel) -> None:
    spec = model.input_spec
    shape = getattr(source, "sample_shape", None)
    if shape is None:
        return
    tokens = source.name in ("text", "pystdlib")
    if tokens == spec.dtype.is_floating_point or tuple(shape) != tuple(spec.shape):
        kind = "tokens" if tokens else "features"
        raise UserError(
            f"{source.name} gives {kind} of shape {tuple(shape)} but {model.name} expects "
            f"{spec.dtype} inputs of shape {tuple(spec.shape)}; build the model with "
            f"{source.model_kwargs(model.name)}"
        )
    classes = getattr(source, "num_classes", None)
    if classes is not None and spec.num_classes is not None and spec.num_classes < classes:
        raise UserError(
            f"{source.name} has {classes} classes but {model.name} has num_classes="
            f"{spec.num_classes}; build it with num_classes={classes}"
        )


def get_data(
    name: str,
    *,
    model: LayeredModel | None = None,
    path: str | None = None,
    seed: int = 0,
    split: str = "train",
    model_args: Mapping[str, Any] | None = None,
    **options: Any,
) -> BatchSource:
    """The data source ``name``, shaped to ``model`` when given (shapes are checked).

    split: ``train``, or ``test`` for the held-out samples evaluation reads.
    model_args: the keyword config the model will be built with, for a source made before
    its model (to ask it for ``model_kwargs``): a ``seq_len`` there sizes token windows.
    """
    if name not in SOURCES:
        raise UserError(f"unknown data {name!r}; choose one of {', '.join(SOURCES)}")
    factory = SOURCES[name]
    allowed = [
        p
        for p in inspect.signature(factory).parameters
        if p not in ("model", "path", "seed", "split")
    ]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise UserError(
            f"{name} data takes no option {', '.join(unknown)}; its options are "
            f"{', '.join(allowed) or 'none'}"
        )
    if split not in SPLITS:
        raise UserError(
            f"{name} data has splits {', '.join(SPLITS)} (test: held out); got split={split!r}"
        )
    seq_len = (model_args or {}).get("seq_len")
    if model is None and "seq_len" in allowed and _positive_int(seq_len):
        # Without this a probe cuts windows of the default seq_len and may call a corpus
        # too short that fits the model asked for (a bad value is left to the model to name).
        options.setdefault("seq_len", seq_len)
    source = factory(model=model, path=path, seed=seed, split=split, **options)
    if model is not None:
        _check_fits(source, model)
    return source
