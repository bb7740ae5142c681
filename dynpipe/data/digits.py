"""``digits``: scikit-learn's bundled 8x8 handwritten digits (1797 images, no download).

The form follows the model it feeds:

- 64 flat features (``mlp``, or any model taking ``(64,)``), standardised with the
  training split's per-pixel mean and standard deviation;
- images (``vgg16``, ``resnet50``, or any model taking ``(C, H, W)``): each digit resampled
  smoothly (bicubic) to the model's image size, the grey image repeated over its channels,
  standardised with the training split's pixel mean and standard deviation. Training
  images get a small random affine transform — rotation, scale, shift — drawn per sample
  from ``(seed, epoch, sample id)``, so a sample's image never depends on the batch size or
  on which process made it; held-out images are never augmented.

The train/test split (80/20; ``test`` is the held-out split) is fixed, independent of the
data seed and of the form, so changing the seed reshuffles the order but never moves a
sample between splits, and both forms read the samples in the same order.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from dynpipe.data.base import IndexedSource, check_split, zoo_model_kwargs
from dynpipe.errors import UserError

__all__ = ["DigitsImageSource", "DigitsSource"]

_TEST_FRACTION = 0.2
_SPLIT_SEED = 0
_SIDE = 8  # scikit-learn's digits are 8x8, ink 0..16
_INK = 16.0
# Training augmentation: small enough that every digit stays readable and inside the frame.
_MAX_ROTATION = math.radians(12)
_MAX_ZOOM = 0.1  # scale in [0.9, 1.1]
_MAX_SHIFT = 1.0  # pixels of the 8x8 digit, each way
# Images are resampled from 8x8 at most this size (bicubic, with the affine transform), then
# upsampled separably to the model's size: two small matrix products instead of a 16-tap
# resampling of every output pixel, which keeps a 256 x 224 x 224 batch within one core's
# reach per step of a GPU (bench/bench_loader.py --data digits).
_RESAMPLE_SIDE = 32


def _model_fits() -> dict[str, dict]:
    images = {"num_classes": 10}  # image_size stays the model's own (or --model-arg's)
    return {"mlp": {"in_features": 64, "num_classes": 10}, "vgg16": images, "resnet50": images}


@functools.lru_cache(maxsize=1)
def _load() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw images ``(1797, 8, 8)`` as float, labels, and the train and test indices."""
    from sklearn.datasets import load_digits

    x_np, y_np = load_digits(return_X_y=True)
    x = torch.as_tensor(x_np, dtype=torch.float32).view(-1, _SIDE, _SIDE)
    y = torch.as_tensor(y_np, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(_SPLIT_SEED))
    n_test = round(len(x) * _TEST_FRACTION)
    return x, y, order[n_test:], order[:n_test]


class DigitsSource(IndexedSource):
    """The digits as 64 flat features."""

    name = "digits"
    num_classes = 10
    sample_shape = (64,)

    def __init__(self, *, split: str = "train", seed: int = 0) -> None:
        check_split(self.name, split)
        images, y, train, test = _load()
        x = images.reshape(len(images), -1)
        mean = x[train].mean(dim=0)
        # A few border pixels are always 0 in the training split. Their training values stay
        # 0 whatever they are divided by; a held-out image inked there must not be divided
        # by a tiny std (logits in the thousands), so such pixels keep their raw scale.
        std = x[train].std(dim=0)
        std = torch.where(std > 0, std, torch.ones_like(std))
        keep = train if split == "train" else test
        self._x = ((x[keep] - mean) / std).contiguous()
        self._y = y[keep].contiguous()
        super().__init__(num_samples=len(keep), seed=seed, split=split)

    def _fetch(self, ids: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return self._x[ids], self._y[ids]

    def model_kwargs(self, model_name: str) -> dict:
        return zoo_model_kwargs(
            self.name, model_name, fits=_model_fits(), gives="64 flat features or images"
        )

    def __repr__(self) -> str:
        return f"DigitsSource({self.split}, {self.num_samples} samples, seed={self.seed})"


@functools.lru_cache(maxsize=8)
def _cubic_upsampler(n_in: int, n_out: int) -> torch.Tensor:
    """``[n_out, n_in]`` matrix of 1-d bicubic interpolation (``align_corners=False``)."""
    eye = torch.eye(n_in)[:, None, None, :]
    up = F.interpolate(eye, size=(1, n_out), mode="bicubic", align_corners=False)
    return up[:, 0, 0, :].T.contiguous()


class DigitsImageSource(IndexedSource):
    """The digits as ``(channels, height, width)`` images, augmented in training."""

    name = "digits"
    num_classes = 10

    def __init__(
        self,
        *,
        split: str = "train",
        seed: int = 0,
        image_size: int | tuple[int, int] = 32,
        channels: int = 3,
        augment: bool | None = None,
    ) -> None:
        check_split(self.name, split)
        h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
        if min(h, w) < 1 or channels < 1:
            raise UserError(
                f"digits images need a size >= 1 and channels >= 1, got {h}x{w} with "
                f"{channels} channels; give a positive image_size (8 or more keeps every "
                "pixel of the 8x8 digits)"
            )
        images, y, train, test = _load()
        raw = images[train] / _INK
        keep = train if split == "train" else test
        self._x = (images[keep] / _INK)[:, None].contiguous()  # (N, 1, 8, 8), ink 0..1
        self._y = y[keep].contiguous()
        # One mean and std for every pixel: the images are resampled and shifted, so a
        # per-pixel statistic of the 8x8 grid would have no fixed pixel to belong to.
        self._mean, self._std = float(raw.mean()), float(raw.std())
        self.image_size = (h, w)
        self.channels = channels
        self.augment = split == "train" if augment is None else augment
        self.sample_shape = (channels, h, w)
        super().__init__(num_samples=len(keep), seed=seed, split=split)

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.indices(step, batch_size)
        epochs = torch.arange(step * batch_size, (step + 1) * batch_size) // self._n
        return self._render(self._theta(ids, epochs), ids), self._y[ids]

    def _theta(self, ids: torch.Tensor, epochs: torch.Tensor) -> torch.Tensor:
        """Per-sample affine maps from output to input coordinates, ``(B, 2, 3)``."""
        b = len(ids)
        if not self.augment:
            return torch.eye(2, 3).expand(b, 2, 3)
        # One generator per (epoch, sample): the draw is the sample's own, whatever batch,
        # batch size or worker it lands in.
        u = torch.stack(
            [
                torch.rand(4, generator=self._generator("augment", e, i))
                for e, i in zip(epochs.tolist(), ids.tolist(), strict=True)
            ]
        )
        u = 2 * u - 1  # uniform in [-1, 1)
        angle = u[:, 0] * _MAX_ROTATION
        zoom = 1 + u[:, 1] * _MAX_ZOOM
        shift = u[:, 2:] * (2 * _MAX_SHIFT / _SIDE)  # normalised coordinates span 2
        cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
        return torch.stack(
            [
                torch.stack([cos, -sin, shift[:, 0]], dim=1),
                torch.stack([sin, cos, shift[:, 1]], dim=1),
            ],
            dim=1,
        )

    def _render(self, theta: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h, w = self.image_size
        sh, sw = min(h, _RESAMPLE_SIDE), min(w, _RESAMPLE_SIDE)
        b = len(ids)
        grid = F.affine_grid(theta, [b, 1, sh, sw], align_corners=False)
        # Outside the 8x8 frame is blank paper (ink 0); bicubic overshoot is clipped back.
        small = F.grid_sample(
            self._x[ids], grid, mode="bicubic", padding_mode="zeros", align_corners=False
        )[:, 0]
        small = (small.clamp_(0, 1) - self._mean) / self._std
        # Standardised before upsampling: the same, since every upsampler row sums to 1.
        if (sh, sw) != (h, w):
            small = _cubic_upsampler(sh, h) @ small @ _cubic_upsampler(sw, w).T
        # (A matmul into a channel of a preallocated batch, a strided output, ran 15x slower
        # on two threads than on one; a repeat of the contiguous product does not.)
        return small[:, None].repeat(1, self.channels, 1, 1)

    def model_kwargs(self, model_name: str) -> dict:
        h, w = self.image_size
        fits = {"vgg16": {"num_classes": 10}, "resnet50": {"num_classes": 10}}
        if h == w:
            fits = {name: {**kw, "image_size": h} for name, kw in fits.items()}
        return zoo_model_kwargs(self.name, model_name, fits=fits, gives=f"{h}x{w} images")

    def __repr__(self) -> str:
        shape = "x".join(map(str, self.sample_shape))
        augment = ", augmented" if self.augment else ""
        return (
            f"DigitsImageSource({self.split}, {self.num_samples} samples, {shape}{augment}, "
            f"seed={self.seed})"
        )
