"""``cifar10`` and ``imagefolder``: images from a local folder, read through torchvision.

Nothing is downloaded: a missing folder is a one-line error saying what belongs there.
Images become float tensors normalised with the data set's usual channel mean and std.
Held-out split (``test``): CIFAR-10's own test batch; for an image folder, its ``val/`` (or
``test/``) sub-folder next to ``train/`` when it has them, else a fixed tenth of its images
(chosen independently of the data seed). Training augmentation (random crop with 4-pixel padding and horizontal flip for CIFAR-10,
horizontal flip for image folders) is drawn from a generator seeded by ``(seed, step)``, so
every rank still sees the same batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dynpipe.data.base import IndexedSource, check_split, generator, zoo_model_kwargs
from dynpipe.errors import UserError

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "Cifar10Source",
    "ImageFolderSource",
    "cifar_root",
    "normalize",
    "random_crop_flip",
]

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_HELD_OUT_DIRS = ("val", "test")  # an image folder's held-out sub-folder, next to train/
_TEST_FRACTION = 0.1  # held out of an image folder without one
_SPLIT_SEED = 0
_CIFAR_DIR = "cifar-10-batches-py"
_CIFAR_FILES = (
    "data_batch_1",
    "data_batch_2",
    "data_batch_3",
    "data_batch_4",
    "data_batch_5",
    "test_batch",
    "batches.meta",
)


def _torchvision(source: str) -> Any:
    try:
        import torchvision
    except ImportError:
        raise UserError(
            f"{source} data is read through torchvision, which is not installed; "
            "pip install 'dynpipe[vision]'"
        ) from None
    return torchvision


def normalize(x: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """``(x - mean) / std`` per channel of a ``(B, C, H, W)`` batch."""
    m = torch.tensor(mean, dtype=x.dtype).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype).view(1, -1, 1, 1)
    return (x - m) / s


def random_crop_flip(
    x: torch.Tensor, *, gen: torch.Generator, padding: int = 4, flip: bool = True
) -> torch.Tensor:
    """Per-sample random crop of a zero-padded ``(B, C, H, W)`` batch, then random h-flip."""
    b, _, h, w = x.shape
    if padding > 0:
        padded = F.pad(x, (padding, padding, padding, padding))
        dy = torch.randint(0, 2 * padding + 1, (b,), generator=gen)
        dx = torch.randint(0, 2 * padding + 1, (b,), generator=gen)
        rows = (dy[:, None] + torch.arange(h))[:, :, None]  # (B, H, 1)
        cols = (dx[:, None] + torch.arange(w))[:, None, :]  # (B, 1, W)
        nhwc = padded.permute(0, 2, 3, 1)
        x = nhwc[torch.arange(b)[:, None, None], rows, cols].permute(0, 3, 1, 2).contiguous()
    if flip:
        flips = torch.rand(b, generator=gen) < 0.5
        x = torch.where(flips[:, None, None, None], x.flip(-1), x)
    return x


def cifar_root(path: str | None) -> Path:
    """The folder holding ``cifar-10-batches-py/`` (``path`` may name either)."""
    if path is None:
        raise UserError(
            "cifar10 needs a data path: a folder holding cifar-10-batches-py/ (the CIFAR-10 "
            "python version); nothing is downloaded"
        )
    p = Path(path).expanduser()
    root = p.parent if p.name == _CIFAR_DIR else p
    missing = [f for f in _CIFAR_FILES if not (root / _CIFAR_DIR / f).is_file()]
    if missing:
        raise UserError(
            f"cifar10: {root / _CIFAR_DIR} lacks {', '.join(missing)}; put the extracted "
            "cifar-10-python.tar.gz there (cifar-10-batches-py/data_batch_1..5, test_batch, "
            "batches.meta); nothing is downloaded"
        )
    return root


class Cifar10Source(IndexedSource):
    """CIFAR-10 held in memory as uint8 (150 MB for the training split)."""

    name = "cifar10"
    num_classes = 10

    def __init__(
        self,
        *,
        path: str | None,
        split: str = "train",
        image_size: int = 32,
        augment: bool | None = None,
        seed: int = 0,
    ) -> None:
        check_split(self.name, split)
        root = cifar_root(path)
        tv = _torchvision("cifar10")
        try:
            ds = tv.datasets.CIFAR10(str(root), train=split == "train", download=False)
        except RuntimeError as exc:  # torchvision's integrity check
            raise UserError(f"cifar10: {root / _CIFAR_DIR} is unreadable ({exc})") from None
        self.image_size = image_size
        self.augment = split == "train" if augment is None else augment
        self.sample_shape = (3, image_size, image_size)
        self._x = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()  # N, C, H, W
        self._y = torch.as_tensor(ds.targets, dtype=torch.long)
        super().__init__(num_samples=len(self._y), seed=seed, split=split)

    def _fetch(self, ids: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = self._x[ids].float().div_(255)
        if self.augment:
            x = random_crop_flip(x, gen=gen)
        if self.image_size != x.shape[-1]:
            x = F.interpolate(
                x,
                size=(self.image_size, self.image_size),
                mode="bilinear",
                align_corners=False,
                antialias=self.image_size < x.shape[-1],
            )
        return normalize(x, CIFAR10_MEAN, CIFAR10_STD), self._y[ids]

    def model_kwargs(self, model_name: str) -> dict:
        return _image_kwargs(self.name, model_name, self.image_size, self.num_classes)


class ImageFolderSource(IndexedSource):
    """``root/<class>/<image>`` files decoded per batch, resized and centre-cropped.

    With ``root/train/`` and ``root/val/`` (or ``root/test/``), each split reads its own
    sub-folder; otherwise the held-out split is a fixed tenth of the images.
    """

    name = "imagefolder"

    def __init__(
        self,
        *,
        path: str | None,
        split: str = "train",
        image_size: int = 224,
        augment: bool = False,
        seed: int = 0,
    ) -> None:
        check_split(self.name, split)
        if path is None or not Path(path).expanduser().is_dir():
            raise UserError(
                f"imagefolder: {path!r} is not a folder; give a folder with one sub-folder of "
                "images per class (root/<class>/<image>.jpg); nothing is downloaded"
            )
        tv = _torchvision("imagefolder")
        t = tv.transforms
        # Resize the short side to 256/224 of the crop, then centre-crop: the ImageNet recipe.
        resize = round(image_size * 256 / 224)
        transform = t.Compose([t.Resize(resize), t.CenterCrop(image_size), t.ToTensor()])
        root = Path(path).expanduser()
        held = next((root / d for d in _HELD_OUT_DIRS if (root / d).is_dir()), None)
        split_dirs = (root / "train").is_dir() and held is not None
        folder = (root / "train" if split == "train" else held) if split_dirs else root
        assert folder is not None
        self._ds = _image_folder(tv, folder, transform)
        if split_dirs:
            classes = self._ds.classes
            train_classes = sorted(d.name for d in (root / "train").iterdir() if d.is_dir())
            if split != "train" and classes != train_classes:
                raise UserError(
                    f"imagefolder: {folder} has classes {classes[:5]}... but {root / 'train'} "
                    f"has {train_classes[:5]}...; give both splits the same class folders"
                )
            self._ids = torch.arange(len(self._ds))
        else:
            # A fixed tenth, whatever the data seed: a reseeded run never trains on test images.
            order = torch.randperm(len(self._ds), generator=generator(_SPLIT_SEED, "imagefolder"))
            n_test = max(1, round(len(order) * _TEST_FRACTION))
            self._ids = (order[n_test:] if split == "train" else order[:n_test]).sort().values
        self.path = str(root)
        self.image_size = image_size
        self.augment = augment and split == "train"
        self.num_classes = len(self._ds.classes)
        self.sample_shape = (3, image_size, image_size)
        super().__init__(num_samples=len(self._ids), seed=seed, split=split)

    def _fetch(self, ids: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        samples = [self._ds[i] for i in self._ids[ids].tolist()]
        x = torch.stack([img for img, _ in samples])
        y = torch.tensor([label for _, label in samples], dtype=torch.long)
        if self.augment:
            x = random_crop_flip(x, gen=gen, padding=0)
        return normalize(x, IMAGENET_MEAN, IMAGENET_STD), y

    def model_kwargs(self, model_name: str) -> dict:
        return _image_kwargs(self.name, model_name, self.image_size, self.num_classes)


def _image_folder(tv: Any, folder: Path, transform: Any) -> Any:
    try:
        return tv.datasets.ImageFolder(str(folder), transform=transform)
    except (FileNotFoundError, RuntimeError) as exc:
        raise UserError(f"imagefolder: cannot read {folder}: {exc}") from None


def _image_kwargs(source: str, model_name: str, image_size: int, num_classes: int) -> dict:
    kwargs = {"image_size": image_size, "num_classes": num_classes}
    fits = {"vgg16": kwargs, "resnet50": kwargs}
    gives = f"3x{image_size}x{image_size} images"
    return zoo_model_kwargs(source, model_name, fits=fits, gives=gives)
