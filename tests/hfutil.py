"""Tiny Hugging Face models saved into a test's folder (no network), and a plain HF loop."""

from __future__ import annotations

from pathlib import Path

import torch

SEQ = 16
NO_DROP = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
TINY = {
    "gpt2": {
        "n_embd": 64, "n_layer": 3, "n_head": 4, "vocab_size": 96, "n_positions": 32,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
    },
    "llama": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96,
        "max_position_embeddings": 32, "tie_word_embeddings": True,
    },
    "bert": {
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 96, "max_position_embeddings": 32, **NO_DROP,
    },
    "vit": {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "image_size": 32, "patch_size": 16, "num_labels": 10,
        **NO_DROP,
    },
}  # fmt: skip


def save_tiny(arch: str, folder: Path, *, seed: int = 5) -> Path:
    """A tiny ``arch`` model with HF's own init under ``seed``, saved by save_pretrained."""
    from dynpipe.models.hf import hf_classes

    conf_cls, cls, _ = hf_classes(arch)
    torch.manual_seed(seed)
    model = cls(conf_cls(**TINY[arch]))
    out = folder / arch
    model.save_pretrained(out)
    return out


def hf_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x) if x.dtype == torch.long else model(pixel_values=x)
    return out.logits
