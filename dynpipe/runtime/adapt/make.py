"""Build the policy a configuration asks for (the training loop's default; tests inject
their own through ``train(..., policy=...)``)."""

from __future__ import annotations

from typing import Any

from dynpipe.models import LayeredModel
from dynpipe.planner.costs import CostModel
from dynpipe.runtime.adapt.config import AdaptConfig
from dynpipe.runtime.adapt.policy import Controller, Policy, SweepPolicy

__all__ = ["activation_bytes", "make_policy", "warm_bytes"]


def make_policy(
    config: AdaptConfig,
    *,
    model: LayeredModel,
    microbatch_size: int,
    num_ranks: int,
    predictor: str | None = None,
    base: CostModel | None = None,
    dp: int = 1,
    replicas: bool | None = None,
    link_bandwidth: float | None = None,
    light_probes: bool = True,
) -> Policy | None:
    """The policy of ``config.mode`` (None for ``static``).

    predictor: path of a trained slowdown predictor (``adaptive`` and ``restart``).
    base: the model's cost model for one device (default: the analytic one); its times
        are only the prior before the first window measures every layer.
    dp: pipeline replicas; more than one makes the replica policy (``num_ranks`` is then
        the stages of one pipeline).
    replicas: the replica policy even for one replica (``--reshape``: one pipeline over
        every rank is one of its shapes); default: ``dp > 1``.
    link_bandwidth: measured bytes/s between stages, in the cost model's (float32) bytes
        (``dynpipe.runtime.links``); the analytic default if None.
    light_probes: light ranks may probe their devices (``Controller``: GPUs only).
    """
    if config.mode == "static":
        return None
    if base is None:
        links = {} if link_bandwidth is None else {"bandwidth": link_bandwidth}
        base = CostModel.from_model(model, microbatch_size=microbatch_size, num_devices=1, **links)
    if config.mode == "sweep":
        # With replicas every replica holds each split in turn, its batch share unchanged.
        return SweepPolicy(base=base, config=config, num_ranks=num_ranks)
    loaded: Any = None
    prepared: Any = None
    if predictor and config.mode in ("adaptive", "restart"):
        from dynpipe.models.stats import layer_stats
        from dynpipe.predictor import load_predictor, prepare_layers

        loaded = load_predictor(predictor)
        if hasattr(loaded.estimator, "set_predict_threads"):
            loaded.estimator.set_predict_threads(1)
        # A predictor of layers' work (feature schema 3) counts it from the model itself.
        described = (
            model if loaded.schema.uses_work else layer_stats(model, batch_size=microbatch_size)
        )
        prepared = prepare_layers(loaded, described, batch_size=microbatch_size)
    if replicas if replicas is not None else dp > 1:
        from dynpipe.runtime.adapt.replicas import ReplicaPolicy

        return ReplicaPolicy(
            base=base,
            config=config,
            num_stages=num_ranks,
            dp=dp,
            predictor=loaded,
            prepared=prepared,
        )
    if config.core == "model" and not config.elastic:
        from dynpipe.runtime.adapt.model import ModelPolicy

        # The model core covers one pipeline over a fixed set of ranks; --elastic (idle
        # ranks, probes) stays with the rules core.
        return ModelPolicy(
            base=base,
            config=config,
            num_ranks=num_ranks,
            predictor=loaded,
            prepared=prepared,
        )
    return Controller(
        base=base,
        config=config,
        num_ranks=num_ranks,
        predictor=loaded,
        prepared=prepared,
        light_probes=light_probes,
    )


def activation_bytes(model: LayeredModel, *, microbatch_size: int) -> int:
    """The largest activation one stage can send another (float32 bytes, one microbatch)."""
    base = CostModel.from_model(model, microbatch_size=microbatch_size, num_devices=1)
    return int(base.out_bytes[:-1].max()) if len(base.out_bytes) > 1 else 0


def warm_bytes(model: LayeredModel, *, microbatch_size: int, cuda: bool) -> int:
    """Size of the layer-sized message each link is warmed with (GPUs only; capped)."""
    if not cuda:
        return 0
    base = CostModel.from_model(model, microbatch_size=microbatch_size, num_devices=1)
    return int(min(base.state_bytes.max(), 64 << 20))
