"""Fitting bigger models: activation recomputation (and, later, offload of model states)."""

from partita.memory.recompute import (
    MODES,
    RecomputePolicy,
    RecomputeReport,
    apply_recompute,
    recompute_module,
)

__all__ = ["MODES", "RecomputePolicy", "RecomputeReport", "apply_recompute",
           "recompute_module"]
