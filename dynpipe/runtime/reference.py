"""Single-process training with gradient accumulation: what every pipelined run must equal.

This is the semantics dynpipe promises: the same microbatches, the same loss, gradients
summed over microbatches and divided by their number, the same global-norm clipping, the
same optimizer, on one unsplit model.

With data parallelism the sum over microbatches is made in groups: each replica sums its
own share, then the all-reduce adds the replicas' sums. Floating-point addition is not
associative, so that grouping can change the last bits; ``groups`` (microbatches per
replica) makes the reference add in the same grouping: each group's gradients accumulated
in order, then the groups added in replica order, which is what a two-replica all-reduce
computes (``a + b`` is commutative; with more replicas the reduce's own order decides).
``dropped`` leaves groups out of the update, as partial reduce does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dynpipe.models.base import LayeredModel
from dynpipe.runtime.engine import (
    EvalResult,
    NonFiniteLoss,
    clip_coefficient,
    eval_result,
    eval_sums,
    fill_grad_norms,
    param_slots,
)
from dynpipe.runtime.optim import OptimConfig, build_optimizer, export_state, lr_at
from dynpipe.runtime.ties import check_freeze, sum_tied_grads

if TYPE_CHECKING:
    from dynpipe.data import BatchSource

__all__ = ["ReferenceTrainer"]


@dataclass
class ReferenceTrainer:
    """The unsplit model and one optimizer, stepping exactly as a pipeline does."""

    model: LayeredModel
    batch_size: int
    microbatches: int
    optim: OptimConfig
    device: str = "cpu"
    groups: tuple[int, ...] | None = None
    dropped: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.layers = self.model.build_range(0, len(self.model), device=self.device)
        self.named_params = {
            f"{lname}.{pname}": p
            for lname, layer in self.layers.items()
            for pname, p in layer.named_parameters()
        }
        self.slots = param_slots(self.model)
        self.optimizer = build_optimizer(list(self.named_params.values()), self.optim)
        self.losses: list[float] = []

    def freeze(self, frozen: int) -> None:
        """Freeze layers ``[0, frozen)`` as ``--freeze`` does: no gradient, no optimizer
        state (the state of the layers that train is kept)."""
        from dynpipe.runtime.optim import import_state

        check_freeze(self.model, frozen)
        names = list(self.layers)
        keep = {
            k: v for k, v in self.optim_state().items() if names.index(k.split(".", 1)[0]) >= frozen
        }
        for lname in names[:frozen]:
            self.layers[lname].requires_grad_(False)
        train = {n: p for n, p in self.named_params.items() if p.requires_grad}
        self.optimizer = build_optimizer(list(train.values()), self.optim)
        import_state(self.optimizer, train, keep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x

    def step(self, step: int, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        x, y = (t.to(self.device) for t in batch)
        self.optimizer.zero_grad(set_to_none=True)
        if self.groups is not None:
            mean = self._grouped(x, y)
        else:
            losses = []
            for xm, ym in zip(
                x.tensor_split(self.microbatches), y.tensor_split(self.microbatches), strict=True
            ):
                loss = self.model.loss_fn(self.forward(xm), ym)
                loss.backward()
                losses.append(loss.detach())
            for p in self.named_params.values():
                if p.grad is not None:
                    p.grad.div_(self.microbatches)
            mean = float(torch.stack(losses).float().mean())
        # The tied copies' gradients summed as a pipeline sums them (``runtime.ties``).
        sum_tied_grads(self.model, self.named_params, spread=False)
        if not math.isfinite(mean):
            raise NonFiniteLoss(f"loss is {mean} at step {step}")
        if self.optim.clip_grad > 0:
            vec = torch.zeros(len(self.slots) + 1, dtype=torch.float32)
            fill_grad_norms(vec, self.named_params, self.slots)
            _, coef = clip_coefficient(vec[:-1], self.optim.clip_grad)
            grads = [p.grad for p in self.named_params.values() if p.grad is not None]
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        lr = lr_at(step, self.optim)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        self.losses.append(mean)
        return mean

    def _grouped(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Accumulate per group, add the groups in order, divide once (see the docstring)."""
        assert self.groups is not None and sum(self.groups) == self.microbatches
        xs, ys = x.tensor_split(self.microbatches), y.tensor_split(self.microbatches)
        params = list(self.named_params.values())
        total: list[torch.Tensor | None] = [None] * len(params)
        loss_sum: torch.Tensor | None = None
        first = 0
        for g, n in enumerate(self.groups):
            mbs = range(first, first + n)
            first += n
            if g in self.dropped:
                continue
            for p in params:
                p.grad = None
            losses = []
            for i in mbs:
                loss = self.model.loss_fn(self.forward(xs[i]), ys[i])
                loss.backward()
                losses.append(loss.detach().float())
            part = torch.stack(losses).sum()
            loss_sum = part if loss_sum is None else loss_sum + part
            for j, p in enumerate(params):
                if p.grad is not None:
                    total[j] = p.grad if total[j] is None else total[j] + p.grad
        counted = sum(n for g, n in enumerate(self.groups) if g not in self.dropped)
        for p, t in zip(params, total, strict=True):
            p.grad = t
            if p.grad is not None:
                p.grad.div_(counted)
        assert loss_sum is not None
        return float(loss_sum / counted)

    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> EvalResult:
        """The unsplit model's evaluation: each batch in the pipeline's microbatches, layers
        in eval mode, no gradient; summed exactly as ``PipelineEngine.evaluate`` sums."""
        modes = [(m, m.training) for m in self.layers.modules()]
        self.layers.eval()
        sums = torch.zeros(4, dtype=torch.float64)
        count = 0
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                for batch in batches:
                    x, y = (t.to(self.device) for t in batch)
                    xs, ys = x.tensor_split(self.microbatches), y.tensor_split(self.microbatches)
                    outs = [self.forward(xm) for xm in xs]
                    losses = [self.model.loss_fn(o, ym) for o, ym in zip(outs, ys, strict=True)]
                    sums += torch.tensor(eval_sums(outs, list(ys), losses), dtype=torch.float64)
                    count += 1
        finally:
            for m, mode in modes:
                m.train(mode)
        ms = (time.perf_counter() - t0) * 1e3
        return eval_result(sums, model=self.model, batches=count, eval_ms=ms)

    def train(self, data: BatchSource, *, steps: int, start: int = 0) -> list[float]:
        return [self.step(s, data.batch(s, self.batch_size)) for s in range(start, start + steps)]

    def model_state(self) -> dict[str, torch.Tensor]:
        return {
            f"{lname}.{k}": v
            for lname, layer in self.layers.items()
            for k, v in layer.state_dict().items()
        }

    def optim_state(self) -> dict[str, torch.Tensor]:
        return export_state(self.optimizer, self.named_params)

    def load(
        self, model_state: dict[str, torch.Tensor], optim_state: dict[str, torch.Tensor]
    ) -> None:
        from dynpipe.runtime.optim import import_state

        for lname, layer in self.layers.items():
            prefix = f"{lname}."
            layer.load_state_dict(
                {k[len(prefix) :]: v for k, v in model_state.items() if k.startswith(prefix)}
            )
        import_state(self.optimizer, self.named_params, optim_state)
