"""What each rank's optimizer owns, as checkpoints read and write it.

    for sl in dp.owned_slices():            # per bucket: pieces, values, AdamW state
        ...                                 # read (save) or write in place (load)
    dp.owned_slices_loaded()                # after a load: stages 1-2 regather

The engine (`partita.zero.engine.DataParallel`) has methods of the same names that
call these, for checkpoints to read and write through; they use the engine's
own helpers (`_owned_range`, `_owned_param`) for the layout of each bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from partita.zero.flat import Piece

if TYPE_CHECKING:
    from partita.zero.engine import DataParallel


@dataclass(frozen=True)
class OwnedSlice:
    """One bucket's flat range [lo, lo + len(param)) that this rank's optimizer updates:
    the parameter pieces in it (`Piece.buf_start - lo` is a piece's offset in the
    tensors below), the parameter values, the master copy (None when the parameters
    are in the master dtype) and both AdamW moments."""

    pieces: list[Piece]
    lo: int
    param: torch.Tensor
    master: torch.Tensor | None
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


def owned_slices(dp: DataParallel) -> list[OwnedSlice]:
    """Per bucket, what this rank's optimizer updates: the flat range, the pieces of
    parameters in it and the tensors holding their values and AdamW state (views of
    the engine's own buffers; host memory under offload). Checkpoints read and
    write training state here. Under disk offload the states (and, with the
    parameters on disk, the parameters) are read from their files into host
    tensors, the whole owned slice at once; after a load, `owned_slices_loaded`
    writes the last such tensors back."""
    dp.wait_params()
    out = []
    for b, buf in enumerate(dp.buckets):
        lo, hi = dp._owned_range(buf)
        if dp.disk is not None:
            st = dp.disk.read_states(b)
            param = (dp.disk.read_param(b) if dp.offload.params
                     else dp._owned_param(buf))
            out.append(OwnedSlice(buf.pieces(lo, hi), lo, param, st["master"],
                                  st["exp_avg"], st["exp_avg_sq"]))
            continue
        slot = dp.slots[b]
        out.append(OwnedSlice(buf.pieces(lo, hi), lo, dp._owned_param(buf), slot.master,
                              slot.exp_avg, slot.exp_avg_sq))
    if dp.disk is not None:
        dp._disk_slices = out
    return out


def writes_piece(dp: DataParallel, piece: Piece) -> bool:
    """Whether this rank is the one, among the ranks holding identical copies of
    `piece`'s state, that a checkpoint takes it from: index 0 of the data-parallel
    group when optimizer states are replicated (stage 0), and of every group the
    parameter is replicated over (a norm under tensor parallelism)."""
    # The group the piece's state is replicated over is its bucket's (experts: their
    # expert-data-parallel group, whose index 0 differs from the dense one's).
    comm = next((b.comm for b in dp.buckets if piece.entry in b.entries), None)
    if not dp.stage.shards_optimizer_states and (comm or dp.comm).index != 0:
        return False
    return not any(p in dp.mesh.ranks and dp.mesh.index(p) != 0
                   for p in piece.entry.info.replicated_over)


@torch.no_grad()
def owned_slices_loaded(dp: DataParallel) -> None:
    """The owned slices were written from outside (a checkpoint was loaded): bring
    the full parameter buffers of stages 1-2 up to date from every rank's slice."""
    if dp.disk is not None:  # the tensors `owned_slices` read go back to the files
        for b, sl in enumerate(dp._disk_slices or []):
            dp.disk.write_states(b, {"master": sl.master, "exp_avg": sl.exp_avg,
                                       "exp_avg_sq": sl.exp_avg_sq})
            if dp.offload.params:
                dp.disk.write_param(b, sl.param)
        dp._disk_slices = None
    if dp.stage.gathers_parameters_after_step:
        for buf in dp.buckets:
            (buf.comm or dp.comm).all_gather_flat(buf.full, buf.full[buf.lo:buf.hi])


@torch.no_grad()
def start_masters_precisely(dp: DataParallel) -> None:
    """Master copies made from the parameters start at their narrower dtype's rounding;
    where the buffers kept their drawn values more precisely (`FlatBuffer.precise`),
    the masters start from those. Every rank calls it (a load, for disk offload's
    files and stages 1-2's gather)."""
    if not any(buf.precise is not None for buf in dp.buckets):
        return
    for buf, sl in zip(dp.buckets, owned_slices(dp)):
        if buf.precise is not None and sl.master is not None:
            sl.master.copy_(buf.precise)
        buf.precise = None
    owned_slices_loaded(dp)
