"""The optimizer's master copy of each parameter, whole, for writing the trained model.

Under mixed precision the module's parameters are bf16/fp16 copies of the fp32 master
that the optimizer updates (sharded over the data-parallel group from stage 1 on; in
host memory or in files under offload). The weights a finished run writes should be
that master, the most precise value the run had, as `partita checkpoint export` writes
it from a checkpoint.

    masters = MasterCopies.of(dp)          # None: the parameters are the master already
    value = masters.value(param)           # every rank of the dp group, same order

`value` gathers one bucket at a time over its group and keeps only the last one, so a
rank holds at most one bucket's master beyond its own state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from partita.zero.engine import DataParallel
    from partita.zero.flat import FlatEntry


class MasterCopies:
    def __init__(self, dp: DataParallel) -> None:
        self.dp = dp
        self.where: dict[int, tuple[int, FlatEntry]] = {
            id(p): (b, e) for b, buf in enumerate(dp.buckets)
            for p, e in zip(buf.params, buf.entries)}
        self._bucket: int | None = None
        self._full: torch.Tensor | None = None

    @classmethod
    def of(cls, dp: object) -> MasterCopies | None:
        """None where there is nothing more precise than the parameters themselves
        (no separate master dtype, or an engine without flat buckets)."""
        precision = getattr(dp, "precision", None)
        if precision is None or not hasattr(dp, "buckets"):
            return None
        if precision.master == precision.param_dtype:
            return None
        dp.wait_params()  # under host offload the last update may still be running
        return cls(dp)

    @torch.no_grad()
    def value(self, param: torch.Tensor) -> torch.Tensor:
        """`param`'s local tensor (its tensor- or expert-parallel part, as the module
        holds it) in the master dtype; the parameter itself when the optimizer does
        not own it (a frozen one)."""
        found = self.where.get(id(param))
        if found is None:
            return param.detach()
        b, entry = found
        if b != self._bucket:
            self._full, self._bucket = self._gather(b), b
        assert self._full is not None
        return self._full[entry.offset:entry.offset + entry.numel].view(entry.shape)

    def _gather(self, b: int) -> torch.Tensor:
        dp = self.dp
        buf = dp.buckets[b]
        lo, hi = dp._owned_range(buf)
        if dp.disk is not None:
            owned = dp.disk.read_states(b)["master"]
        else:
            owned = dp.slots[b].master
            if owned is None:  # this slot's parameters are in the master dtype
                owned = dp._owned_param(buf)
        owned = owned.to(dp.device, dp.precision.master)
        if hi - lo == buf.padded:  # stage 0: every rank owns every element
            return owned
        full = torch.empty(buf.padded, dtype=owned.dtype, device=dp.device)
        (buf.comm or dp.comm).all_gather_flat(full, owned.contiguous())
        return full
