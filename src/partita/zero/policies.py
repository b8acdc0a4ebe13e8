"""Policies of the data-parallel engine: ZeRO (its stage is `partita.layout.ZeroStage`),
mixed precision.

Small frozen dataclasses, validated on construction so a bad value fails before any
process group is touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from partita.errors import PartitaError
from partita.layout import ZeroStage

# Stage-2 gradient accumulation (see docs/zero.md):
#   "reduce"  reduce-scatter every microbatch into the owned gradient slice (memory 2P/N
#             for gradients, communication x microbatches) -- the default, because the
#             point of stage 2 is to never hold a full-size gradient;
#   "buffer"  accumulate microbatches in a full-size gradient buffer and reduce-scatter
#             once at the boundary (communication once, memory +2P during the step).
ACCUMULATION_MODES = ("reduce", "buffer")


@dataclass(frozen=True)
class ZeroConfig:
    """`stage` is given as its number 0-3 (or a ZeroStage) and kept as a ZeroStage."""

    stage: ZeroStage | int = 0
    # Stages 0-2: gradient bucket size (one collective per bucket). Stage 3: consecutive
    # blocks are merged into one gather unit (one all-gather, one reduce-scatter) while
    # the unit stays within it; a bigger block is a unit by itself.
    bucket_mb: float = 25.0
    prefetch: int = 1  # stage 3: gather units fetched ahead of the one computing
    # Stage 3: the last units forward runs stay gathered until their backward (whose
    # first units they are) instead of being freed and gathered again. 1 keeps the last
    # unit only; more trade one unit's memory each for one all-gather of it per
    # microbatch; a number >= the unit count is FSDP2's reshard_after_forward=False.
    keep_gathered: int = 1
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
        if not isinstance(self.keep_gathered, int) or self.keep_gathered < 0:
            raise PartitaError(
                f"parallel.keep_gathered={self.keep_gathered!r} must be an integer >= 0: "
                "the number of last gather units stage 3 keeps from forward into backward "
                "(1 is the default; 0 frees every unit after its forward)."
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
    float32. A reduce_dtype wider than param_dtype (bf16 parameters, float32 reductions)
    is also the dtype stages 0-1 hold and accumulate their whole gradients in
    (`grad_dtype`), as stages 2-3 hold their gradient shards in reduce_dtype. When
    master_dtype equals param_dtype no separate master copy is kept: the optimizer
    updates the owned parameter slice in place. float16 turns on dynamic loss
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
    def grad_dtype(self) -> torch.dtype:
        """The dtype of stages 0-1's gradient buckets: the wider of param_dtype and
        reduce_dtype, so that microbatches accumulate, and the clipping and the update
        read, at the precision the gradients are reduced in."""
        return self.reduce if self.reduce.itemsize > self.param_dtype.itemsize \
            else self.param_dtype

    @property
    def master(self) -> torch.dtype:
        return self.master_dtype or torch.promote_types(self.param_dtype, torch.float32)

    @property
    def has_master(self) -> bool:
        return self.master != self.param_dtype

    @property
    def loss_scaling(self) -> bool:
        return self.param_dtype == torch.float16
