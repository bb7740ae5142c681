"""What every data source is: a pure function from (seed, step, batch size) to a batch.

Every rank of a pipeline asks for the batch of the same ``step`` and gets the same tensors,
with no communication and no iterator state: the position in the data *is* the step, so a
run resumed or repartitioned at step ``s`` continues with exactly the data it would have
seen. Finite datasets are read in a fresh seeded permutation each epoch; sample ``p`` of
the stream (``p = step * batch_size + j``) is sample ``p mod N`` of epoch ``p // N``'s
permutation, so a batch may straddle two epochs.

Every source has two splits: ``train`` and ``test``, the held-out samples evaluation reads
(``dynpipe train --eval-every``). A batch is a pure function of ``(seed, split, step,
batch_size)``; the two splits never share a sample (an endless synthetic stream draws its
test samples from a generator of their own, from the same distribution).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Protocol, runtime_checkable

import torch

from dynpipe.errors import UserError

SPLITS = ("train", "test")  # test: the held-out split evaluation reads

__all__ = [
    "SPLITS",
    "BatchSource",
    "IndexedSource",
    "check_batch_args",
    "check_split",
    "derive_seed",
    "generator",
    "zoo_model_kwargs",
]


@runtime_checkable
class BatchSource(Protocol):
    """The runtime's view of a data set."""

    name: str
    split: str  # "train" or "test" (held out)
    num_samples: int | None  # samples per epoch; None for an endless synthetic stream

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` on the CPU; a pure function of ``(seed, step, batch_size)``."""
        ...

    def model_kwargs(self, model_name: str) -> dict:
        """Config a zoo model needs to fit this data (e.g. ``{"num_classes": 10}``)."""
        ...


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed mixed from ``parts``; unrelated part tuples give unrelated seeds."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def generator(*parts: int | str) -> torch.Generator:
    """A CPU generator seeded from ``parts`` (never the global RNG: ranks must agree)."""
    return torch.Generator().manual_seed(derive_seed(*parts))


def check_batch_args(name: str, step: int, batch_size: int) -> None:
    if step < 0 or batch_size < 1:
        raise UserError(
            f"{name}: batch needs step >= 0 and batch_size >= 1, got step={step} "
            f"batch_size={batch_size}"
        )


def check_split(name: str, split: str) -> None:
    if split not in SPLITS:
        raise UserError(
            f"{name} split must be one of {', '.join(SPLITS)} (test: held out), got {split!r}"
        )


def zoo_model_kwargs(source: str, model_name: str, *, fits: dict[str, dict], gives: str) -> dict:
    """``fits[model_name]`` for a zoo model that can take this data.

    A zoo model that cannot take it is a one-line error; a model outside the zoo (a user's
    factory, under whatever name) gets ``{}``: ``get_data(model=...)`` checks its shapes.
    """
    if model_name in fits:
        return dict(fits[model_name])
    from dynpipe.models import ZOO, load_zoo

    load_zoo()
    if model_name in ZOO:
        raise UserError(
            f"{source} gives {gives}, which {model_name} cannot take; use --model "
            f"{' or '.join(fits)} or your own package.module:factory model"
        )
    return {}


class IndexedSource:
    """A finite data set of ``num_samples`` samples read in a seeded permutation per epoch.

    Subclasses set ``name`` and implement ``_fetch(ids, gen)``: the samples with those
    indices, where ``gen`` is seeded by ``(seed, split, step)`` for augmentation or masking.
    ``num_samples`` counts the samples of this source's ``split`` only.
    """

    name: str = "indexed"
    _CACHED_EPOCHS = 2  # a batch straddles at most two epochs

    def __init__(self, *, num_samples: int, seed: int, split: str = "train") -> None:
        check_split(self.name, split)
        if num_samples < 1:
            raise UserError(f"{self.name}: the {split} split is empty")
        self.num_samples: int | None = num_samples
        self.seed = seed
        self.split = split
        self._perms: OrderedDict[int, torch.Tensor] = OrderedDict()

    def _generator(self, *parts: int | str) -> torch.Generator:
        # The training split keeps the seeds it always had, so its batches do not change.
        where = (self.name,) if self.split == "train" else (self.name, self.split)
        return generator(self.seed, *where, *parts)

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = self._generator("epoch", epoch)
            self._perms[epoch] = torch.randperm(self._n, generator=g)
            while len(self._perms) > self._CACHED_EPOCHS:
                self._perms.popitem(last=False)
        return self._perms[epoch]

    def __getstate__(self) -> dict:
        # Pickled to loader workers (see ``loader``): caches are rebuilt there, not shipped.
        return {**self.__dict__, "_perms": OrderedDict()}

    @property
    def _n(self) -> int:
        assert self.num_samples is not None
        return self.num_samples

    def indices(self, step: int, batch_size: int) -> torch.Tensor:
        """Indices (into the data set) of the samples in batch ``step``."""
        check_batch_args(self.name, step, batch_size)
        pos = torch.arange(step * batch_size, (step + 1) * batch_size)
        epoch, offset = pos // self._n, pos % self._n
        ids = torch.empty_like(pos)
        for e in epoch.unique().tolist():
            sel = epoch == e
            ids[sel] = self._perm(int(e))[offset[sel]]
        return ids

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.indices(step, batch_size)
        return self._fetch(ids, self._generator("step", step, batch_size))

    def _fetch(self, ids: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.split}, {self.num_samples} samples, seed={self.seed})"
