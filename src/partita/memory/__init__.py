"""Fitting bigger models: activation recomputation and offload of model states to host."""

from partita.memory.offload import HostOptimizer, OffloadPolicy, stage_in
from partita.memory.recompute import (
    MODES,
    RecomputePolicy,
    RecomputeReport,
    apply_recompute,
    recompute_module,
)

__all__ = ["MODES", "HostOptimizer", "OffloadPolicy", "RecomputePolicy", "RecomputeReport",
           "apply_recompute", "recompute_module", "stage_in"]
