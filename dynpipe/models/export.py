"""``dynpipe export``: a checkpoint's trained weights back in the format the model came in.

``--to hf OUT``: a Hugging Face folder (``config.json`` + safetensors, and the source
folder's tokenizer files when it had them) that ``AutoModelFor*.from_pretrained(OUT)``
loads, for a model trained as ``hf:PATH`` or ``hf:ARCH``. ``--to torch OUT.pt``: the source
module's own state dict (``torch.save``), for any model cut from a module (``tv:`` models
load it with ``--model-arg weights=OUT.pt``; a ``from_module`` user loads it into their
module with ``load_state_dict``).

The checkpoint is read in this one process, under no plan: its keys are layer names, so it
does not matter how many stages wrote it. Tied copies are equal in every checkpoint (the
runtime keeps them so); the export writes the primary copy under both source names.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from dynpipe.errors import UserError

__all__ = ["AUTO_CLASSES", "export_checkpoint", "main_class", "register", "trained_model"]

# The task of an hf: model -> the transformers Auto class that loads an export of it.
AUTO_CLASSES = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "image-classification": "AutoModelForImageClassification",
}

FORMATS = ("hf", "torch")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "generation_config.json",
)


def trained_model(checkpoint: str | Path) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The layered model a checkpoint was written for, its trained state
    (``"<layer>.<param>"``) and the checkpoint's metadata."""
    import torch

    from dynpipe.models import get_model
    from dynpipe.runtime.checkpoint import find_checkpoint, load_checkpoint, read_marker

    info = read_marker(find_checkpoint(checkpoint))
    meta = info.meta
    name, conf = meta.get("model"), meta.get("model_config")
    if not name or not isinstance(conf, dict) or "source_paths" not in conf:
        raise UserError(
            f"checkpoint {info.path} does not record a model cut from a source module (it "
            f"was written for {name or 'an unnamed model'}); export needs an hf: or tv: model "
            "trained by this version of dynpipe train"
        )
    kwargs = {**conf.get("fields", {}), "seed": conf.get("seed", 0)}
    if conf.get("seq_len") is not None:
        kwargs["seq_len"] = conf["seq_len"]
    model = get_model(name, **kwargs)
    if model.fingerprint() != meta.get("model_fingerprint", model.fingerprint()):
        raise UserError(
            f"checkpoint {info.path} was written for model {meta.get('model_fingerprint')} but "
            f"{name} now builds {model.fingerprint()}; export with the files it was trained from"
        )
    shapes = model.build_sequential(device="meta").state_dict()
    state = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in shapes.items()}
    # A 2bw run's trained model is its newest weight version, saved beside the optimizer
    # state (``dynpipe.runtime.twobw``); its parameters are the stash, one update behind.
    twobw = (meta.get("plan") or {}).get("schedule") == "2bw"
    optim, _ = load_checkpoint(
        info.path, model_state=state, held_params=set(state) if twobw else set(), rank=0
    )
    if twobw:
        from dynpipe.runtime.twobw import split_newest

        for pname, value in split_newest(optim)[1].items():
            state[pname].copy_(value)
    return model, state, meta


def main_class(model: Any) -> str:
    """The ``AutoModelFor*`` class name that loads an ``hf:`` model's export."""
    return AUTO_CLASSES[model.config["task"]]


def export_checkpoint(checkpoint: str | Path, *, to: str, out: str | Path) -> Path:
    """Write the trained weights of ``checkpoint`` to ``out`` in format ``to``."""
    import torch

    from dynpipe.models.cut import source_state

    if to not in FORMATS:
        raise UserError(f"unknown export format {to!r}; use one of {', '.join(FORMATS)}")
    model, state, _ = trained_model(checkpoint)
    for group in model.ties:  # equal by construction; a mismatch means a corrupt save
        for name in group[1:]:
            if not torch.equal(state[group[0]], state[name]):
                raise UserError(
                    f"checkpoint {checkpoint}: tied copies {group[0]} and {name} differ; it "
                    "was not written by a run that kept them tied"
                )
    weights = source_state(model, state)
    out = Path(out)
    if to == "torch":
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(weights, out)
        return out
    if not model.name.startswith("hf:"):
        raise UserError(
            f"--to hf needs a model trained as hf:PATH or hf:ARCH, not {model.name}; use "
            "--to torch for a state dict"
        )
    from dynpipe.models.hf import source_module

    hf = source_module(model)
    missing, _ = hf.load_state_dict(weights, strict=False)
    tied = {k for group in model.ties for k in source_state(model, dict.fromkeys(group))}
    missing = [k for k in missing if k not in tied]
    if missing:
        raise UserError(
            f"checkpoint {checkpoint} lacks {len(missing)} of {type(hf).__name__}'s tensors "
            f"(e.g. {missing[0]}); it was written for another model"
        )
    hf.save_pretrained(str(out))
    src = Path(model.name.removeprefix("hf:")).expanduser()
    if src.is_dir():
        for fname in _TOKENIZER_FILES:
            if (src / fname).is_file():
                shutil.copy2(src / fname, out / fname)
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint's weights as a Hugging Face folder or a state dict",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder, or a --save-dir")
    p.add_argument(
        "--to",
        nargs=2,
        metavar=("FORMAT", "OUT"),
        required=True,
        help="hf OUT_DIR (save_pretrained folder) or torch OUT.pt (source state dict)",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    fmt, out = args.to
    path = export_checkpoint(args.checkpoint, to=fmt, out=out)
    print(f"wrote {path} ({fmt})")
    return 0
