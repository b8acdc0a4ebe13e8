"""Single-device model code. Nothing in here imports parallel code."""

from partita.models.catalog import MODELS, get_model_config
from partita.models.model_config import ModelConfig
from partita.models.plan import ModelPlan
from partita.models.transformer import Transformer, build_model

__all__ = ["MODELS", "ModelConfig", "ModelPlan", "Transformer", "build_model",
           "get_model_config"]
