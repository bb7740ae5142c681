"""Hugging Face models as layered models: ``--model hf:PATH`` or ``--model hf:ARCH``.

``hf:PATH``: a local directory as ``save_pretrained`` writes it (``config.json`` and
``*.safetensors``). ``hf:ARCH``: a fresh model of a supported architecture from its config
alone (``--model-arg hidden_size=64 ...`` sets config fields), initialised by Hugging Face's
own initialisation under the model seed. Nothing is ever downloaded.

Families and their layers (``cut.Part``s over the Hugging Face module):

- ``gpt2``: ``embed`` (token + position embeddings, dropout), ``block00``..., ``head``
  (final LayerNorm + LM head).
- ``llama``, ``qwen2``, ``mistral`` (same layout): ``embed``, ``block00``... (each block
  recomputes the rotary embedding from the sequence length), ``head`` (RMSNorm + LM head).
- ``bert``: masked language modelling (``BertForMaskedLM``; the data sources mask tokens
  and set unmasked targets to -100): ``embed``, ``block00``..., ``head`` (the MLM head).
- ``vit``: image classification (``ViTForImageClassification``): ``embed`` (patches, CLS
  token, positions), ``block00``..., ``head`` (LayerNorm, classifier on the CLS token).

Only the hidden states cross a stage boundary. Attention runs through PyTorch's SDPA with no
mask tensor: causal models pass ``is_causal`` (dynpipe's batches have no padding), encoders
attend everywhere; the rotary tables are recomputed inside each block from the sequence
length. Shipping masks or position tables between stages would multiply what crosses a
boundary and tie every stage to the first one's bookkeeping; recomputing them costs one small
elementwise kernel per block.

A tied embedding and output projection (``tie_word_embeddings``) becomes a tie of the
layered model: the ``embed`` and ``head`` layers each hold a copy, kept equal by summing
their gradients every step (``dynpipe.runtime.ties``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dynpipe.errors import UserError
from dynpipe.models.base import InputSpec, LayeredModel
from dynpipe.models.bert import mlm_cross_entropy
from dynpipe.models.cut import Part, SequentialPart, SourceCache, layered_from_source
from dynpipe.models.gpt import lm_cross_entropy

__all__ = ["ARCHS", "hf_classes", "hf_config", "hf_model", "load_source", "source_module"]

# model_type -> (config class, model class, task). The model class is what is trained and
# what ``dynpipe export`` writes back (``AutoModelFor*`` of the task loads it).
ARCHS: dict[str, tuple[str, str, str]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "causal-lm"),
    "llama": ("LlamaConfig", "LlamaForCausalLM", "causal-lm"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "causal-lm"),
    "mistral": ("MistralConfig", "MistralForCausalLM", "causal-lm"),
    "bert": ("BertConfig", "BertForMaskedLM", "masked-lm"),
    "vit": ("ViTConfig", "ViTForImageClassification", "image-classification"),
}
# dynpipe's own names for config fields (what the data sources ask for: ``vocab=256``).
_ALIASES = {"vocab": "vocab_size", "num_classes": "num_labels"}
_DEFAULT_SEQ_LEN = 128
_CACHES: dict[str, SourceCache] = {}
_CACHES_LOCK = threading.Lock()


def _transformers() -> Any:
    try:
        import transformers
    except ModuleNotFoundError:
        raise UserError(
            "hf: models need transformers, safetensors and tokenizers; install them with "
            "pip install -e '.[hf]'"
        ) from None
    # Loading a local folder is instant; a bar per load would bury the run's own log.
    transformers.utils.logging.disable_progress_bar()
    return transformers


def hf_classes(model_type: str) -> tuple[type, type, str]:
    """The config class, model class and task of a supported ``model_type``."""
    if model_type not in ARCHS:
        raise UserError(
            f"Hugging Face architecture {model_type!r} is not supported; supported: "
            f"{', '.join(ARCHS)} (give hf:ARCH or a local directory saved from one of them)"
        )
    tf = _transformers()
    conf, cls, task = ARCHS[model_type]
    return getattr(tf, conf), getattr(tf, cls), task


def _check_fields(spec: str, config: Any, fields: dict[str, Any]) -> None:
    known = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    unknown = sorted(k for k in fields if k not in known)
    if unknown:
        some = ", ".join(sorted(k for k in known if not k.startswith("_"))[:10])
        raise UserError(
            f"hf:{spec}: the {config.model_type} config has no field {unknown[0]!r}; "
            f"set fields it has (e.g. {some}) or seq_len / seed"
        )


def hf_config(spec: str, **overrides: Any) -> Any:
    """The Hugging Face config of ``spec`` (a local directory or an architecture name), with
    ``overrides`` applied to its fields; unknown fields are refused."""
    path = Path(spec).expanduser()
    overrides = {_ALIASES.get(k, k): v for k, v in overrides.items()}
    if spec in ARCHS and not path.is_dir():
        conf_cls, _, _ = hf_classes(spec)
        _check_fields(spec, conf_cls(), overrides)
        # Fields go to the constructor, which derives others from them (Llama's head_dim).
        config = conf_cls(**overrides)
    elif path.is_dir() or "/" in spec or spec.startswith("."):
        if not path.is_dir():
            raise UserError(f"hf:{spec}: no such directory; give a folder save_pretrained wrote")
        file = path / "config.json"
        if not file.is_file():
            raise UserError(
                f"hf:{spec} has no config.json; give a folder written by save_pretrained "
                "(config.json + *.safetensors) or an architecture: "
                f"{', '.join(ARCHS)}"
            )
        try:
            model_type = json.loads(file.read_text()).get("model_type")
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"hf:{spec}: cannot read config.json: {exc}") from None
        conf_cls, _, _ = hf_classes(str(model_type))
        base = conf_cls.from_pretrained(str(path), local_files_only=True)
        _check_fields(spec, base, overrides)
        config = (
            conf_cls.from_pretrained(str(path), local_files_only=True, **overrides)
            if overrides
            else base
        )
    else:
        raise UserError(
            f"hf:{spec} is neither a local directory nor a supported architecture; "
            f"supported: {', '.join(ARCHS)} (nothing is downloaded)"
        )
    config._attn_implementation = "sdpa"  # mask-free attention: see the module docstring
    return config


def _build_hf(config: Any, *, seed: int, device: str) -> nn.Module:
    _, cls, _ = hf_classes(config.model_type)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = cls(config)
    return model.float().train()


def _safetensor_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(
            f"hf:{path} has config.json but no *.safetensors weights; save the model with "
            "save_pretrained (safetensors is its default) or give an architecture name for a "
            "fresh model"
        )
    return files


def check_shapes(path: Path, meta: nn.Module) -> None:
    """Refuse stored tensors whose shapes differ from the model's (read from the files'
    headers only), naming the tensor and both shapes."""
    from safetensors import safe_open

    own = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    for file in _safetensor_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shape = tuple(f.get_slice(key).get_shape())
                if key in own and shape != own[key]:
                    raise UserError(
                        f"hf:{path}: {key} in {file.name} has shape {list(shape)} but the "
                        f"config gives {list(own[key])}; the weights were saved from another "
                        "config (check config.json and any --model-arg)"
                    )


def load_source(path: Path, config: Any, *, seed: int) -> nn.Module:
    """The Hugging Face model of ``config`` with the weights of the directory ``path``.

    Loaded by ``from_pretrained``, which knows each release's renamed keys (``hf_model``
    has checked the stored shapes first: ``check_shapes``).
    """
    _, cls, _ = hf_classes(config.model_type)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # tensors the files lack are initialised: the same everywhere
            model = cls.from_pretrained(
                str(path), config=config, local_files_only=True, attn_implementation="sdpa"
            )
    except (OSError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"hf:{path}: cannot load its weights: {first}") from None
    return model.float().train()


def _cache(spec: str, config: Any, seed: int) -> SourceCache:
    key = json.dumps([spec, config.to_json_string(), seed])
    with _CACHES_LOCK:
        if key not in _CACHES:
            path = Path(spec).expanduser()
            local = path.is_dir()

            def load(kind: str) -> nn.Module:
                if kind == "meta":
                    return _build_hf(config, seed=seed, device="meta")
                if local:
                    return load_source(path, config, seed=seed)
                return _build_hf(config, seed=seed, device="cpu")

            _CACHES[key] = SourceCache(load)
        return _CACHES[key]


# ---- the families' layers ------------------------------------------------------------------
class _GPT2Embed(Part):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class _RotaryBlock(Part):
    """A Llama-layout decoder layer with its own copy of the rotary embedding (no weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        cos_sin = self.rotary(x, pos)
        out = self.block(x, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out


class _ViTHead(Part):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.layernorm(x)[:, 0, :])


def _part(part_cls: type[Part], /, **paths: str) -> Callable[[nn.Module], nn.Module]:
    return lambda source: part_cls(source, paths)


# Where each family keeps its blocks; releases of transformers have renamed some
# (ViT's ``vit.encoder.layer`` is ``vit.layers`` in 5.x): the first that exists is used.
_BLOCKS = {
    "gpt2": ("transformer.h",),
    "llama": ("model.layers",),
    "bert": ("bert.encoder.layer", "bert.layers"),
    "vit": ("vit.layers", "vit.encoder.layer"),
}


def _blocks_path(model_type: str, source: nn.Module) -> str:
    family = model_type if model_type in _BLOCKS else "llama"
    for path in _BLOCKS[family]:
        try:
            source.get_submodule(path)
            return path
        except AttributeError:
            continue
    raise UserError(
        f"{type(source).__name__} keeps its blocks in none of {', '.join(_BLOCKS[family])} in "
        "this transformers release; cut it with dynpipe.models.from_module(blocks=...)"
    )


def _pieces(
    model_type: str, depth: int, source: nn.Module
) -> list[tuple[str, str, Callable[[nn.Module], nn.Module]]]:
    width = max(2, len(str(depth - 1)))
    at = _blocks_path(model_type, source)
    names = [f"block{i:0{width}d}" for i in range(depth)]
    if model_type == "gpt2":
        embed = _part(_GPT2Embed, wte="transformer.wte", wpe="transformer.wpe",
                      drop="transformer.drop")  # fmt: skip
        blocks = [_part(SequentialPart, block=f"{at}.{i}") for i in range(depth)]
        head = _part(SequentialPart, ln_f="transformer.ln_f", lm_head="lm_head")
    elif model_type in ("llama", "qwen2", "mistral"):
        embed = _part(SequentialPart, embed_tokens="model.embed_tokens")
        blocks = [
            _part(_RotaryBlock, block=f"{at}.{i}", rotary="model.rotary_emb") for i in range(depth)
        ]
        head = _part(SequentialPart, norm="model.norm", lm_head="lm_head")
    elif model_type == "bert":
        embed = _part(SequentialPart, embeddings="bert.embeddings")
        blocks = [_part(SequentialPart, block=f"{at}.{i}") for i in range(depth)]
        head = _part(SequentialPart, cls="cls")
    else:  # vit
        embed = _part(SequentialPart, embeddings="vit.embeddings")
        blocks = [_part(SequentialPart, block=f"{at}.{i}") for i in range(depth)]
        head = _part(_ViTHead, layernorm="vit.layernorm", classifier="classifier")
    kind = "transformer"
    return [
        ("embed", "embedding", embed),
        *[(n, kind, b) for n, b in zip(names, blocks, strict=True)],
        ("head", "linear", head),
    ]


def _max_positions(config: Any) -> int | None:
    for key in ("max_position_embeddings", "n_positions"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    return None


def hf_model(
    spec: str, *, seq_len: int | None = None, seed: int = 0, **fields: Any
) -> LayeredModel:
    """The layered model ``hf:spec`` (see the module docstring).

    seq_len: tokens per sample for text models (default the smaller of 128 and the
        config's position limit). Other keywords set config fields.
    """
    config = hf_config(spec, **fields)
    _, cls, task = hf_classes(config.model_type)
    depth = int(config.num_hidden_layers)
    if depth < 1:
        raise UserError(f"hf:{spec} has num_hidden_layers={depth}; it needs at least 1")
    if task == "image-classification":
        size, chans = int(config.image_size), int(config.num_channels)
        spec_in = InputSpec(shape=(chans, size, size), num_classes=int(config.num_labels))
        loss: Callable[..., torch.Tensor] = F.cross_entropy
    else:
        limit = _max_positions(config)
        if seq_len is None:
            seq_len = min(_DEFAULT_SEQ_LEN, limit or _DEFAULT_SEQ_LEN)
        if seq_len < 1 or (limit is not None and seq_len > limit):
            raise UserError(
                f"hf:{spec} seq_len={seq_len} is outside 1..{limit} (the config's position "
                f"limit); pass --model-arg seq_len=N with N <= {limit}"
            )
        spec_in = InputSpec(
            shape=(seq_len,),
            dtype=torch.long,
            target_shape=(seq_len,),
            vocab=int(config.vocab_size),
        )
        loss = lm_cross_entropy if task == "causal-lm" else mlm_cross_entropy
    cache = _cache(spec, config, seed)
    if Path(spec).expanduser().is_dir():
        check_shapes(Path(spec).expanduser(), cache.get("meta"))
    return layered_from_source(
        name=f"hf:{spec}",
        cache=cache,
        pieces=_pieces(config.model_type, depth, cache.get("meta")),
        loss_fn=loss,
        input_spec=spec_in,
        seed=seed,
        config={
            "source": f"hf:{spec}",
            "hf_model_type": config.model_type,
            "hf_class": cls.__name__,
            "task": task,
            "seq_len": seq_len,
            "seed": seed,
            "fields": dict(fields),
            **_tokenizer(spec),
        },
    )


def _tokenizer(spec: str) -> dict[str, str]:
    """``{"tokenizer": PATH}`` when a local model folder has a fast-tokenizer file."""
    file = Path(spec).expanduser() / "tokenizer.json"
    return {"tokenizer": str(file.resolve())} if file.is_file() else {}


def source_module(model: LayeredModel) -> nn.Module:
    """The Hugging Face model a layered ``hf:`` model was cut from, with its current
    initial weights (a fresh instance: the caller may load trained weights into it)."""
    spec = model.config["source"].removeprefix("hf:")
    config = hf_config(spec, **model.config.get("fields", {}))
    path = Path(spec).expanduser()
    if path.is_dir():
        return load_source(path, config, seed=model.seed)
    return _build_hf(config, seed=model.seed, device="cpu")
