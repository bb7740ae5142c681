"""``gpt``: a decoder-only transformer (GPT-2 style, pre-LayerNorm, causal attention).

Layers: ``embed`` (token + learned position embeddings), ``block00`` ... and ``head``
(final LayerNorm + projection to the vocabulary). The head is *not* tied to the token
embedding: pipeline stages own disjoint weights, and a tied weight would live on two.
The transformer pieces here are shared with ``bert``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dynpipe.errors import UserError
from dynpipe.models.base import InputSpec, LayeredModel, LayerSpec
from dynpipe.models.registry import register

__all__ = [
    "Block",
    "Embedding",
    "SelfAttention",
    "check_transformer_config",
    "gpt",
    "lm_cross_entropy",
    "normal_init",
]


class Embedding(nn.Module):
    """Token plus learned absolute position embedding, optionally LayerNorm'd (BERT)."""

    def __init__(
        self, vocab: int, width: int, seq_len: int, *, dropout: float, norm: bool = False
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq_len, width)
        self.norm = nn.LayerNorm(width) if norm else None
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.pos.num_embeddings:
            raise ValueError(
                f"sequence of {t} tokens is longer than the model's seq_len "
                f"{self.pos.num_embeddings}; cut the input or build the model with seq_len>={t}"
            )
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        if self.norm is not None:
            x = self.norm(x)
        return self.drop(x)


class SelfAttention(nn.Module):
    """Multi-head self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, width: int, heads: int, *, causal: bool, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.dropout = dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=self.causal
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Attention + MLP with residuals; pre-LN (GPT-2) or post-LN (original BERT)."""

    def __init__(
        self,
        width: int,
        heads: int,
        *,
        mlp_ratio: int,
        causal: bool,
        pre_norm: bool,
        dropout: float,
    ) -> None:
        super().__init__()
        self.pre_norm = pre_norm
        self.ln1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads, causal=causal, dropout=dropout)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, mlp_ratio * width)
        self.act = nn.GELU()
        self.proj = nn.Linear(mlp_ratio * width, width)
        self.drop = nn.Dropout(dropout)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.drop(self.attn(self.ln1(x)))
            return x + self._mlp(self.ln2(x))
        x = self.ln1(x + self.drop(self.attn(x)))
        return self.ln2(x + self._mlp(x))


class _LMHead(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def normal_init(module: nn.Module, *, std: float = 0.02) -> nn.Module:
    """N(0, std) for Linear and Embedding weights, zero biases (GPT-2 / BERT)."""
    for m in module.modules():
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, 0.0, std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
    return module


def lm_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token loss: mean cross-entropy over all (B*T) positions."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def check_transformer_config(
    name: str, *, depth: int, width: int, heads: int, seq_len: int, vocab: int
) -> None:
    """One-line errors for configurations a transformer cannot be built with."""
    if depth < 1 or width < 1 or heads < 1 or seq_len < 1 or vocab < 2:
        raise UserError(
            f"{name} needs depth, width, heads, seq_len >= 1 and vocab >= 2; got depth={depth} "
            f"width={width} heads={heads} seq_len={seq_len} vocab={vocab}"
        )
    if width % heads:
        raise UserError(
            f"{name} width {width} is not divisible by heads {heads}; pick heads dividing width "
            f"(e.g. heads={next(h for h in range(heads, 0, -1) if width % h == 0)})"
        )


def _block_builder(
    width: int, heads: int, *, mlp_ratio: int, dropout: float, depth: int
) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        block = normal_init(
            Block(width, heads, mlp_ratio=mlp_ratio, causal=True, pre_norm=True, dropout=dropout)
        )
        # GPT-2: projections that write into the residual stream are scaled by
        # 1/sqrt(2 * depth) so the stream's variance does not grow with depth.
        resid_std = 0.02 / math.sqrt(2 * depth)
        nn.init.normal_(block.attn.proj.weight, 0.0, resid_std)
        nn.init.normal_(block.proj.weight, 0.0, resid_std)
        return block

    return build


@register("gpt")
def gpt(
    *,
    depth: int = 12,
    width: int = 768,
    heads: int = 12,
    seq_len: int = 256,
    vocab: int = 256,
    mlp_ratio: int = 4,
    dropout: float = 0.0,
    seed: int = 0,
) -> LayeredModel:
    """GPT-2-style language model; the default vocabulary is bytes (256 tokens)."""
    check_transformer_config(
        "gpt", depth=depth, width=width, heads=heads, seq_len=seq_len, vocab=vocab
    )

    def embed() -> nn.Module:
        return normal_init(Embedding(vocab, width, seq_len, dropout=dropout))

    layers = [LayerSpec("embed", "embedding", embed)]
    for i in range(depth):
        build = _block_builder(width, heads, mlp_ratio=mlp_ratio, dropout=dropout, depth=depth)
        layers.append(LayerSpec(f"block{i:02d}", "transformer", build))
    layers.append(LayerSpec("head", "linear", lambda: normal_init(_LMHead(width, vocab))))
    return LayeredModel(
        name="gpt",
        layers=tuple(layers),
        loss_fn=lm_cross_entropy,
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
