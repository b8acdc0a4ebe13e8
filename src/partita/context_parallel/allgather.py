"""All-gather attention over the context-parallel group, as one autograd Function.

Every rank gathers the keys and values of the whole sequence once per layer (one
all-gather of the packed pair) and attends its queries to its own pair while the
gather runs, then to the other ranks' pairs in at most two calls of the kernel
(`sharding.visible` says which rows see which chunks). Backward gathers them again
rather than keeping the whole sequence between forward and backward (saved activations
stay those of the local shard), and returns key/value gradients to their owners with
one reduce-scatter, which runs beside the own pair's diagonal blocks.

Keys and values travel packed in one tensor, through partita's own counted collectives;
the backward has a float64 gradient test of its own (tests/dist/test_context_parallel.py).
"""

from __future__ import annotations

import torch

from partita.comm import GroupComm
from partita.context_parallel import blocks
from partita.context_parallel.clock import IDLE
from partita.context_parallel.sharding import own_blocks, positions, visible


def _gather(kv: torch.Tensor, comm: GroupComm):
    """Start gathering (2, b, g, 2n, d) from each rank: (the (c, 2, b, g, 2n, d) buffer in
    rank order, the pending work)."""
    out = kv.new_empty((comm.size, *kv.shape))
    return out, comm.all_gather_flat(out, kv.contiguous(), async_op=True)


class _Piece:
    """Local query rows against keys gathered from several ranks' pairs, all visible."""

    def __init__(self, rows: slice, keys: list[tuple[int, slice]]) -> None:
        self.rows, self.keys = rows, keys

    def take(self, gathered: torch.Tensor) -> torch.Tensor:
        """(2, b, g, keys, d): the piece's keys and values, side by side."""
        parts = [gathered[src][..., cols, :] for src, cols in self.keys]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)

    def give(self, grads: torch.Tensor, into: torch.Tensor) -> None:
        """Add the piece's key/value gradients (2, b, g, keys, d) to their ranks' slots."""
        start = 0
        for src, cols in self.keys:
            width = cols.stop - cols.start
            into[src][..., cols, :] += grads[..., start:start + width, :]
            start += width

    def documents(self, segments: torch.Tensor | None, rank: int,
                  degree: int) -> torch.Tensor | None:
        if segments is None:
            return None
        local = segments.shape[1] // degree
        keys = torch.cat([positions(src, degree, local)[cols] for src, cols in self.keys])
        return blocks.document_mask(segments, positions(rank, degree, local)[self.rows], keys)


def _others(rank: int, degree: int, n: int) -> list[_Piece]:
    """The other ranks' pairs in at most two pieces, each one call of the kernel: every
    earlier rank's first chunk against all local queries, every later rank's pair
    against the second query chunk (`sharding.visible`)."""
    pieces = []
    for group in (range(rank), range(rank + 1, degree)):
        if len(group):
            rows = visible(rank, group[0], n)[0]
            pieces.append(_Piece(rows, [(src, visible(rank, src, n)[1]) for src in group]))
    return pieces


class AllGatherAttention(torch.autograd.Function):
    """Causal attention of q (b, h, s, d) against k, v (b, g, s, d) sharded over `comm`."""

    @staticmethod
    def forward(ctx, q, k, v, comm: GroupComm, scale: float, segments=None, clock=IDLE):
        g, n = k.shape[1], q.shape[2] // 2
        rank, degree = comm.index, comm.size
        own = torch.stack((k, v))
        gathered, gathering = _gather(own, comm)
        qg = blocks.group_queries(q, g)
        everything = slice(0, 2 * n)
        with clock.compute():  # the own pair while the others arrive
            out, lse = blocks.forward(qg, k, v, scale, True, blocks.pair_documents(
                segments, rank, rank, degree, everything, everything))
        gathering.wait()
        with clock.compute():
            for piece in _others(rank, degree, n):
                kv = piece.take(gathered)
                part_out, part_lse = blocks.forward(qg[..., piece.rows, :], kv[0], kv[1],
                                                    scale, False,
                                                    piece.documents(segments, rank, degree))
                out, lse = blocks.merge_rows(out, lse, part_out, part_lse, piece.rows)
        returned, saved = blocks.merged_output(out, q)
        ctx.save_for_backward(q, k, v, saved, lse)
        ctx.comm, ctx.scale, ctx.segments, ctx.clock = comm, scale, segments, clock
        return returned

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm, segments, clock = ctx.comm, ctx.segments, ctx.clock
        rank, degree, n = comm.index, comm.size, q.shape[2] // 2
        own = torch.stack((k, v))
        gathered, gathering = _gather(own, comm)
        grads = blocks.QueryGradients(q, k.shape[1], out, lse, grad_out, ctx.scale)
        work = grads.work

        def piece(kv, rows: slice, causal: bool, documents, keys: slice = slice(None)):
            return torch.stack(grads.piece(kv[0][..., keys, :], kv[1][..., keys, :], rows,
                                           causal, documents))

        # Gradients accumulate (and are reduce-scattered) in the compute dtype: the
        # other ranks' in the gathered layout, so that each slot goes home with one
        # reduce-scatter; the own pair's apart, its blocks split around the transfers.
        mine = torch.zeros(own.shape, dtype=work, device=own.device)
        theirs = torch.zeros(gathered.shape, dtype=work, device=gathered.device)
        first, last = own_blocks(n)

        def own_block(rows: slice, keys: slice, causal: bool) -> None:
            mine[..., keys, :] += piece(own, rows, causal, blocks.pair_documents(
                segments, rank, rank, degree, rows, keys), keys)

        with clock.compute():
            own_block(*first)
        gathering.wait()
        with clock.compute():
            for other in _others(rank, degree, n):
                other.give(piece(other.take(gathered), other.rows, False,
                                 other.documents(segments, rank, degree)), theirs)
        returned = own.new_empty(own.shape, dtype=work)
        returning = comm.reduce_scatter_flat(returned, theirs, async_op=True)
        with clock.compute():
            for block in last:
                own_block(*block)
        returning.wait()
        mine += returned
        return (grads.result(), mine[0].to(k.dtype), mine[1].to(v.dtype),
                None, None, None, None)


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: GroupComm,
                        scale: float, segments: torch.Tensor | None = None,
                        clock=IDLE) -> torch.Tensor:
    """`segments` (b, s): documents of the whole packed sequence (None: one per row);
    `clock` (an `AttentionClock`) adds up the seconds spent computing pieces."""
    return AllGatherAttention.apply(q, k.contiguous(), v.contiguous(), comm, scale, segments,
                                    clock)
