"""Build the policy a configuration asks for (the training loop's default; tests inject
their own through ``train(..., policy=...)``)."""

from __future__ import annotations

from typing import Any

from dynpipe.models import LayeredModel
from dynpipe.planner.costs import CostModel
from dynpipe.runtime.adapt.config import AdaptConfig
from dynpipe.runtime.adapt.policy import Controller, Policy, SweepPolicy

__all__ = ["make_policy", "warm_bytes"]


def make_policy(
    config: AdaptConfig,
    *,
    model: LayeredModel,
    microbatch_size: int,
    num_ranks: int,
    predictor: str | None = None,
    base: CostModel | None = None,
) -> Policy | None:
    """The policy of ``config.mode`` (None for ``static``).

    predictor: path of a trained slowdown predictor (``adaptive`` and ``restart``).
    base: the model's cost model for one device (default: the analytic one); its times
        are only the prior before the first window measures every layer.
    """
    if config.mode == "static":
        return None
    if base is None:
        base = CostModel.from_model(model, microbatch_size=microbatch_size, num_devices=1)
    if config.mode == "sweep":
        return SweepPolicy(base=base, config=config, num_ranks=num_ranks)
    loaded: Any = None
    prepared: Any = None
    if predictor and config.mode in ("adaptive", "restart"):
        from dynpipe.models.stats import layer_stats
        from dynpipe.predictor import load_predictor, prepare_layers

        loaded = load_predictor(predictor)
        if hasattr(loaded.estimator, "set_predict_threads"):
            loaded.estimator.set_predict_threads(1)
        prepared = prepare_layers(
            loaded, layer_stats(model, batch_size=microbatch_size), batch_size=microbatch_size
        )
    return Controller(
        base=base, config=config, num_ranks=num_ranks, predictor=loaded, prepared=prepared
    )


def warm_bytes(model: LayeredModel, *, microbatch_size: int, cuda: bool) -> int:
    """Size of the layer-sized message each link is warmed with (GPUs only; capped)."""
    if not cuda:
        return 0
    base = CostModel.from_model(model, microbatch_size=microbatch_size, num_devices=1)
    return int(min(base.state_bytes.max(), 64 << 20))
