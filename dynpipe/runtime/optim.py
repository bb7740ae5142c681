"""Per-stage optimizers whose state is addressed by stable parameter names.

A stage's optimizer only ever sees its own layers' parameters. Because SGD and AdamW update
each parameter independently, per-stage optimizers compute exactly what one optimizer over
the whole model computes. Their state is exported and imported per parameter name
(``layer.param``), which is what checkpoints and live migration move.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from dynpipe.errors import UserError

__all__ = [
    "OptimConfig",
    "build_optimizer",
    "check_resumed_optim",
    "export_state",
    "import_state",
    "lr_at",
]

OPTIMIZERS = ("sgd", "adamw")
# Each optimizer's learning rate where none is given. AdamW is the default optimizer: plain
# SGD at any one rate leaves the default 10-layer MLP at chance on its synthetic task (loss
# ln 10 after 300 steps at 0.01, 0.05 and 0.2), AdamW at 1e-3 takes it to 99% held out.
DEFAULT_LR = {"sgd": 0.05, "adamw": 1e-3}
LR_SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and learning-rate schedule.

    name: ``adamw`` or ``sgd`` (with momentum).
    lr: peak learning rate, reached after ``warmup_steps`` of linear warm-up (default: the
        optimizer's own: AdamW 0.001, SGD 0.05, ``DEFAULT_LR``).
    momentum: SGD momentum.
    weight_decay: decoupled weight decay (AdamW) or L2 penalty (SGD).
    betas: AdamW's moment decay rates.
    eps: AdamW's denominator term.
    warmup_steps: steps of linear warm-up to ``lr``.
    schedule: ``constant``, ``cosine`` or ``linear`` decay to ``lr * min_lr_ratio`` at
        ``total_steps``.
    total_steps: the step the decay ends at (the run's step count).
    min_lr_ratio: the decayed learning rate as a fraction of ``lr``.
    clip_grad: clip the global gradient norm (across all stages) to this value; 0 = off.
    """

    name: str = field(default="adamw", metadata={"choices": OPTIMIZERS})
    lr: float | None = None
    momentum: float = 0.9
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = field(default="constant", metadata={"choices": LR_SCHEDULES})
    total_steps: int = 0
    min_lr_ratio: float = 0.1
    clip_grad: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise UserError(f"unknown optimizer {self.name!r}; use one of {', '.join(OPTIMIZERS)}")
        if self.schedule not in LR_SCHEDULES:
            raise UserError(
                f"unknown lr schedule {self.schedule!r}; use one of {', '.join(LR_SCHEDULES)}"
            )
        if self.lr is None:
            object.__setattr__(self, "lr", DEFAULT_LR[self.name])
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UserError(f"learning rate must be a positive number, got {self.lr}")
        if self.clip_grad < 0:
            raise UserError(f"--clip-grad must be >= 0 (0 = off), got {self.clip_grad}")


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): a pure function, no state."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant" or cfg.total_steps <= cfg.warmup_steps:
        return cfg.lr
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    lo = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        return lo + 0.5 * (cfg.lr - lo) * (1 + math.cos(math.pi * frac))
    return cfg.lr - (cfg.lr - lo) * frac


def build_optimizer(params: list[nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """An optimizer over ``params`` (one parameter group; the lr is set every step).

    Its implementation is the fastest the parameters' device has: the fused kernels on
    CUDA (one launch for every parameter of the stage, where the default foreach update
    issues a dozen per parameter group and the per-parameter loop a dozen per
    parameter), the foreach one elsewhere. Every implementation computes the same update;
    a pipelined run and its single-process reference build theirs here, on the same
    device, so they agree bit for bit."""
    kind = _implementation(params)
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **kind
        )
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **kind
    )


def _implementation(params: list[nn.Parameter]) -> dict[str, bool]:
    """``fused=True`` where every parameter is a CUDA floating tensor, else ``foreach``."""
    if params and all(p.is_cuda and p.is_floating_point() for p in params):
        return {"fused": True}
    return {"foreach": True}


def export_state(
    optimizer: torch.optim.Optimizer, named_params: dict[str, nn.Parameter]
) -> dict[str, torch.Tensor]:
    """Optimizer state as ``{"<param name>/<state key>": tensor}`` (e.g. ``fc01.0.weight/exp_avg``).

    Parameters without state yet (before the first step) contribute nothing.
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in named_params.items():
        for key, value in optimizer.state.get(p, {}).items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            out[f"{name}/{key}"] = t
    return out


def import_state(
    optimizer: torch.optim.Optimizer,
    named_params: dict[str, nn.Parameter],
    state: dict[str, torch.Tensor],
) -> None:
    """Install state produced by ``export_state`` (possibly by another rank) into ``optimizer``.

    Tensors are copied onto each parameter's device; AdamW's scalar ``step`` goes where
    this optimizer keeps it: on the parameter's device for the fused (and capturable)
    update, which reads it there, else on the CPU. State exported by either kind loads
    into the other.
    """
    # An idle rank (no optimizer) is handed empty state.
    groups = optimizer.param_groups if optimizer is not None else []
    on_device = any(g.get("fused") or g.get("capturable") for g in groups)
    per_param: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        pname, _, skey = key.rpartition("/")
        per_param.setdefault(pname, {})[skey] = value
    unknown = set(per_param) - set(named_params)
    if unknown:
        raise KeyError(
            f"optimizer state for parameters this stage does not hold: {sorted(unknown)[:4]}"
        )
    for pname, entries in per_param.items():
        p = named_params[pname]
        st = {}
        for skey, value in entries.items():
            if skey == "step":
                where = p.device if on_device else "cpu"
                st[skey] = value.detach().to(where).clone()
            else:
                st[skey] = value.detach().to(p.device).clone()
        optimizer.state[p] = st


# Settings a resumed run may change on purpose (a new learning rate, a longer run) without
# losing state; ``total_steps`` follows ``--steps``.
_RESUME_NOTED = ("lr", "momentum", "weight_decay", "betas", "eps", "warmup_steps", "schedule",
                 "min_lr_ratio", "clip_grad")  # fmt: skip


def check_resumed_optim(saved: dict | None, optim: OptimConfig, *, where: str) -> list[str]:
    """Compare the optimizer a checkpoint was trained with (``saved``: its run's
    ``config.optim``; None for a checkpoint that does not say) with this run's.

    Another optimizer is refused: its state (AdamW's moments, SGD's momentum) would not be
    this one's, and resuming would drop it without a word (an AdamW checkpoint resumed with
    the default SGD at lr 0.05 diverged within five steps). Returns the hyperparameters
    that differ, as ``name saved -> now``, for the caller to say."""
    if not saved or "name" not in saved:
        return []
    if saved["name"] != optim.name:
        raise UserError(
            f"{where} was trained with --optimizer {saved['name']} (lr {saved.get('lr')}), "
            f"this run asks for --optimizer {optim.name}: its optimizer state would be "
            f"dropped; resume with --optimizer {saved['name']} and its settings, or start "
            "afresh without --resume"
        )
    now = dataclasses.asdict(optim)

    def plain(v):  # a JSON round trip makes tuples lists
        return list(v) if isinstance(v, (list, tuple)) else v

    return [
        f"{k} {saved[k]} -> {now[k]}"
        for k in _RESUME_NOTED
        if k in saved and plain(saved[k]) != plain(now[k])
    ]
