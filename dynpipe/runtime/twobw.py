"""PipeDream-2BW's double-buffered weights (``--schedule 2bw``).

**This changes what training computes.** PipeDream-2BW (Narayanan et al., "Memory-Efficient
Pipeline-Parallel DNN Training", ICML 2021) keeps two versions of every trained weight: every
microbatch of step ``t`` runs its forward and its backward on the stashed version ``W(t-1)``,
and the gradients of step ``t``, accumulated over its microbatches, update the newest one::

    W(t+1) = W(t) - opt(grad f(W(t-1)))        with W(-1) = W(0)

The delay of one step is what lets the paper's pipeline run step ``t + 1``'s first forwards
before step ``t``'s last backwards finish: they need ``W(t)``, made from step ``t - 1``'s
gradients. dynpipe runs the update rule exactly, with each step still a flushed 1F1B step
(torch's ``Schedule1F1B``): the overlap across step boundaries is not done, so the step
takes 1F1B's time plus one copy of the stage's weights (``docs/schedules.md``).

A stage's parameters hold the stashed version (its forwards and backwards see no other);
``WeightVersions`` holds the newest beside them. The newest travels with the optimizer
state, as ``<layer>.<param>/2bw_newest``: a migration moves it with the layer's moments and
a checkpoint saves and loads it, so both versions move and resume exactly. Buffers
(BatchNorm statistics) have one version, updated by the forwards as under any schedule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from dynpipe.errors import UserError

__all__ = ["NEWEST_KEY", "WeightVersions", "check_2bw_run", "split_newest"]

# The optimizer-state key under which the newest weight version travels and is saved.
NEWEST_KEY = "2bw_newest"


def split_newest(
    state: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``state`` (``export_state``'s keys) as the optimizer's own entries and the newest
    weight version by parameter name."""
    optim, newest = {}, {}
    for key, value in state.items():
        pname, _, skey = key.rpartition("/")
        if skey == NEWEST_KEY:
            newest[pname] = value
        else:
            optim[key] = value
    return optim, newest


class WeightVersions:
    """The newest weight version of a stage's trained parameters ``params`` (which hold the
    stashed one). ``newest``: the version by name (a fresh run, or state from a schedule
    without versions: a copy of the parameters, ``W(-1) = W(0)``)."""

    def __init__(
        self, params: dict[str, nn.Parameter], newest: dict[str, torch.Tensor] | None = None
    ) -> None:
        newest = newest or {}
        stray = sorted(set(newest) - set(params))
        if stray:
            raise KeyError(
                f"2bw weight versions for parameters this stage does not hold: {stray[:4]}"
            )
        self.params = params
        self.newest = {
            n: (
                newest[n].detach().to(device=p.device, dtype=p.dtype).clone()
                if n in newest
                else p.detach().clone()
            )
            for n, p in params.items()
        }

    def update(self, optimizer_step: Callable[[], None]) -> None:
        """Apply ``optimizer_step`` (the gradients in the parameters' ``.grad``, computed on
        the stashed ``W(t-1)``) to the newest ``W(t)``; afterwards the parameters hold
        ``W(t)``, the next step's stash, and the newest is ``W(t+1)``.

        Storage is swapped, not copied, except once: ``W(t)`` is copied before the update
        overwrites it (one copy of the stage's weights per step)."""
        if not self.newest:
            optimizer_step()
            return
        names = list(self.newest)
        params = [self.params[n] for n in names]
        self._swap(names)  # parameters: W(t); the buffers: W(t-1), no longer needed
        torch._foreach_copy_([self.newest[n] for n in names], [p.detach() for p in params])
        optimizer_step()  # parameters: W(t+1); buffers: W(t)
        self._swap(names)

    @contextlib.contextmanager
    def newest_in(self) -> Iterator[None]:
        """The parameters hold the newest version inside the block (evaluation: the model
        as trained so far), the stashed one again after it."""
        names = list(self.newest)
        self._swap(names)
        try:
            yield
        finally:
            self._swap(names)

    def state(self) -> dict[str, torch.Tensor]:
        """The newest version as optimizer-state entries (``<param>/2bw_newest``)."""
        return {f"{n}/{NEWEST_KEY}": t for n, t in self.newest.items()}

    def _swap(self, names: list[str]) -> None:
        for n in names:
            p = self.params[n]
            p.data, self.newest[n] = self.newest[n], p.data


def check_2bw_run(
    *,
    schedule: str,
    fp16: bool,
    freeze: bool,
    autodp: bool,
    reshape: bool,
) -> None:
    """What ``--schedule 2bw`` does not run with, as one-line errors (virtual stages are
    the plan's to refuse: ``Plan``)."""
    if schedule != "2bw":
        return
    if fp16:
        raise UserError(
            "--schedule 2bw does not run with --fp16: a skipped update under the loss scale "
            "would have to hold both weight versions back; use --bf16, or --schedule 1f1b"
        )
    if freeze or autodp:
        raise UserError(
            "--schedule 2bw does not run with --freeze / --autodp (a frozen layer would keep "
            "two versions that differ); drop --freeze, or use --schedule 1f1b"
        )
    if reshape:
        raise UserError(
            "--schedule 2bw does not run with --reshape (a live change of the data x pipeline "
            "shape is not checked with two weight versions); give the shape with --dp and "
            "drop --reshape, or use --schedule 1f1b"
        )
