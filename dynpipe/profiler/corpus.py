"""The profile corpus: many architectures, profiled by one command, for the slowdown predictor.

A per-layer slowdown model learns how *work* slows down (matmuls, convolutions, depthwise
convolutions, attention, normalisation, elementwise chains of every size), not how three
models slow down. The corpus therefore spans architectures whose layers differ in kind and
size: the zoo (mlp, vgg16, resnet50, gpt, bert), Hugging Face decoders and encoders built
from their configs (``hf:gpt2``, ``hf:llama``, ``hf:bert``, ``hf:vit``), torchvision's ConvNeXt,
and three built here from configs: MobileNetV3-Small and EfficientNet-B0 (depthwise and
squeeze-excitation blocks, from torchvision's builders) and an MLP-Mixer.

    dynpipe profile corpus OUT --device cuda:0 --seconds 480      # reduced, ~8 minutes
    dynpipe profile corpus OUT --device cuda:0                    # full: 15 conditions, 3 batches
    dynpipe profile corpus OUT --device cpu --size tiny --cores 0 --seconds 900

Each architecture goes to its own ``OUT/<card>-<arch>.parquet`` through ``dynpipe profile``
in a child process, so one that fails (a missing library, an out-of-memory) costs only its
own file, and a killed one leaves every window it finished (the files are rewritten
atomically per window; re-running resumes). ``--seconds`` splits a time budget evenly over
the architectures; with less than ``QUICK_BELOW_S`` the reduced sweep and the first two
batch sizes are used. Every file names its card, driver and torch in its metadata.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dynpipe.errors import UserError

__all__ = [
    "CORPUS",
    "QUICK_BELOW_S",
    "Architecture",
    "efficientnet_b0",
    "mixer",
    "mobilenet_v3_small",
    "plan_corpus",
    "run_corpus",
]

# A total budget below this many seconds uses the reduced sweep and two batch sizes.
QUICK_BELOW_S = 1800.0


@dataclass(frozen=True)
class Architecture:
    """One corpus entry: the ``--model`` spec and its settings per size."""

    name: str
    model: str
    gpu: dict[str, Any] = field(default_factory=dict)
    tiny: dict[str, Any] = field(default_factory=dict)
    needs: str | None = None  # optional library: transformers, torchvision


_IMG = {"image_size": 224, "num_classes": 1000}
_HERE = "dynpipe.profiler.corpus"
CORPUS: tuple[Architecture, ...] = (
    Architecture("mlp", "mlp", {"width": 4096, "in_features": 4096, "depth": 8}, {"width": 256, "in_features": 256, "depth": 4}),
    Architecture("vgg16", "vgg16", _IMG, {"image_size": 32, "width_mult": 0.25}),
    Architecture("resnet50", "resnet50", _IMG, {"image_size": 32, "width_mult": 0.25}),
    Architecture("gpt", "gpt", {"seq_len": 512}, {"depth": 2, "width": 128, "heads": 4, "seq_len": 64}),
    Architecture("bert", "bert", {"seq_len": 512}, {"depth": 2, "width": 128, "heads": 4, "seq_len": 64}),
    Architecture(
        "hf-gpt2", "hf:gpt2", {"seq_len": 512},
        {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 256, "seq_len": 64},
        needs="transformers",
    ),
    Architecture(
        "hf-llama", "hf:llama",
        {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
         "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000, "seq_len": 512},
        {"hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "seq_len": 64},
        needs="transformers",
    ),
    Architecture(
        "hf-bert", "hf:bert", {"seq_len": 512},
        {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 256, "seq_len": 64},
        needs="transformers",
    ),
    Architecture(
        "hf-vit", "hf:vit", {},
        {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "image_size": 32, "patch_size": 8},
        needs="transformers",
    ),
    Architecture("convnext", "tv:convnext_tiny", {"image_size": 224}, {"image_size": 32}, needs="torchvision"),
    Architecture("mobilenet", f"{_HERE}:mobilenet_v3_small", {"image_size": 224}, {"image_size": 64}, needs="torchvision"),
    Architecture("efficientnet", f"{_HERE}:efficientnet_b0", {"image_size": 224}, {"image_size": 64}, needs="torchvision"),
    Architecture("mixer", f"{_HERE}:mixer", {"image_size": 224, "patch": 16, "width": 512, "depth": 8}, {"image_size": 32, "patch": 4, "width": 128, "depth": 4}),
)  # fmt: skip
BATCH_SIZES = {"gpu": (16, 32, 64), "tiny": (4, 8, 16)}
SWEEPS = {
    ("gpu", False): "recipes/sweeps/gpu.toml",
    ("gpu", True): "recipes/sweeps/gpu-corpus-quick.toml",
    ("tiny", False): "recipes/sweeps/cpu.toml",
    ("tiny", True): "recipes/sweeps/cpu-corpus-quick.toml",
}


class _Flatten(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(x, 1)


def _tv_features(name: str, build: Any, *, image_size: int, num_classes: int, seed: int):
    """A torchvision ``features`` + ``avgpool`` + ``classifier`` network cut per feature block."""
    from dynpipe.models import InputSpec, from_module

    if image_size < 32:
        raise ValueError(f"{name} needs image_size >= 32, got {image_size}")
    torch.manual_seed(seed)
    net = build(weights=None, num_classes=num_classes)
    return from_module(
        net,
        blocks="features",
        after=["avgpool", _Flatten(), "classifier"],
        input_spec=InputSpec(shape=(3, image_size, image_size), num_classes=num_classes),
        name=name,
        seed=seed,
    )


def mobilenet_v3_small(*, image_size: int = 224, num_classes: int = 1000, seed: int = 0):
    """torchvision's MobileNetV3-Small (random init): depthwise convolutions, hard-swish,
    squeeze-excitation; one layer per inverted-residual block."""
    from torchvision.models import mobilenet_v3_small as build

    return _tv_features(
        "mobilenet_v3_small", build, image_size=image_size, num_classes=num_classes, seed=seed
    )


def efficientnet_b0(*, image_size: int = 224, num_classes: int = 1000, seed: int = 0):
    """torchvision's EfficientNet-B0 (random init): MBConv stages with depthwise convolutions
    and squeeze-excitation; one layer per stage."""
    from torchvision.models import efficientnet_b0 as build

    return _tv_features(
        "efficientnet_b0", build, image_size=image_size, num_classes=num_classes, seed=seed
    )


class _MixerBlock(nn.Module):
    def __init__(self, tokens: int, width: int, token_hidden: int, channel_hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.token_mlp = nn.Sequential(
            nn.Linear(tokens, token_hidden), nn.GELU(), nn.Linear(token_hidden, tokens)
        )
        self.norm2 = nn.LayerNorm(width)
        self.channel_mlp = nn.Sequential(
            nn.Linear(width, channel_hidden), nn.GELU(), nn.Linear(channel_hidden, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class _Patches(nn.Module):
    def __init__(self, patch: int, width: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, width, kernel_size=patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class _MixerHead(nn.Module):
    def __init__(self, width: int, num_classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).mean(dim=1))


class _Mixer(nn.Module):
    def __init__(self, *, image_size: int, patch: int, width: int, depth: int, num_classes: int):
        super().__init__()
        tokens = (image_size // patch) ** 2
        self.stem = _Patches(patch, width)
        self.blocks = nn.ModuleList(
            _MixerBlock(tokens, width, token_hidden=width // 2, channel_hidden=4 * width)
            for _ in range(depth)
        )
        self.head = _MixerHead(width, num_classes)


def mixer(
    *,
    image_size: int = 224,
    patch: int = 16,
    width: int = 512,
    depth: int = 8,
    num_classes: int = 1000,
    seed: int = 0,
):
    """An MLP-Mixer (Tolstikhin et al. 2021; S/16 at the defaults, 8 blocks): patch
    projection, blocks of token-mixing and channel-mixing MLPs, pooled head."""
    from dynpipe.models import InputSpec, from_module

    if image_size % patch or depth < 1 or width < 2:
        raise ValueError(
            f"mixer needs image_size a multiple of patch, depth >= 1, width >= 2; got "
            f"image_size={image_size} patch={patch} depth={depth} width={width}"
        )
    torch.manual_seed(seed)
    net = _Mixer(
        image_size=image_size, patch=patch, width=width, depth=depth, num_classes=num_classes
    )
    return from_module(
        net,
        blocks="blocks",
        before=["stem"],
        after=["head"],
        input_spec=InputSpec(shape=(3, image_size, image_size), num_classes=num_classes),
        name="mixer",
        seed=seed,
    )


def _available(arch: Architecture) -> str | None:
    """Why ``arch`` cannot be built here (a missing library), or ``None``."""
    if arch.needs is None:
        return None
    import importlib.util

    if importlib.util.find_spec(arch.needs) is None:
        return f"needs {arch.needs} (pip install -e '.[hf,vision]')"
    try:  # torchvision built for another torch fails on import, not on find_spec
        __import__(arch.needs)
    except Exception as exc:  # any import failure means this architecture is skipped
        return f"{arch.needs} does not import: {str(exc).splitlines()[0][:80]}"
    return None


def _slug(device_name: str) -> str:
    m = re.findall(r"[a-z]+[0-9]{2,4}[a-z]*", device_name.lower())
    m = [s for s in m if s not in ("nvidia", "geforce", "rtx", "tesla")]
    return m[0] if m else "cpu"


def plan_corpus(
    *,
    size: str,
    seconds: float | None,
    only: list[str] | None = None,
    batch_sizes: tuple[int, ...] | None = None,
) -> tuple[list[Architecture], tuple[int, ...], str, float | None]:
    """The architectures, batch sizes, sweep file and per-architecture time limit of a run."""
    if size not in ("gpu", "tiny"):
        raise UserError(f"--size {size!r}: choose gpu (full-size models) or tiny (CPU checks)")
    archs = list(CORPUS)
    if only:
        known = {a.name for a in CORPUS}
        bad = [n for n in only if n not in known]
        if bad:
            raise UserError(
                f"--only {bad[0]!r} is not a corpus architecture; choose from {', '.join(sorted(known))}"
            )
        archs = [a for a in CORPUS if a.name in only]
    quick = seconds is not None and seconds < QUICK_BELOW_S
    sizes = batch_sizes or BATCH_SIZES[size][: 2 if quick else 3]
    per_arch = None if seconds is None else max(30.0, seconds / len(archs))
    return archs, tuple(sizes), SWEEPS[(size, quick)], per_arch


def _settings(config: dict[str, Any]) -> list[str]:
    return [x for k, v in config.items() for x in ("--set", f"{k}={v}")]


def run_corpus(args: argparse.Namespace) -> int:
    """``dynpipe profile corpus``: profile every corpus architecture into ``args.out``."""
    archs, sizes, sweep, per_arch = plan_corpus(
        size=args.size,
        seconds=args.seconds,
        only=[s for s in (args.only or "").split(",") if s] or None,
        batch_sizes=tuple(int(b) for b in args.batch_sizes.split(","))
        if args.batch_sizes
        else None,
    )
    sweep = args.sweep or sweep
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(
                f"--device {args.device} but torch sees no CUDA device; use --device cpu --size tiny"
            )
        card = torch.cuda.get_device_name(torch.device(args.device).index or 0)
    else:
        from dynpipe.profiler.sweep import device_info

        card = device_info("cpu")["device_name"]
    slug = _slug(card) if args.device.startswith("cuda") else "cpu"
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    t0 = time.monotonic()
    log: list[dict[str, Any]] = []
    print(
        f"corpus: {len(archs)} architectures x batch {','.join(map(str, sizes))} on {card} "
        f"(torch {torch.__version__}), sweep {sweep}, "
        + (f"{per_arch:.0f} s each" if per_arch else "no time limit"),
        flush=True,
    )
    for arch in archs:
        why = _available(arch)
        path = out / f"{slug}-{arch.name}.parquet"
        if why:
            print(f"  {arch.name}: skipped, {why}", flush=True)
            log.append({"arch": arch.name, "status": "skipped", "why": why})
            continue
        config = arch.gpu if args.size == "gpu" else arch.tiny
        cmd = [
            sys.executable, "-m", "dynpipe", "profile", "--model", arch.model,
            *_settings(config), "--batch-size", ",".join(map(str, sizes)),
            "--sweep", sweep, "--device", args.device, "--dtype", dtype, "-o", str(path), "--quiet",
        ]  # fmt: skip
        if args.cores:
            cmd += ["--cores", args.cores]
        if args.repeats:
            cmd += ["--repeats", str(args.repeats)]
        if args.sample_ms:
            cmd += ["--sample-ms", str(args.sample_ms)]
        start = time.monotonic()
        print(f"  {arch.name}: {shlex.join(cmd[2:])}", flush=True)
        proc = subprocess.Popen(cmd, env={**os.environ})
        try:
            rc = proc.wait(timeout=per_arch)
            status = "ok" if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            # SIGTERM: the profiler unwinds as on Ctrl-C, stops its interferers and keeps
            # every window it finished.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            status = f"budget ({per_arch:.0f} s) reached"
        took = time.monotonic() - start
        print(f"  {arch.name}: {status} in {took:.0f} s -> {path}", flush=True)
        log.append(
            {"arch": arch.name, "status": status, "seconds": round(took, 1), "path": str(path)}
        )
    (out / "corpus.json").write_text(
        json.dumps(
            {
                "card": card,
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "size": args.size,
                "batch_sizes": list(sizes),
                "sweep": sweep,
                "seconds": round(time.monotonic() - t0, 1),
                "runs": log,
            },
            indent=2,
        )
    )
    done = [r for r in log if r["status"] != "skipped" and Path(r["path"]).exists()]
    print(
        f"corpus: {len(done)} of {len(archs)} architectures written to {out} in {time.monotonic() - t0:.0f} s"
    )
    return 0 if done else 1
