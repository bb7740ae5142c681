"""BERT's masked-language-model corruption, done by the data source (the model only sees it).

Each position is chosen with probability ``prob`` (at least one per sequence, so the loss,
a mean over chosen positions, is always defined); a chosen token becomes the mask token
(80%), a random token (10%) or stays (10%). Targets are the original token at chosen
positions and -100 elsewhere. The mask token is ``vocab - 1``: for byte-level text that is
0xFF, a byte that never occurs in UTF-8.
"""

from __future__ import annotations

import torch

__all__ = ["IGNORE_INDEX", "mask_tokens"]

IGNORE_INDEX = -100


def mask_tokens(
    tokens: torch.Tensor, *, vocab: int, gen: torch.Generator, prob: float = 0.15
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(corrupted inputs, targets)`` for a ``(B, T)`` batch of token ids below ``vocab - 1``."""
    if not 0.0 < prob <= 1.0:
        raise ValueError(f"mask probability must be in (0, 1], got {prob}")
    b, t = tokens.shape
    chosen = torch.rand(b, t, generator=gen) < prob
    # A row with nothing chosen would give a 0/0 loss: choose one position there.
    empty = ~chosen.any(dim=1)
    forced = torch.randint(0, t, (b,), generator=gen)
    chosen[empty, forced[empty]] = True
    action = torch.rand(b, t, generator=gen)
    random_tok = torch.randint(0, vocab - 1, (b, t), generator=gen)
    inputs = tokens.clone()
    inputs = torch.where(chosen & (action < 0.8), torch.full_like(tokens, vocab - 1), inputs)
    inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_tok, inputs)
    targets = torch.where(chosen, tokens, torch.full_like(tokens, IGNORE_INDEX))
    return inputs, targets
