"""Data parallelism with ZeRO stages 0-3 on one flat-buffer layer (see docs/zero.md).

`AdamWConfig` lives in partita.optim; it is re-exported here because DataParallel takes
it as its `optim` policy.
"""

from partita.optim import AdamWConfig
from partita.zero.engine import DataParallel
from partita.zero.flat import ALIGN, FlatBuffer, FlatEntry
from partita.zero.materialize import model_init_fn
from partita.zero.policies import MixedPrecision, ZeroConfig, ZeroStage

__all__ = ["ALIGN", "AdamWConfig", "DataParallel", "FlatBuffer", "FlatEntry",
           "MixedPrecision", "ZeroConfig", "ZeroStage", "model_init_fn"]
