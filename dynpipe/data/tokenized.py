"""Text through a model's own tokenizer: the ``tokenizer.json`` of a Hugging Face folder.

Read with the ``tokenizers`` library from the local file only (no network, no hub lookup).
The corpus is encoded once per process and split into windows as the byte sources cut
bytes; ids outside the model's vocabulary are refused.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

from dynpipe.errors import UserError

__all__ = ["encode"]


@functools.lru_cache(maxsize=4)
def _encode_cached(tokenizer: str, digest: str, text: str) -> np.ndarray:
    try:
        from tokenizers import Tokenizer
    except ModuleNotFoundError:
        raise UserError(
            "reading text through a model's tokenizer needs the tokenizers package; install "
            "it with pip install -e '.[hf]'"
        ) from None
    try:
        tok = Tokenizer.from_file(tokenizer)
    except Exception as exc:  # a file the library cannot parse: its reason, on one line
        raise UserError(f"cannot read tokenizer {tokenizer}: {exc}") from None
    # Long corpora are encoded line by line: one call on megabytes of text is slow and its
    # pre-tokenizer would see no line structure anyway.
    lines = text.splitlines(keepends=True)
    ids: list[int] = []
    for enc in tok.encode_batch(lines, add_special_tokens=False):
        ids.extend(enc.ids)
    return np.asarray(ids, dtype=np.int64)


def encode(tokenizer: str, data: bytes, *, vocab: int, where: str) -> np.ndarray:
    """Token ids of ``data`` (UTF-8; undecodable bytes replaced) under ``tokenizer``."""
    text = data.decode("utf-8", errors="replace")
    ids = _encode_cached(tokenizer, hashlib.blake2b(data, digest_size=8).hexdigest(), text)
    if ids.size and int(ids.max()) >= vocab:
        raise UserError(
            f"{where}: tokenizer {tokenizer} gives id {int(ids.max())} but the model's vocab is "
            f"{vocab}; use the tokenizer saved with the model or a model with vocab_size > "
            f"{int(ids.max())}"
        )
    return ids
