"""Byte-level text (vocabulary 256, no tokenizer needed): ``text`` and ``pystdlib``.

A corpus is cut into consecutive windows. For next-token prediction a window holds
``seq_len + 1`` bytes (inputs are the first ``seq_len``, targets the last ``seq_len``) and
windows start every ``seq_len`` bytes; for masked-LM a window is ``seq_len`` bytes, masked
per batch with a generator seeded by ``(seed, split, step)``.

- ``text``: a local file. Its last tenth (by bytes) is the held-out ``test`` split, the
  rest is ``train``: windows never cross the cut.
- ``pystdlib``: the ``.py`` files of this Python's standard library (``sysconfig``'s
  ``stdlib`` folder, without ``site-packages`` and the test suites), in sorted path order,
  concatenated. Real source text on any machine with Python, read from disk, never
  downloaded. The held-out split is by file: a file is held out when a hash of its path
  relative to the library folder falls in a fixed tenth, so a file's split is the same on
  every machine and Python version that has it. The corpus depends on the Python version;
  ``describe()`` (and the source's repr) names it, with the file count, bytes and a digest.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

from dynpipe.data.base import IndexedSource, check_split, derive_seed, zoo_model_kwargs
from dynpipe.data.masking import mask_tokens
from dynpipe.errors import UserError

__all__ = ["BYTE_VOCAB", "PyStdlibSource", "TextSource", "stdlib_files"]

BYTE_VOCAB = 256
_TEST_FRACTION = 0.1  # of a text file's bytes, or of the standard library's files
# Folders of the standard library that are not its own source: third-party packages and
# the test suites (their data files hold deliberately odd bytes and encodings).
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})


def _map(path: str) -> np.ndarray:
    # Memory-mapped: a large corpus is paged in per batch, never held as int64.
    file = Path(path).expanduser()
    if file.stat().st_size == 0:
        return np.zeros(0, np.uint8)  # numpy cannot map an empty file
    return np.memmap(file, dtype=np.uint8, mode="r")


class _ByteWindows(IndexedSource):
    """Windows over one split's bytes; subclasses supply the bytes (``_load``)."""

    name = "bytes"

    def __init__(
        self,
        *,
        split: str,
        seq_len: int,
        task: str,
        vocab: int,
        mask_prob: float,
        seed: int,
        tokenizer: str | None = None,
    ) -> None:
        check_split(self.name, split)
        if task not in ("lm", "mlm"):
            raise UserError(f"{self.name} task must be 'lm' or 'mlm', got {task!r}")
        if seq_len < 1:
            raise UserError(f"{self.name} seq_len must be >= 1, got {seq_len}")
        self.tokenizer = tokenizer
        if vocab < BYTE_VOCAB and tokenizer is None:
            raise UserError(
                f"{self.name} is byte-level (256 tokens) but the model's vocab is {vocab}; "
                "build the model with vocab=256"
            )
        self.split = split
        self.seq_len = seq_len
        self.task = task
        self.vocab = vocab
        self.mask_prob = mask_prob
        self.sample_shape = (seq_len,)
        self._window = seq_len + 1 if task == "lm" else seq_len
        self._bytes = self._tokens()
        n = len(self._bytes)
        windows = (n - self._window) // seq_len + 1 if n >= self._window else 0
        if windows < 1:
            raise UserError(
                f"{self.name}: {self._where()} has {n} bytes but one window of "
                f"seq_len={seq_len} needs {self._window}; use a longer corpus or a smaller "
                "seq_len"
            )
        super().__init__(num_samples=windows, seed=seed, split=split)

    def _load(self) -> np.ndarray:
        raise NotImplementedError

    def _tokens(self) -> np.ndarray:
        """The split's bytes, or with a tokenizer (``tokenizer.json`` of a model's folder)
        its token ids; windows are cut from either the same way."""
        data = self._load()
        if self.tokenizer is None:
            return data
        from dynpipe.data.tokenized import encode

        return encode(self.tokenizer, bytes(data), vocab=self.vocab, where=self.name)

    def _where(self) -> str:
        raise NotImplementedError

    def __getstate__(self) -> dict:
        # Pickled to loader workers: they load the bytes themselves (a memmap would pickle
        # as a copy of the whole file).
        return {**super().__getstate__(), "_bytes": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._bytes = self._tokens()

    def _fetch(self, ids: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        rows = ids[:, None] * self.seq_len + torch.arange(self._window)
        seq = torch.from_numpy(self._bytes[rows.numpy()].astype(np.int64))
        if self.task == "lm":
            return seq[:, :-1], seq[:, 1:]
        return mask_tokens(seq, vocab=self.vocab, gen=gen, prob=self.mask_prob)

    def model_kwargs(self, model_name: str) -> dict:
        fits = {"gpt": {"vocab": BYTE_VOCAB}, "bert": {"vocab": BYTE_VOCAB}}
        return zoo_model_kwargs(self.name, model_name, fits=fits, gives="byte tokens")


class TextSource(_ByteWindows):
    """A local file as bytes; its last tenth is held out."""

    name = "text"

    def __init__(
        self,
        *,
        path: str | None,
        split: str = "train",
        seq_len: int = 256,
        task: str = "lm",
        vocab: int = BYTE_VOCAB,
        mask_prob: float = 0.15,
        seed: int = 0,
        tokenizer: str | None = None,
    ) -> None:
        if path is None or not Path(path).expanduser().is_file():
            raise UserError(
                f"text: {path!r} is not a file; give a local text file (read as UTF-8 bytes, "
                "one token per byte); nothing is downloaded"
            )
        self.path = str(path)
        super().__init__(
            split=split, seq_len=seq_len, task=task, vocab=vocab, mask_prob=mask_prob, seed=seed,
            tokenizer=tokenizer,
        )  # fmt: skip

    def _cut(self, size: int) -> int:
        return size - int(size * _TEST_FRACTION)

    def _load(self) -> np.ndarray:
        data = _map(self.path)
        cut = self._cut(len(data))
        return data[:cut] if self.split == "train" else data[cut:]

    def _where(self) -> str:
        size = Path(self.path).expanduser().stat().st_size
        return f"the {self.split} split of {self.path} ({size} bytes; the last tenth is held out)"

    def __repr__(self) -> str:
        return (
            f"TextSource({self.path}, {self.split}, {self.task}, seq_len={self.seq_len}, "
            f"{self.num_samples} windows, seed={self.seed})"
        )


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The standard library's own ``.py`` files under ``root``, sorted by relative path."""
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in base.rglob("*.py")
        if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(base).parts[:-1])
    ]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def _held_out(relative: str) -> bool:
    return derive_seed("pystdlib", relative) % 1000 < 1000 * _TEST_FRACTION


class PyStdlibSource(_ByteWindows):
    """This Python's standard library sources as one byte corpus per split."""

    name = "pystdlib"

    def __init__(
        self,
        *,
        split: str = "train",
        seq_len: int = 256,
        task: str = "lm",
        vocab: int = BYTE_VOCAB,
        mask_prob: float = 0.15,
        seed: int = 0,
        root: str | None = None,
        tokenizer: str | None = None,
    ) -> None:
        self.root = str(root if root is not None else sysconfig.get_paths()["stdlib"])
        self.files = 0
        self.digest = ""
        super().__init__(
            split=split, seq_len=seq_len, task=task, vocab=vocab, mask_prob=mask_prob, seed=seed,
            tokenizer=tokenizer,
        )  # fmt: skip

    def _load(self) -> np.ndarray:
        base = Path(self.root)
        if not base.is_dir():
            raise UserError(
                f"pystdlib: the standard library folder {base} does not exist; this Python "
                "has no source files to read (use --data text --data-path FILE)"
            )
        want_test = self.split == "test"
        parts = []
        for p in stdlib_files(base):
            if _held_out(p.relative_to(base).as_posix()) == want_test:
                # One newline after each file, so the next file starts on a line of its own.
                parts.append(p.read_bytes() + b"\n")
        blob = b"".join(parts)
        self.files = len(parts)
        self.digest = hashlib.blake2b(blob, digest_size=8).hexdigest()
        return np.frombuffer(blob, dtype=np.uint8)

    def _where(self) -> str:
        return f"the {self.split} split of {self.root} ({self.files} files)"

    def describe(self) -> str:
        """What the corpus is, for logs: Python version, folder, files, bytes, digest."""
        return (
            f"Python {sys.version.split()[0]} standard library at {self.root}, {self.split} "
            f"split: {self.files} files, {len(self._bytes):,} bytes, blake2b {self.digest}"
        )

    def __repr__(self) -> str:
        return (
            f"PyStdlibSource({self.split}, {self.files} files, {len(self._bytes):,} bytes, "
            f"{self.task}, seq_len={self.seq_len}, {self.num_samples} windows, seed={self.seed})"
        )
