"""``bert``: a BERT-style encoder trained with masked-language modelling.

Layers: ``embed`` (token + position embeddings, LayerNorm), ``block00`` ... (bidirectional
attention, post-LN as in the original BERT) and ``mlm_head`` (dense + GELU + LayerNorm +
projection to the vocabulary, not tied to the embedding so stages own disjoint weights).
There are no segment embeddings: the data sources feed single segments.

The masking is done by the data source: targets hold the original token at masked positions
and -100 everywhere else; the loss is the mean over masked positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dynpipe.models.base import InputSpec, LayeredModel, LayerSpec
from dynpipe.models.gpt import Block, Embedding, check_transformer_config, normal_init
from dynpipe.models.registry import register

__all__ = ["IGNORE_INDEX", "bert", "mlm_cross_entropy"]

IGNORE_INDEX = -100


class _MLMHead(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.dense = nn.Linear(width, width)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(width)
        self.decoder = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.act(self.dense(x))))


def mlm_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Masked-LM loss: mean cross-entropy over positions whose target is not -100."""
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX
    )


@register("bert")
def bert(
    *,
    depth: int = 12,
    width: int = 768,
    heads: int = 12,
    seq_len: int = 128,
    vocab: int = 256,
    mlp_ratio: int = 4,
    dropout: float = 0.0,
    seed: int = 0,
) -> LayeredModel:
    """BERT-base-shaped encoder; the default vocabulary is bytes, token ``vocab - 1`` masks."""
    check_transformer_config(
        "bert", depth=depth, width=width, heads=heads, seq_len=seq_len, vocab=vocab
    )

    def embed() -> nn.Module:
        return normal_init(Embedding(vocab, width, seq_len, dropout=dropout, norm=True))

    def block() -> nn.Module:
        return normal_init(
            Block(width, heads, mlp_ratio=mlp_ratio, causal=False, pre_norm=False, dropout=dropout)
        )

    layers = [LayerSpec("embed", "embedding", embed)]
    layers += [LayerSpec(f"block{i:02d}", "transformer", block) for i in range(depth)]
    layers.append(LayerSpec("mlm_head", "linear", lambda: normal_init(_MLMHead(width, vocab))))
    return LayeredModel(
        name="bert",
        layers=tuple(layers),
        loss_fn=mlm_cross_entropy,
        input_spec=InputSpec(
            shape=(seq_len,), dtype=torch.long, target_shape=(seq_len,), vocab=vocab
        ),
        seed=seed,
        config={
            "depth": depth,
            "width": width,
            "heads": heads,
            "seq_len": seq_len,
            "vocab": vocab,
            "mlp_ratio": mlp_ratio,
            "dropout": dropout,
            "seed": seed,
        },
    )
