"""Adaptation: measure every layer, plan from the measurements, move what pays.

| module | job |
|---|---|
| ``config`` | ``AdaptConfig``: when and how to repartition |
| ``window`` | ``Window``: one monitoring window's measurements, as plain numbers |
| ``estimates`` | ``CostEstimates``: every layer's cost on every device now |
| ``record`` | ``PlanMemory`` (measured plans) and ``MoveRecord`` (one move, decision to verdict) |
| ``policy`` | ``Controller`` and ``SweepPolicy``: window -> ``Decision`` (pure logic) |
| ``belief`` | the model core's state: device slowdown filters, plan step times, the move rule |
| ``model`` | ``ModelPolicy``: the model core (``--adapt-core model``) |
| ``replicas`` | ``ReplicaPolicy``: the same for data x pipeline runs (batch share, layers, shape) |
| ``make`` | the policy a configuration asks for |
| ``loop`` | ``Adapter``: runs the policy in the training loop and carries out its moves |

The simulators that drive these policies are tools, in ``dynpipe.sim``.
"""

from __future__ import annotations

from dynpipe.runtime.adapt.config import ADAPT_MODES, AdaptConfig
from dynpipe.runtime.adapt.policy import Controller, Decision, Policy, SweepPolicy
from dynpipe.runtime.adapt.window import Window

__all__ = [
    "ADAPT_MODES",
    "AdaptConfig",
    "Controller",
    "Decision",
    "Policy",
    "SweepPolicy",
    "Window",
]
