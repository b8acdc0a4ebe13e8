"""Data parallelism with ZeRO stages 0-3 on one flat-buffer layer (see docs/zero.md)."""

from partita.zero.config import AdamWConfig, MixedPrecision, ZeroConfig
from partita.zero.engine import DataParallel
from partita.zero.flat import ALIGN, FlatBuffer, FlatEntry
from partita.zero.init import model_init_fn

__all__ = ["ALIGN", "AdamWConfig", "DataParallel", "FlatBuffer", "FlatEntry",
           "MixedPrecision", "ZeroConfig", "model_init_fn"]
