"""Learned slowdown predictor: how long each layer takes on a device, from its telemetry.

Offline, ``fit_predictor`` learns a layer's slowdown factor (time under interference / time
alone) from profile datasets; ``evaluate`` scores it with grouped cross-validation on held-out
interference conditions, models and interferer kinds. At run time ``predict_layer_times``
turns every device's current telemetry into per-layer forward/backward times for all layers,
including the ones the device does not hold now, which measuring its current stage cannot tell.

Names are imported lazily so ``dynpipe --help`` does not pay for pandas, scikit-learn and
xgboost. A saved predictor is a JSON file (``io``): loading one runs no code.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "FeatureSchema",
    "ForestSlowdown",
    "LayerTimes",
    "NoInterference",
    "Predictor",
    "PreparedLayers",
    "RidgeSlowdown",
    "SlowdownRegressor",
    "StageMean",
    "evaluate",
    "extract_features",
    "fit_predictor",
    "load_predictor",
    "predict_layer_distribution",
    "predict_layer_times",
    "prepare_layers",
    "rescale_to_measured",
    "save_predictor",
]

_WHERE = {
    "FeatureSchema": "features",
    "extract_features": "features",
    "ForestSlowdown": "estimator",
    "NoInterference": "estimator",
    "RidgeSlowdown": "estimator",
    "SlowdownRegressor": "estimator",
    "StageMean": "estimator",
    "evaluate": "crossval",
    "fit_predictor": "train",
    "Predictor": "io",
    "load_predictor": "io",
    "save_predictor": "io",
    "PreparedLayers": "runtime",
    "LayerTimes": "runtime",
    "predict_layer_distribution": "runtime",
    "predict_layer_times": "runtime",
    "prepare_layers": "runtime",
    "rescale_to_measured": "runtime",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"dynpipe.predictor.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'dynpipe.predictor' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
