"""``text``: a local text file as byte-level tokens (vocabulary 256, no tokenizer needed).

The file is cut into consecutive windows. For next-token prediction a window holds
``seq_len + 1`` bytes (inputs are the first ``seq_len``, targets the last ``seq_len``) and
windows start every ``seq_len`` bytes; for masked-LM a window is ``seq_len`` bytes, masked
per batch with a generator seeded by ``(seed, step)``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dynpipe.data.base import IndexedSource, zoo_model_kwargs
from dynpipe.data.masking import mask_tokens
from dynpipe.errors import UserError

__all__ = ["BYTE_VOCAB", "TextSource"]

BYTE_VOCAB = 256


def _map(path: str) -> np.ndarray:
    # Memory-mapped: a large corpus is paged in per batch, never held as int64.
    file = Path(path).expanduser()
    if file.stat().st_size == 0:
        return np.zeros(0, np.uint8)  # numpy cannot map an empty file
    return np.memmap(file, dtype=np.uint8, mode="r")


class TextSource(IndexedSource):
    name = "text"

    def __init__(
        self,
        *,
        path: str | None,
        seq_len: int = 256,
        task: str = "lm",
        vocab: int = BYTE_VOCAB,
        mask_prob: float = 0.15,
        seed: int = 0,
    ) -> None:
        if path is None or not Path(path).expanduser().is_file():
            raise UserError(
                f"text: {path!r} is not a file; give a local text file (read as UTF-8 bytes, "
                "one token per byte); nothing is downloaded"
            )
        if task not in ("lm", "mlm"):
            raise UserError(f"text task must be 'lm' or 'mlm', got {task!r}")
        if seq_len < 1:
            raise UserError(f"text seq_len must be >= 1, got {seq_len}")
        if vocab < BYTE_VOCAB:
            raise UserError(
                f"text is byte-level (256 tokens) but the model's vocab is {vocab}; "
                "build the model with vocab=256"
            )
        data = _map(path)
        window = seq_len + 1 if task == "lm" else seq_len
        n = (len(data) - window) // seq_len + 1 if len(data) >= window else 0
        if n < 1:
            raise UserError(
                f"text: {path} has {len(data)} bytes but one window of seq_len={seq_len} needs "
                f"{window}; use a longer file or a smaller seq_len"
            )
        self.path = str(path)
        self.seq_len = seq_len
        self.task = task
        self.vocab = vocab
        self.mask_prob = mask_prob
        self.sample_shape = (seq_len,)
        self._bytes = data
        self._window = window
        super().__init__(num_samples=n, seed=seed)

    def __getstate__(self) -> dict:
        # A memmap pickles as a copy of the whole file: loader workers map it themselves.
        return {**super().__getstate__(), "_bytes": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._bytes = _map(self.path)

    def _fetch(self, ids: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        rows = ids[:, None] * self.seq_len + torch.arange(self._window)
        seq = torch.from_numpy(self._bytes[rows.numpy()].astype(np.int64))
        if self.task == "lm":
            return seq[:, :-1], seq[:, 1:]
        return mask_tokens(seq, vocab=self.vocab, gen=gen, prob=self.mask_prob)

    def model_kwargs(self, model_name: str) -> dict:
        fits = {"gpt": {"vocab": BYTE_VOCAB}, "bert": {"vocab": BYTE_VOCAB}}
        return zoo_model_kwargs(self.name, model_name, fits=fits, gives="byte tokens")

    def __repr__(self) -> str:
        return (
            f"TextSource({self.path}, {self.task}, seq_len={self.seq_len}, "
            f"{self.num_samples} windows, seed={self.seed})"
        )
