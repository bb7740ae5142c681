"""Periodic evaluation on the held-out split: when, on which batches, and the ``eval`` record.

``--eval-every K`` evaluates after every K-th step and after the last one. Each evaluation
reads the same held-out batches (batch ``b`` of the data source's ``test`` split, for
``b < batches``), so evaluations at different steps, in different runs, or under different
plans compare the same samples. The pass itself is ``PipelineEngine.evaluate``: the
pipeline's own stages, whatever the engine holds at that step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dynpipe.errors import UserError
from dynpipe.runtime.records import Eval

if TYPE_CHECKING:
    from dynpipe.data.base import BatchSource
    from dynpipe.runtime.engine import EvalResult, PipelineEngine
    from dynpipe.runtime.runlog import RunLog
    from dynpipe.runtime.topology import Topology

__all__ = ["DEFAULT_BATCHES", "ENDLESS_BATCHES", "Evaluator", "eval_batch_count"]

DEFAULT_BATCHES = 50  # at most, for a finite held-out split read whole by default
ENDLESS_BATCHES = 10  # for an endless (synthetic) held-out stream


def eval_batch_count(source: BatchSource, *, batch_size: int, batches: int | None) -> int:
    """Batches per evaluation: ``batches`` if given, else the held-out split once (its
    whole batches, at least one, at most ``DEFAULT_BATCHES``), or ``ENDLESS_BATCHES``."""
    if batches is not None:
        if batches < 1:
            raise UserError(f"--eval-batches must be >= 1, got {batches}")
        return batches
    if source.num_samples is None:
        return ENDLESS_BATCHES
    return max(1, min(DEFAULT_BATCHES, source.num_samples // batch_size))


@dataclass
class Evaluator:
    """Evaluates ``engine`` every ``every`` steps and at the end, logging ``eval`` records.

    source: the held-out split (every rank builds it: all must agree on the batch count);
    only the first and last stage's ranks read batches from it.
    """

    source: BatchSource
    every: int
    steps: int
    batch_size: int
    batches: int
    workers: int = 0

    def due(self, step: int) -> bool:
        """Whether to evaluate after ``step`` (0-based) has run."""
        done = step + 1
        return self.every > 0 and (done % self.every == 0 or done == self.steps)

    def run(
        self, engine: PipelineEngine, *, step: int, topo: Topology, log: RunLog | None
    ) -> EvalResult:
        """Evaluate now (after ``step``) and log the record; every rank returns the result."""
        from dynpipe.data.loader import BatchStream

        stream: BatchStream | None = None
        if engine.is_first or engine.is_last:
            stream = BatchStream(
                self.source,
                batch_size=self.batch_size,
                start=0,
                stop=self.batches,
                workers=self.workers,
                device=topo.device,
                timeout_s=topo.timeout_s,
            )
        try:
            batches: Any = (b for _, b in stream) if stream is not None else [None] * self.batches
            res = engine.evaluate(batches)
        finally:
            if stream is not None:
                stream.close()
        if log is not None:
            log.record(Eval(step=step + 1, split="test", **res.to_dict()))
        return res
