"""Single-device model code. Nothing in here imports parallel code.

The torch-backed names (`Transformer`, `build_model`, `ModelPlan`) load on first use,
so reading a model's shape (`ModelConfig`, the catalog) does not import torch: the
planner and `partita plan` start in a fraction of a second.
"""

from __future__ import annotations

from partita.lazy import lazy_names
from partita.models.catalog import MODELS, get_model_config
from partita.models.model_config import ModelConfig

_LAZY = {"ModelPlan": "partita.models.plan", "Transformer": "partita.models.transformer",
         "build_model": "partita.models.transformer"}

__all__ = ["MODELS", "ModelConfig", "ModelPlan", "Transformer", "build_model",
           "get_model_config"]

__getattr__ = lazy_names(__name__, _LAZY)
