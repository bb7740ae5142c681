"""``digits``: scikit-learn's bundled 8x8 handwritten digits (1797 images, no download).

Each image is 64 features, standardised with the training split's per-pixel mean and
standard deviation. The train/test split (80/20; ``test`` is the held-out split) is fixed,
independent of the data seed, so changing the seed reshuffles the order but never moves a
sample between splits.
"""

from __future__ import annotations

import torch

from dynpipe.data.base import IndexedSource, check_split, zoo_model_kwargs

__all__ = ["DigitsSource"]

_TEST_FRACTION = 0.2
_SPLIT_SEED = 0


class DigitsSource(IndexedSource):
    name = "digits"
    num_classes = 10
    sample_shape = (64,)

    def __init__(self, *, split: str = "train", seed: int = 0) -> None:
        from sklearn.datasets import load_digits

        check_split(self.name, split)
        x_np, y_np = load_digits(return_X_y=True)
        x = torch.as_tensor(x_np, dtype=torch.float32)
        y = torch.as_tensor(y_np, dtype=torch.long)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(_SPLIT_SEED))
        n_test = round(len(x) * _TEST_FRACTION)
        train, test = order[n_test:], order[:n_test]
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
        fits = {"mlp": {"in_features": 64, "num_classes": 10}}
        return zoo_model_kwargs(self.name, model_name, fits=fits, gives="64 flat features")

    def __repr__(self) -> str:
        return f"DigitsSource({self.split}, {self.num_samples} samples, seed={self.seed})"
