"""Ring attention over the context-parallel group, as one autograd Function.

Each rank holds two chunks of queries, keys and values (see `sharding`). Forward: for
c steps, the rank attends its query chunks to the key/value chunks it holds, while the
next pair travels: it sends what it holds to the next rank and receives the previous
rank's, posted before the step's compute and waited after it. Each step is one piece
(`sharding.visible`: the queries and keys that see each other, causal only for the own
pair) and pieces merge by the log-sum-exp rule (`blocks.merge`).

Backward: keys and values go round the ring once more. At each step a rank computes its
queries' contribution to the gradients of the pair it holds and sends it straight to the
pair's owner, beside the next step's compute; the own pair's diagonal blocks come last,
so the last contribution travels while they compute. Forward keeps nothing it received,
so saved activations are those of the local shard only.

Only the kv heads travel: under grouped-query attention the queries are grouped by kv
head (`blocks.group_queries`) and a kv head is never repeated. On a gloo group whose
ranks share a host they travel through shared-memory rings between every ordered pair
(`partita.shm_channel`), where the mesh moves the group's collectives through shared
memory at every size.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from partita import shm_share
from partita.comm import GroupComm
from partita.context_parallel import blocks
from partita.context_parallel.clock import IDLE
from partita.context_parallel.sharding import own_blocks, visible
from partita.shm_channel import Channels, open_channels

# Per context-parallel group, its shared-memory rings (None: gloo), made by its first
# exchange: every member reaches that at the same point (the first layer's forward).
_RINGS: weakref.WeakKeyDictionary[GroupComm, Channels | None] = weakref.WeakKeyDictionary()


def _rings(comm: GroupComm) -> Channels | None:
    if comm not in _RINGS:
        pairs = [(a, b) for a in range(comm.size) for b in range(comm.size) if a != b]
        _RINGS[comm] = open_channels(comm, pairs, shm_share.group_timeout(comm.group),
                                     "context-parallel")
    return _RINGS[comm]


class RingExchange:
    """Point-to-point exchanges within the group, by offset: every rank sends to the rank
    `hops` ahead and receives from the rank `hops` behind (a ring step is hops=1)."""

    def __init__(self, comm: GroupComm) -> None:
        self.comm = comm

    def start(self, tensors: list[torch.Tensor], hops: int = 1) -> _Pending:
        i, n = self.comm.index, self.comm.size
        rings = _rings(self.comm) if tensors[0].device.type == "cpu" else None
        if rings is not None:
            received = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
            works = [rings.send((i + hops) % n, t) for t in tensors]
            works += [rings.recv((i - hops) % n, r) for r in received]
            return _Pending(works, received, tensors)
        to, source = self.comm.ranks[(i + hops) % n], self.comm.ranks[(i - hops) % n]
        received = [torch.empty_like(t) for t in tensors]
        ops = [self.comm.p2p_op(True, t, to) for t in tensors]
        ops += [self.comm.p2p_op(False, r, source) for r in received]
        return _Pending(dist.batch_isend_irecv(ops) if ops else [], received, tensors)


class _Pending:
    def __init__(self, works: list, received: list[torch.Tensor],
                 sent: list[torch.Tensor]) -> None:
        self.works, self.received, self.sent = works, received, sent

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        self.sent = []  # the sent tensors may be freed only now
        return self.received


class RingAttention(torch.autograd.Function):
    """Causal attention of q (b, h, s, d) against k, v (b, g, s, d) sharded over `comm`."""

    @staticmethod
    def forward(ctx, q, k, v, comm: GroupComm, scale: float, segments=None, clock=IDLE):
        g, n = k.shape[1], q.shape[2] // 2
        rank, degree = comm.index, comm.size
        qg = blocks.group_queries(q, g)
        out = lse = None
        ring = RingExchange(comm)
        kv = torch.stack((k, v))
        for step in range(degree):
            pending = ring.start([kv]) if step < degree - 1 else None
            src = (rank - step) % degree
            rows, keys, causal = visible(rank, src, n)
            with clock.compute():
                part_out, part_lse = blocks.forward(
                    qg[..., rows, :], kv[0][..., keys, :], kv[1][..., keys, :], scale, causal,
                    blocks.pair_documents(segments, rank, src, degree, rows, keys))
                out, lse = blocks.merge_rows(out, lse, part_out, part_lse, rows)
            if pending is not None:
                (kv,) = pending.wait()
        returned, saved = blocks.merged_output(out, q)
        ctx.save_for_backward(q, k, v, saved, lse)
        ctx.comm, ctx.scale, ctx.segments, ctx.clock = comm, scale, segments, clock
        return returned

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm, segments, clock = ctx.comm, ctx.segments, ctx.clock
        rank, degree, n = comm.index, comm.size, q.shape[2] // 2
        grads = blocks.QueryGradients(q, k.shape[1], out, lse, grad_out, ctx.scale)
        work = grads.work

        def piece(held, src: int, rows: slice, keys: slice, causal: bool, into) -> None:
            dk, dv = grads.piece(held[0][..., keys, :], held[1][..., keys, :], rows, causal,
                                 blocks.pair_documents(segments, rank, src, degree, rows, keys))
            into[0][..., keys, :] += dk
            into[1][..., keys, :] += dv

        ring = RingExchange(comm)
        own = torch.stack((k, v))
        # Gradients accumulate (and travel) in the compute dtype.
        mine = torch.zeros(own.shape, dtype=work, device=own.device)
        first, last = own_blocks(n)
        moving = ring.start([own]) if degree > 1 else None
        with clock.compute():
            piece(own, rank, *first, mine)
        returning = None
        for step in range(1, degree):
            (held,) = moving.wait()
            moving = ring.start([held]) if step < degree - 1 else None
            src = (rank - step) % degree
            theirs = torch.zeros(held.shape, dtype=work, device=held.device)
            with clock.compute():
                piece(held, src, *visible(rank, src, n), theirs)
            if returning is not None:
                mine += returning.wait()[0]
            # Straight back to the pair's owner, `step` ranks behind; what arrives is
            # the contribution of the rank `step` ahead to this rank's pair.
            returning = ring.start([theirs], hops=-step)
        # The own pair's diagonal blocks last, hiding the last contribution's way home.
        with clock.compute():
            for block in last:
                piece(own, rank, *block, mine)
        if returning is not None:
            mine += returning.wait()[0]
        return (grads.result(), mine[0].to(k.dtype), mine[1].to(v.dtype),
                None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: GroupComm,
                   scale: float, segments: torch.Tensor | None = None,
                   clock=IDLE) -> torch.Tensor:
    """`segments` (b, s): documents of the whole packed sequence (None: one per row);
    `clock` (an `AttentionClock`) adds up the seconds spent computing pieces."""
    return RingAttention.apply(q, k.contiguous(), v.contiguous(), comm, scale, segments,
                               clock)
