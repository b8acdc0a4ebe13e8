"""Policies of the data-parallel engine: ZeRO stage, mixed precision.

Small frozen dataclasses, validated on construction so a bad value fails before any
process group is touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from partita.errors import PartitaError

# Stage-2 gradient accumulation (see docs/zero.md):
#   "reduce"  reduce-scatter every microbatch into the owned gradient slice (memory 2P/N
#             for gradients, communication x microbatches) -- the default, because the
#             point of stage 2 is to never hold a full-size gradient;
#   "buffer"  accumulate microbatches in a full-size gradient buffer and reduce-scatter
#             once at the boundary (communication once, memory +2P during the step).
ACCUMULATION_MODES = ("reduce", "buffer")


@dataclass(frozen=True)
class ZeroStage:
    """What ZeRO stage `number` shards over the data-parallel group, and what follows
    from it. Each stage shards what the one before does, and one thing more:

      0  nothing (plain data parallelism: gradients all-reduced, full optimizer states);
      1  optimizer states (and master weights): each rank updates its own slice;
      2  + gradients: each rank keeps only its slice of the reduced gradient;
      3  + parameters: gathered around compute, a slice at rest.

    The number stays the user-facing value (`parallel.zero_stage`); code reads the
    properties, never the number."""

    number: int

    def __post_init__(self) -> None:
        if isinstance(self.number, bool) or self.number not in (0, 1, 2, 3):
            raise PartitaError(
                f"parallel.zero_stage={self.number} is invalid: use 0 (plain data parallel), "
                "1 (shard optimizer state), 2 (+ gradients) or 3 (+ parameters)."
            )

    @classmethod
    def of(cls, stage: int | ZeroStage) -> ZeroStage:
        return stage if isinstance(stage, ZeroStage) else cls(stage)

    def __int__(self) -> int:
        return self.number

    def __str__(self) -> str:
        return f"ZeRO-{self.number}"

    @property
    def shards_optimizer_states(self) -> bool:
        """Each rank updates only its own slice of every bucket (its moments and master
        weights), so the gradient norm is summed over the group."""
        return self.number >= 1

    @property
    def shards_gradients(self) -> bool:
        """Reduced gradients are kept as the owned slice only; without this the full
        gradient buffers live for the whole run and .grad are views into them."""
        return self.number >= 2

    @property
    def shards_parameters(self) -> bool:
        """Parameters are a slice at rest, gathered block by block around compute."""
        return self.number >= 3

    @property
    def all_reduces_gradients(self) -> bool:
        """Gradients are all-reduced (every rank holds all of them); otherwise they are
        reduce-scattered (each rank receives the sum of its own slice)."""
        return not self.shards_optimizer_states

    @property
    def gathers_parameters_after_step(self) -> bool:
        """Every rank keeps full parameters but updates only its slice: the updated
        slices are all-gathered after each step (stage 3 gathers before compute)."""
        return self.shards_optimizer_states and not self.shards_parameters

    @property
    def can_buffer_accumulation(self) -> bool:
        """Gradient accumulation may choose between reducing every microbatch and one
        full-size buffer reduced at the boundary (see ACCUMULATION_MODES)."""
        return self.shards_gradients and not self.shards_parameters


@dataclass(frozen=True)
class ZeroConfig:
    """`stage` is given as its number 0-3 (or a ZeroStage) and kept as a ZeroStage."""

    stage: ZeroStage | int = 0
    # Stages 0-2: gradient bucket size (one collective per bucket). Stage 3: consecutive
    # blocks are merged into one gather unit (one all-gather, one reduce-scatter) while
    # the unit stays within it; a bigger block is a unit by itself.
    bucket_mb: float = 25.0
    prefetch: int = 1  # stage 3: gather units fetched ahead of the one computing
    accumulation: str = "reduce"  # stage 2 only, see ACCUMULATION_MODES

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage", ZeroStage.of(self.stage))
        if not self.bucket_mb > 0:
            raise PartitaError(
                f"parallel.bucket_mb={self.bucket_mb} must be positive: it is the size of one "
                "gradient bucket in MiB (25 is a good start; smaller overlaps more)."
            )
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise PartitaError(
                f"parallel.prefetch={self.prefetch!r} must be an integer >= 0: the number of "
                "blocks whose parameters stage 3 gathers ahead (1 is usual, 0 turns it off)."
            )
        if self.accumulation not in ACCUMULATION_MODES:
            raise PartitaError(
                f"zero accumulation='{self.accumulation}' is unknown; use 'reduce' "
                "(reduce-scatter every microbatch, least memory) or 'buffer' (full-size "
                "accumulation buffer, one reduce-scatter per step)."
            )

    @property
    def accumulates_in_full_buffer(self) -> bool:
        """Microbatches accumulate into each bucket's full-size gradient buffer, which
        is reduced once at the step boundary: always when gradients are not sharded,
        and by choice ("buffer") where the stage allows it."""
        return not self.stage.shards_gradients or (
            self.accumulation == "buffer" and self.stage.can_buffer_accumulation)

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)


_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}


@dataclass(frozen=True)
class MixedPrecision:
    """Parameter/compute dtype, gradient-reduction dtype and master-weight dtype.

    reduce_dtype None = param_dtype; master_dtype None = the wider of param_dtype and
    float32. When master_dtype equals param_dtype no separate master copy is kept: the
    optimizer updates the owned parameter slice in place. float16 turns on dynamic loss
    scaling (initial_scale, halved on overflow, doubled after growth_interval clean steps;
    max_skips consecutive overflows stop training).
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None
    master_dtype: torch.dtype | None = None
    initial_scale: float = 2.0**16
    growth_interval: int = 1000
    max_skips: int = 20

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "master_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _DTYPES:
                raise PartitaError(
                    f"precision.{name}={value} is not supported; use float32, bfloat16, "
                    "float16 (or float64 for parity checks)."
                )
        if self.master.itemsize < self.param_dtype.itemsize:
            raise PartitaError(
                f"precision.master_dtype={self.master} is narrower than param_dtype="
                f"{self.param_dtype}; master weights must be at least as precise."
            )

    @property
    def reduce(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype

    @property
    def master(self) -> torch.dtype:
        return self.master_dtype or torch.promote_types(self.param_dtype, torch.float32)

    @property
    def has_master(self) -> bool:
        return self.master != self.param_dtype

    @property
    def loss_scaling(self) -> bool:
        return self.param_dtype == torch.float16
